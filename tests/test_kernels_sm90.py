"""The communication kernels compile for H100/H200 (sm_90), here, without a GPU.

The CPU tests run the kernels in Triton's interpreter, which accepts code the GPU compiler
rejects (and never links NVSHMEM). This compiles every kernel variant to a cubin with
Triton's CUDA backend, in a subprocess because the interpreter is on in this one
(tests/sm90_compile.py). Multi-node variants link NVSHMEM's device bitcode: compiled when
nvshmem4py, the nvidia-nvshmem-cu13 wheel (in the test extra) or RAY_EP_NVSHMEM_BITCODE
provides it, skipped otherwise.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")
ROOT = SCRIPT.parent.parent


def _bitcode() -> str | None:
    path = os.environ.get("RAY_EP_NVSHMEM_BITCODE")
    if path:
        return path
    try:
        import nvshmem.core as nvc

        return nvc.find_device_bitcode_library()
    except Exception:
        pass
    # the library's wheel alone (the test extra installs it, no GPU needed to compile against it)
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except ModuleNotFoundError:  # no nvidia namespace package at all
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "lib" / "libnvshmem_device.bc"
        if path.is_file():
            return str(path)
    return None


def _compile(*flags: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "nvfp4"])
def test_single_node_kernels_compile(dtype):
    out = _compile(*([f"--{dtype}"] if dtype != "bf16" else []))
    lines = [line for line in out.splitlines() if line.startswith("OK")]
    # fused, send and recv of dispatch and combine; the dispatch's fused and send three times
    # (the small-batch layout, in wider steps with a token per SM or fewer, and the layout from
    # block bases), the combine's three twice (a token per SM or fewer takes wider steps); all
    # of it again under an SM budget but the dispatch's receive (the same tile), the
    # small-batch steps and the fused dispatch of a full batch (under a budget more tokens than
    # SMs run as send and receive, see dispatch_fused); under the budget the receive that sums
    # beside the Hopper combine send, waiting on its flags; the pull combine's send (one tile
    # with or without a budget) and its receive for each of the three batches; nvfp4 adds its quantise and
    # dequantise kernels, and the pass that decodes nvfp4 rows for a bf16-weight grouped GEMM
    # and that GEMM; plus the layout kernels: block_bases' two (counts per token block, their
    # scan) for a send with every SM; under a budget the counts per chunk, then the assign
    # inside the bf16 / fp8 send, or in compute_layout's second launch for nvfp4. An nvfp4 send
    # with every SM takes 2048 channels per step with or without a token per SM, so its
    # small-batch layout compiles once for both (fused and send: two variants fewer)
    assert len(lines) == (30 if dtype == "nvfp4" else 27), out
    combines = [line for line in lines if "_combine_" in line]
    assert sum("_combine_recv" in line and "flags=True" in line for line in combines) == 1, out
    assert sum("pull=True" in line for line in combines) == 4, out
    assert all("nvshmem=False" in line for line in lines), out
    # rows leave in 8- or 16-byte vector stores, never byte by byte: the peer pointers carry
    # their 16-byte alignment (before they did not, and every bf16 row went out in 2-byte
    # stores, every fp8 row in 1-byte ones). nvfp4's e4m3 block scales, one byte per 16
    # channels, go out as bytes (the kernels that quantise to nvfp4)
    scales = ("_dispatch_", "_quantize_nvfp4") if dtype == "nvfp4" else ()
    comm = [line for line in lines if not any(name in line for name in scales)]
    assert all("narrow_stores=0," in line for line in comm), out
    # under an SM budget (whole-SM programs of 32 warps) a dispatch send is alone on its SM: no
    # barrier in the loop that stores its rows, or every warp waits for the slowest at each step
    # (nvfp4's 8 rows x 2048 channels take 16 warps: a pair of blocks per thread)
    budget_warps = "warps=16," if dtype == "nvfp4" else "warps=32,"
    alone = [line for line in lines if "_dispatch_" in line and "recv" not in line and budget_warps in line]
    assert len(alone) == 3, out  # fused and send for a small batch, send for a full one
    assert all("row_loop_barriers=0," in line for line in alone), out
    # nor a combine's send around its rows: it once picked each slot's expert row out of the
    # block's [rows, K] meta tile through shared memory (16 barriers a block, ~7% of the
    # combine at 24 SMs on 4x H200)
    sends = [line for line in combines if "recv" not in line and "warps=32," in line and "pull=False" in line]
    assert len(sends) == 2, out  # fused and send
    assert all("block_loop_barriers=0," in line for line in sends), out
    # no running value read by every warp and moved on by one without a barrier between: the
    # chunked send's assign once did, and a warp that loaded late numbered its entries past the
    # block's (two entries on one ordinal, now and then on a GPU, never in the interpreter)
    assert all("unfenced_updates=0," in line for line in lines), out


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "nvfp4"])
def test_multi_node_kernels_compile_with_nvshmem(dtype):
    bitcode = _bitcode()
    if bitcode is None:
        pytest.skip("no NVSHMEM device bitcode (pip install -e '.[test]' or nvidia-nvshmem-cu13, or set "
                    "RAY_EP_NVSHMEM_BITCODE)")
    out = _compile("--multi-node", "--bitcode", bitcode, *([f"--{dtype}"] if dtype != "bf16" else []))
    # every kernel that reaches a peer links NVSHMEM, in each form recorded (token counts and
    # budgets specialise them differently: a count of forms would break with every new one)
    sends = [line for line in out.splitlines() if line.startswith("OK") and ("send" in line or "fused" in line)]
    names = {line.split()[1] for line in sends}
    assert names == {"_dispatch_fused_kernel", "_dispatch_send_kernel", "_combine_fused_kernel",
                     "_combine_send_kernel"}, out
    assert all("nvshmem=True" in line for line in sends), out


def test_fp8_expert_kernels_compile_to_fp8_tensor_cores():
    # grouped GEMMs with fp8 weights over fp8, bf16 and nvfp4 rows; SwiGLU with bf16 and fp8
    # output. The GEMMs must multiply on Hopper's fp8 tensor cores (wgmma with e4m3 operands)
    out = _compile("--fp8-experts")
    lines = [line for line in out.splitlines() if line.startswith("OK") and "(gluon)" not in line]
    gemms = [line for line in lines if "_grouped_gemm_kernel" in line]
    # bf16 and nvfp4 rows per expert row; bf16 rows per receive region (the recorded launches'
    # bf16 rows all take steps of 4 rows x 1024 channels)
    quantise = [line for line in lines if "_convert_rows_kernel" in line]
    swiglu = [line for line in lines if "_swiglu_kernel" in line]
    # the GEMM's decode and prefill tiles, and the decode tile reading rows through row ids
    # (every variant reads fp8 rows: others are quantised first)
    assert len(gemms) == 3 and len(swiglu) == 2 and len(quantise) == 3, out
    assert len(lines) == len(gemms) + len(swiglu) + len(quantise), out
    assert all("wgmma=e4m3" in line for line in gemms), out
    assert all("tma=True" in line for line in gemms), out  # weight tiles arrive by bulk copies
    # no K loop reads a scale it loads before its dot (v32's decode down GEMM: 4 such reads, the
    # scale product formed before the dot; v33 carries the next d tile's product)
    assert all("early_load_uses=0," in line for line in gemms), out
    # pipelined: at least 3 stages of the 128 x 128 fp8 B tile (16 KB) in shared memory (plus
    # the fp8 A tiles). Measured: 96 KB for 64-row tiles, 128 KB for 128-row ones
    shared = [int(line.rsplit("shared=", 1)[1]) for line in gemms]
    assert all(b >= 3 * 16 * 1024 for b in shared), out
    # the Hopper kernel in Gluon: fp8 tensor cores, warp-specialised, weights by TMA; rows by
    # TMA in place, or gathered by 16-byte async copies; 3 stages of 48 KB and 64 KB of output
    # halves leaving by bulk stores (the SwiGLU form: 4 stages and two 8 KB fp8 halves)
    gluon = [line for line in out.splitlines() if line.startswith("OK") and "(gluon)" in line]
    assert len(gluon) == 3, out  # in place, gathered, gathered with the SwiGLU stored in fp8
    assert all("wgmma=e4m3" in line and "tma=True" in line and "warp_specialized=True" in line for line in gluon), out
    gathered = [line for line in gluon if "gather=True" in line]
    assert len(gathered) == 2 and all(int(line.split("cp_async16=")[1].split(",")[0]) >= 8 for line in gathered), out
    assert all(int(line.rsplit("shared=", 1)[1]) >= 3 * 48 * 1024 + 64 * 1024 for line in gluon), out
    # at most a few words of spills (v32: 0 bytes in place, 32 gathering, 44 gathering with the
    # SwiGLU; outside the K loops)
    assert all(int(line.split("spill_bytes=")[1].split(",")[0]) <= 64 for line in gluon), out
    # no K loop reads a scale it loads before its first wgmma (v32's kernel: 5-9 such reads, each
    # an L2 round trip before every K block's wgmma; v33: none, the down GEMM 6-7% faster)
    assert all(int(line.split("early_load_uses=")[1].split(",")[0]) == 0 for line in gluon), out


def test_hopper_combine_send_compiles_warp_specialised_without_spills():
    # the combine's send under an SM budget on Hopper (kernels/combine_sm90.py): expert rows by
    # TMA bulk copies into shared memory, a producer warp and a consumer warpgroup per half of
    # the blocks; rows leave in 16-byte stores. deepseek-v3's 7168 channels in one chunk of a row,
    # 16384 in two, 192 (not a multiple of 128) in boxes of 64 channels; the form that flags
    # its blocks for the sum beside it too
    out = _compile("--combine-sm90")
    lines = [line for line in out.splitlines() if line.startswith("OK")]
    assert len(lines) == 4, out
    assert sum("flags=True" in line for line in lines) == 2, out
    assert all("tma=True" in line and "warp_specialized=True" in line for line in lines), out
    assert all("spill_bytes=0," in line and "narrow_stores=0," in line for line in lines), out
    assert "hidden=7168, chunks=1, box=32x256" in out and "hidden=16384, chunks=2" in out, out
    assert "hidden=192, chunks=1, box=4x64" in out, out
    # every ring in one SM's shared memory (227 KB), one program per SM
    assert all(int(line.rsplit("shared=", 1)[1]) <= 227 * 1024 for line in lines), out
