"""Compile the communication kernels for an H100/H200 (sm_90) on a machine without a GPU.

Runs the launchers of ``ray_ep.kernels`` on CPU tensors with ``launch`` replaced by a recorder,
then compiles each recorded kernel to a cubin with Triton's CUDA backend (ptxas ships with
Triton). Kernels of a multi-node topology call NVSHMEM: they are linked against NVSHMEM's
device bitcode when ``--bitcode PATH`` (or nvshmem4py) provides it, else skipped.

    python tests/sm90_compile.py [--bitcode PATH] [--multi-node] [--fp8 | --nvfp4] [--fp8-experts]

With --nvfp4 it also compiles the nvfp4 quantise / dequantise kernels and the grouped GEMM that
unpacks nvfp4 rows (their launches are recorded the same way).

With --fp8-experts it compiles only the expert kernels with fp8 weights (grouped GEMMs, the
Hopper one in Gluon too, and the SwiGLU with fp8 output), specialised as the JIT would for the recorded arguments (strides
of 1, 16-byte alignment), so the shared memory shows the GEMM's pipeline stages. Each line
names the tensor-core instructions the kernel uses (wgmma=e4m3 for fp8 operands) and its
shared memory in bytes.

Prints one line per kernel and exits 1 when one fails. Must run without TRITON_INTERPRET
(tests/test_kernels_sm90.py starts it in a subprocess).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

import torch

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv"}


def record_launches(cfg) -> list[tuple]:
    """(kernel, args, meta, warps) of one fused and one split dispatch and combine of ``cfg`` on
    rank 0; under an SM budget with push also the receive that sums beside the Hopper combine
    send (its waits on the send's per-block flags: the GPU takes that form, the CPU never)."""
    from ray_ep.kernels import _util, combine, dispatch, layout
    from ray_ep.transport.local import LocalWorld

    seen: list[tuple] = []

    def fake_launch(kernel, *, work, device, budget, resident, args, meta, warps=4):
        _util.check_names(kernel, args, meta)  # every parameter named, none twice or unknown
        seen.append((kernel, args, meta, warps))

    for mod in (_util, dispatch, combine, layout):
        mod.launch = fake_launch
    world = LocalWorld.create(cfg, device="cpu")
    bufs, ws = world.bufs[0], world.workspaces[0]
    K = cfg.top_k
    y = torch.zeros(cfg.max_recv_rows, cfg.hidden_size, dtype=torch.bfloat16)
    # decode-sized (a token per SM or fewer: the combine's small-batch step; the CPU stands in
    # for 4 SMs), a small batch (the send scans every earlier token) and a full one (from block_bases)
    for T in (4, min(64, cfg.max_tokens_per_rank), cfg.max_tokens_per_rank):
        x = torch.zeros(T, cfg.hidden_size, dtype=torch.bfloat16)
        ids = torch.zeros(T, K, dtype=torch.int32)
        w = torch.zeros(T, K)
        h = dispatch.dispatch_fused(cfg=cfg, x_TH=x, topk_ids_TK=ids, topk_weights_TK=w, bufs=bufs, ws=ws, check=False)
        combine.combine_fused(cfg=cfg, y_MH=y, handle=h, bufs=bufs, ws=ws, check=False)
        lay = dispatch.dispatch_send(cfg=cfg, x_TH=x, topk_ids_TK=ids, topk_weights_TK=w, bufs=bufs, ws=ws)
        h = dispatch.dispatch_recv(cfg=cfg, layout=lay, bufs=bufs, ws=ws, num_tokens=T, check=False)
        combine.combine_send(cfg=cfg, y_MH=y, handle=h, bufs=bufs, ws=ws)
        combine.combine_recv(cfg=cfg, handle=h, bufs=bufs, ws=ws, check=False)
        if cfg.num_sms and cfg.combine_mode == "push":
            out = torch.zeros(T, cfg.hidden_size, dtype=torch.bfloat16)
            combine._launch_recv(cfg, h, bufs, ws, out, None, combine.overlap_sum_sms(cfg.num_sms), flags=True)
    return seen


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](**kw)`` records (kernel, args, meta,
    options) in ``seen`` instead of launching."""

    def __init__(self, kernel, seen: list):
        self.kernel, self.seen = kernel, seen
        self.meta_names = {p.name for p in kernel.params if p.is_constexpr}

    def __getitem__(self, grid):
        def call(**kw):
            opts = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
            meta = {k: v for k, v in kw.items() if k in self.meta_names}
            self.seen.append((self.kernel, {k: v for k, v in kw.items() if k not in meta}, meta, opts))
        return call


def _record(names: list[tuple], body) -> list[tuple]:
    """Run ``body()`` with the kernels ``names`` [(module, attribute)] replaced by recorders and
    the grouped GEMM's tile set to the GPU's; the GPU's dots (DOT_FP32 off) in what it records."""
    from ray_ep.kernels import grouped_gemm

    seen: list[tuple] = []
    real = [(mod, name, getattr(mod, name)) for mod, name in names]
    launch_config = grouped_gemm._launch_config
    for mod, name, k in real:
        setattr(mod, name, _Recorder(k, seen))
    grouped_gemm._launch_config = lambda device, **kw: launch_config(torch.device("cuda"), **kw)  # needs no GPU
    try:
        body()
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        grouped_gemm._launch_config = launch_config
        for mod, name, k in real:
            setattr(mod, name, k)
    for _, _, meta, _ in seen:
        if "DOT_FP32" in meta:
            meta["DOT_FP32"] = False  # the GPU's bf16 / fp8 dot
    return seen


def record_nvfp4_format_launches() -> list[tuple]:
    """(kernel, args, meta, options) of the nvfp4 quantise and dequantise kernels and of the
    grouped GEMM (bf16 weights) over nvfp4 rows, with the GPU's tile: the pass that decodes
    its real rows to bf16 and the bf16 GEMM (its launchers run with the kernels replaced by
    recorders: nothing is launched)."""
    from ray_ep.kernels import grouped_gemm, nvfp4
    from ray_ep.nvfp4 import quantize_nvfp4_torch

    def body():
        H, O, rows = 256, 128, 64
        x = torch.zeros(rows, H, dtype=torch.bfloat16)
        q, s = quantize_nvfp4_torch(x)
        nvfp4.quantize_nvfp4(x_TH=x)  # the GPU's row tile (no TRITON_INTERPRET here)
        nvfp4.dequantize_nvfp4(q_TP=q, scales_TB=s)
        os.environ["TRITON_INTERPRET"] = "1"  # the GEMM launcher's CPU-tensor check; nothing runs
        grouped_gemm.grouped_gemm(a=q, a_scales=s, b_LDO=torch.zeros(2, H, O, dtype=torch.bfloat16),
                                  row_offsets_L1=torch.tensor([0, rows // 2, rows], dtype=torch.int32),
                                  num_tokens_L=torch.tensor([rows // 2, rows // 2], dtype=torch.int32))

    return _record([(nvfp4, "_quantize_nvfp4_kernel"), (nvfp4, "_dequantize_nvfp4_kernel"),
                    (grouped_gemm, "_convert_rows_kernel"), (grouped_gemm, "_grouped_gemm_kernel")], body)


def record_fp8_expert_launches() -> list[tuple]:
    """(kernel, args, meta, options) of the expert kernels with fp8 weights, GPU tiles: the
    grouped GEMM over fp8 rows (as they come from fp8 dispatch), bf16 rows and nvfp4 rows
    (both quantised to fp8 rows first, by the row quantisation kernel: per expert row, or per
    receive region), with K-major fp8
    weights and block scales; and the SwiGLU with fp8 output (plus its bf16 form)."""
    from ray_ep.fp8 import quantize_fp8_blocks_torch, quantize_fp8_torch
    from ray_ep.kernels import activation, grouped_gemm
    from ray_ep.nvfp4 import quantize_nvfp4_torch

    def body():
        H, O = 1024, 256  # a K loop of 8 blocks: long enough to pipeline
        q, s = quantize_fp8_blocks_torch(torch.zeros(2, H, O))
        b = q.transpose(1, 2).contiguous().transpose(1, 2)  # K-major, as LocalExperts holds it
        os.environ["TRITON_INTERPRET"] = "1"  # the launchers' CPU-tensor check; nothing runs
        # 32 capacity rows per expert: the decode tile; 512: the prefill tile (fp8 rows only)
        for rows in (64, 1024):
            x = torch.zeros(rows, H, dtype=torch.bfloat16)
            segs = dict(row_offsets_L1=torch.tensor([0, rows // 2, rows], dtype=torch.int32),
                        num_tokens_L=torch.tensor([rows // 2, rows // 2], dtype=torch.int32))
            for a, a_s in ((x, None), quantize_fp8_torch(x), quantize_nvfp4_torch(x))[:3 if rows == 64 else 2]:
                grouped_gemm.grouped_gemm(a=a, a_scales=a_s, b_LDO=b, b_scales=s, **segs)
        # bf16 rows of a receive buffer (2 regions of 32 rows): quantised region by region
        grouped_gemm.grouped_gemm(a=x[:64], b_LDO=b, b_scales=s, a_row_ids=torch.zeros(64, dtype=torch.int32),
                                  a_regions=(torch.tensor([32, 32], dtype=torch.int32), 32),
                                  row_offsets_L1=torch.tensor([0, 32, 64], dtype=torch.int32),
                                  num_tokens_L=torch.tensor([32, 32], dtype=torch.int32))
        F = 256
        h = torch.zeros(rows, 2 * F, dtype=torch.bfloat16)
        ids = torch.zeros(rows, dtype=torch.int32)
        tot = torch.tensor([rows], dtype=torch.int32)
        os.environ.pop("TRITON_INTERPRET")  # the GPU's row tile for the SwiGLU
        activation._check_launchable = lambda device: None
        activation.swiglu(h_M2F=h, row_ids_M=ids, total_rows=tot)
        activation.swiglu(h_M2F=h, row_ids_M=ids, total_rows=tot, out=torch.zeros(rows, F, dtype=torch.float8_e4m3fn),
                          out_scales=torch.ones(rows, F // 128))

    check = activation._check_launchable
    try:
        return _record([(grouped_gemm, "_grouped_gemm_kernel"), (grouped_gemm, "_convert_rows_kernel"),
                        (activation, "_swiglu_kernel")], body)
    finally:
        activation._check_launchable = check


def compile_fp8_gemm_sm90(gather: bool, swiglu: bool = False):
    """The Gluon grouped GEMM with fp8 weights (:mod:`ray_ep.kernels.grouped_gemm_sm90`) for
    sm_90a, rows by TMA or gathered through row ids, specialised as its launch on deepseek-v3's
    down GEMM would be (D 2048, fp8 wire rows of 2048 + 64 bytes of scales when gathered); with
    ``swiglu`` the gate_up form that stores the SwiGLU in fp8 (its output [rows, O / 2])."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ray_ep.kernels import grouped_gemm_sm90 as sm90

    L, D, O = 4, 2048, 512
    a = torch.zeros(1024, D, dtype=torch.float8_e4m3fn)
    b = torch.zeros(L * O, D, dtype=torch.float8_e4m3fn)
    ab, bb = [sm90.HALF_M.value, sm90.BLOCK_K.value], [sm90.HALF_O.value, sm90.BLOCK_K.value]
    cb = [sm90.HALF_M.value, sm90.HALF_O.value]
    # the output, stored by bulk copies
    c = torch.zeros(1024, O // 2, dtype=torch.float8_e4m3fn) if swiglu else torch.zeros(1024, O, dtype=torch.bfloat16)
    cs = torch.zeros(1024, O // 256)

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv))

    i32 = torch.zeros(4, dtype=torch.int32)
    args = dict(a_desc=None if gather else desc(a, ab), a_ptr=a, stride_am=D + 64 if gather else D,
                a_scales_ptr=torch.zeros(4), stride_sm=(D + 64) // 4, stride_sd=1, row_ids_ptr=i32,
                b_desc=desc(b, bb), b_scales_ptr=torch.zeros(4), stride_bsl=64, stride_bsd=4, stride_bso=1,
                c_ptr=c, stride_cm=c.shape[1], stride_co=1, row_offsets_ptr=i32,
                c_desc=TensorDescriptor.from_tensor(c, cb, gl.NVMMASharedLayout.get_default_for(
                    cb, gl.float8e4nv if swiglu else gl.bfloat16)),
                cs_ptr=cs, stride_csm=cs.shape[1], stride_csg=1, num_tokens_ptr=i32, counter_ptr=i32, L=5, O=O)
    meta = dict(D=D, BLOCK_L=64, NUM_STAGES=sm90.STAGES if swiglu else sm90.TMA_STORE_STAGES, GATHER=gather,
                PRODUCER_WARPS=sm90.GATHER_WARPS if gather else 1, TMA_STORE=True, SWIGLU=swiglu)
    return compile_sm90(sm90._grouped_gemm_fp8_kernel, args, meta, None, {"num_warps": 4}, specialize=True)


def combine_send_sm90_launch(hidden: int, flags: bool = False) -> tuple[dict, dict]:
    """(arguments, constexprs) of the Gluon combine send (:mod:`ray_ep.kernels.combine_sm90`)
    as its launch for a 2-rank top-8 world of ``hidden`` channels would pass them (``flags``:
    the form that flags its rows for a sum beside it)."""
    from ray_ep.config import EPConfig
    from ray_ep.kernels import combine_sm90 as sm90

    cfg = EPConfig.preset("deepseek-v3", gpus_per_node=2, hidden_size=hidden, max_tokens_per_rank=256)
    desc, meta = sm90.send_args(cfg, torch.zeros(1024, hidden, dtype=torch.bfloat16), flags=flags)
    i32, i64 = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)
    args = dict(meta_ptr=i32, src_offsets_ptr=i32, recv_counts_ptr=i32, peer_bases_ptr=i64, epochs_ptr=i64,
                send_counter_ptr=i32, off_x=4096, off_signal=128, off_ready=256, rank=3, R=2, L=128, N=256, H=hidden,
                **desc)
    return args, meta


# 16-byte async copies (cp.async) from global to shared memory in PTX: the gathered rows
_CP_ASYNC16 = re.compile(r"cp[.]async[.]cg[.]shared[.]global \[[^]]*\], \[[^]]*\], 0x10")


def _report_gluon(what: str, build) -> int:
    """Compile a Gluon kernel (``build()`` returns it compiled) and print one line of what its
    PTX and SASS show; 1 (and a FAIL line) if it does not compile, else 0."""
    try:
        ck = build()
        ptx = ck.asm["ptx"]
        spills, sass = _ptxas(ptx)
        print(f"OK   {what}, wgmma={_wgmma(ptx)}, tma={'cp.async.bulk.tensor' in ptx}, "
              f"cp_async16={len(_CP_ASYNC16.findall(ptx))}, "
              f"narrow_stores={_narrow_stores(ptx)}, warp_specialized={'setmaxnreg' in ptx}, spill_bytes={spills}, "
              f"early_load_uses={_early_load_uses(sass)}, shared={ck.metadata.shared}")
        return 0
    except Exception:  # noqa: BLE001 - report it
        print(f"FAIL {what}\n{traceback.format_exc()}")
        return 1


def _ptxas(ptx: str) -> tuple[int, str]:
    """(bytes the register allocator spills, the SASS) of ``ptx`` assembled for sm_90a by the
    ptxas that ships with Triton (disassembled by its cuobjdump). The Gluon GEMM's consumers
    run at the edge of their registers, and spills there cost more than the kernel gains (an
    epilogue that spilled 1156 bytes ran 2.3-2.8x slower, docs/perf.md v29)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", cubin], capture_output=True, text=True,
                             check=True).stderr
        with open(cubin, "rb") as f:
            sass = _sass(f.read())
    return int(re.search(r"(\d+) bytes spill stores", out).group(1)), sass


def _sass(cubin: bytes) -> str:
    """The SASS of a cubin (Triton's cuobjdump)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True).stdout


def _early_load_uses(sass: str) -> int:
    """In each K loop of ``sass`` (a loop whose body has a wgmma, QGMMA in SASS): the global
    loads whose value an instruction reads before the loop's first wgmma. The fp8 GEMMs load
    each K block's scales a block ahead; a use that early (ptxas moved a loaded scale into the
    register of the one before it right after the load, or formed the scale product before the
    dot, docs/perf.md v33) makes every K block's wgmma wait for an L2 round trip."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    early = 0
    for i, (a, text) in enumerate(ins):
        m = re.search(r"\bBRA 0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in at:
            continue
        body = [t for _, t in ins[at[int(m.group(1), 16)]:i + 1]]
        first = next((k for k, t in enumerate(body) if "QGMMA" in t), None)
        if first is None or len(body) > 400:  # not an inner K loop
            continue
        for k, t in enumerate(body[:first]):
            load = re.match(r"(?:@!?U?P\w+\s+)?LDG\.\S*\s+(R\d+),", t)
            if load and any(re.search(rf"\b{load.group(1)}\b", u.split(",", 1)[1] if "," in u else "")
                            for u in body[k + 1:first]):
                early += 1
    return early


def _wgmma(ptx: str) -> str:
    """The operand type of the Hopper tensor-core instructions in ``ptx`` (e4m3, bf16), or no."""
    kinds = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.f32\.(\w+)\.", ptx)))
    return "+".join(kinds) or "no"


def _narrow_stores(ptx: str) -> int:
    """Global stores of 1 or 2 bytes in ``ptx``: row data stored that way (to a peer over
    NVLink, above all) costs 8 to 16 times the store instructions of a 16-byte vector."""
    return len(re.findall(r"st\.global(?:\.\w+)*?\.b(?:8|16)\b", ptx))


_VECTOR_STORE = r"st\.global(?:\.\w+)*?\.(?:v[24]|b64)\b"  # 8 or 16 bytes a thread: a row's values
_BARRIER = r"\bbar(?:rier)?\.sync\b"


def _loops(lines: list[str]) -> list[tuple[int, int]]:
    """The loops of PTX ``lines`` as [label line, backward branch line] ranges."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\$L__\w+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if m and labels.get(m.group(1), i + 1) <= i:  # a branch back: the loop [label, branch]
            loops.append((labels[m.group(1)], i))
    return loops


def _inside(inner: tuple[int, int], outer: tuple[int, int]) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1] and inner != outer


def _row_loops(lines: list[str], loops: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The innermost loops that store vectors (rows of bf16, fp8 or packed nvfp4)."""
    return [lp for lp in loops if not any(_inside(o, lp) for o in loops)
            and any(re.search(_VECTOR_STORE, line) for line in lines[lp[0]:lp[1] + 1])]


def _row_loop_barriers(ptx: str) -> int:
    """Barriers (``bar.sync``) inside the row-storing innermost loops of ``ptx``. Under an SM
    budget a program is alone on its SM, and a barrier in its channel loop makes all of its
    warps wait for the slowest at every step (fp8's scales once did, through shared memory:
    16-18% of the send)."""
    lines = ptx.splitlines()
    return sum(1 for a, b in _row_loops(lines, _loops(lines)) for line in lines[a:b + 1] if re.search(_BARRIER, line))


def _block_loop_barriers(ptx: str) -> int:
    """Barriers in the loops just around the row-storing channel loops of ``ptx`` (a block's
    work: its rows, slots and meta), outside those channel loops. Under an SM budget each
    stops every warp once per block: the combine's send picked each slot's row out of a
    [rows, K] tile through shared memory, 16 barriers a block (8 rows, K 8)."""
    lines = ptx.splitlines()
    loops = _loops(lines)
    rows = _row_loops(lines, loops)
    blocks = {min((o for o in loops if _inside(lp, o)), key=lambda o: o[1] - o[0]) for lp in rows
              if any(_inside(lp, o) for o in loops)}
    return sum(1 for a, b in blocks for i in range(a, b + 1)
               if re.search(_BARRIER, lines[i]) and not any(c <= i <= d for c, d in rows))


_VOLATILE_LOAD = re.compile(r"ld[.]volatile[.]global[^[]*\[\s*(%rd\d+)")


def _unfenced_updates(ptx: str) -> int:
    """Volatile loads of a global word that a later store overwrites through the same address
    register with no CTA barrier (``bar.sync``) between: a running value that every warp reads
    and one warp moves on. A warp that loads after another warp's store reads it already moved
    on (the chunked send's assign numbered entries twice that way now and then; docs/perf.md
    v45)."""
    lines = ptx.splitlines()
    n = 0
    for i, line in enumerate(lines):
        m = _VOLATILE_LOAD.search(line)
        if not m:
            continue
        store = re.compile(r"\bst[.]global[^[]*\[\s*" + re.escape(m.group(1)) + r"\b")
        for later in lines[i + 1:]:
            if re.search(_BARRIER, later):
                break
            if store.search(later):
                n += 1
                break
    return n


def compile_sm90(kernel, args, meta, bitcode: str | None, options: dict | None = None, specialize: bool = False):
    """A cubin of ``kernel`` for sm_90. ``specialize``: as Triton's JIT does at a launch, an
    integer argument equal to 1 becomes a constant and pointers and integers divisible by 16
    carry that hint, so strides of 1 make contiguous (vectorised, pipelined) loads as on a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor

    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in meta:
            continue
        a = args[name]
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + _DTYPES[a.dtype]
            if specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, TensorDescriptor):  # a bulk-copy (TMA) descriptor of tiles
            sig[name] = f"tensordesc<{_DTYPES[a.base.dtype]}{list(a.block_shape)}>"
        elif isinstance(a, GluonDescriptor):  # the same with its shared-memory layout
            sig[name] = mangle_type(a)
        elif a is None:
            sig[name] = "constexpr"
            constexprs[name] = None
        elif specialize and int(a) == 1:
            sig[name] = "constexpr"
            constexprs[name] = 1
        else:
            sig[name] = "i64" if abs(int(a)) >= 2**31 else "i32"
            if specialize and int(a) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for name, v in meta.items():
        sig[name] = "constexpr"
        constexprs[name] = v
    sig = {name: sig[name] for name in kernel.arg_names}  # the kernel's parameter order
    opts = {"num_warps": 4, **(options or {})}
    if meta.get("REMOTE"):
        opts["extern_libs"] = {"libnvshmem_device": bitcode}
    source = GluonASTSource if kernel.is_gluon() else ASTSource
    return triton.compile(source(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bitcode", help="libnvshmem_device.bc (default: nvshmem4py's, if installed)")
    ap.add_argument("--multi-node", action="store_true", help="a 2-node topology (kernels with NVSHMEM puts)")
    ap.add_argument("--fp8", action="store_true", help="fp8 dispatch")
    ap.add_argument("--nvfp4", action="store_true", help="nvfp4 dispatch, plus the nvfp4 format kernels and GEMM")
    ap.add_argument("--combine-sm90", action="store_true",
                    help="only the Hopper combine send in Gluon, for a few hidden sizes")
    ap.add_argument("--fp8-experts", action="store_true",
                    help="only the expert kernels with fp8 weights: grouped GEMMs over fp8, bf16 and nvfp4 "
                         "rows, and the SwiGLU with fp8 (and bf16) output")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET")
    from ray_ep.config import EPConfig

    # top-8 as the presets route: a [rows, K] tile of 8 rows then spans warps (K 4 stays in one)
    cfg = EPConfig.preset("tiny", n_nodes=2 if a.multi_node else 1, gpus_per_node=2,
                          dispatch_dtype="fp8" if a.fp8 else "nvfp4" if a.nvfp4 else "bf16", hidden_size=2048,
                          max_tokens_per_rank=512, top_k=8)
    bitcode = a.bitcode
    if a.multi_node and bitcode is None:
        try:
            from ray_ep.kernels._shmem import device_bitcode

            bitcode = device_bitcode()
        except Exception as e:  # noqa: BLE001 - no nvshmem4py here
            print(f"SKIP multi-node kernels: no NVSHMEM device bitcode ({e})")
            return 0
    failed = 0
    done = set()
    if a.combine_sm90:
        from ray_ep.kernels import combine_sm90 as sm90

        for hidden, flags in ((7168, False), (7168, True), (16384, False), (192, True)):
            args, meta = combine_send_sm90_launch(hidden, flags)
            failed += _report_gluon(
                f"_combine_send_sm90_kernel (gluon) hidden={hidden}, chunks={meta['CHUNKS']}, "
                f"box={meta['BOX_ROWS']}x{meta['BOX_W']}, flags={flags}",
                lambda: compile_sm90(sm90._combine_send_sm90_kernel, args, meta, None,
                                     {"num_warps": sm90.CONSUMER_WARPS}, specialize=True))
        return 1 if failed else 0
    if a.fp8_experts:
        launches = record_fp8_expert_launches()
    else:
        # every SM (one row per program) and, on one node, an SM budget (whole-SM programs), and
        # there the pull combine too (one node only), with and without a budget
        budgeted = cfg.model_copy(update={"num_sms": 24})
        cfgs = (cfg,) if a.multi_node else (cfg, budgeted, cfg.model_copy(update={"combine_mode": "pull"}),
                                             budgeted.model_copy(update={"combine_mode": "pull"}))
        launches = [(k, args, meta, {"num_warps": warps}) for c in cfgs for k, args, meta, warps in record_launches(c)]
    if a.nvfp4 and not a.multi_node:
        launches += record_nvfp4_format_launches()
    for kernel, args, meta, options in launches:
        key = (kernel.fn.__name__, tuple(sorted((k, str(v)) for k, v in meta.items())))
        if key in done:
            continue
        done.add(key)
        try:
            # specialised as the JIT does at a launch (alignment hints decide vector widths)
            ck = compile_sm90(kernel, args, meta, bitcode, options, specialize=True)
            print(f"OK   {kernel.fn.__name__:<28} {len(ck.asm['cubin']):>8} B cubin, "
                  f"nvshmem={'nvshmem' in ck.asm['ptx']}, wgmma={_wgmma(ck.asm['ptx'])}, "
                  f"narrow_stores={_narrow_stores(ck.asm['ptx'])}, tma={'cp.async.bulk.tensor' in ck.asm['ptx']}, "
                  f"warps={options.get('num_warps', 4)}, pull={meta.get('PULL', False)}, "
                  f"flags={meta.get('FLAGS', False)}, row_loop_barriers={_row_loop_barriers(ck.asm['ptx'])}, "
                  f"block_loop_barriers={_block_loop_barriers(ck.asm['ptx'])}, "
                  f"unfenced_updates={_unfenced_updates(ck.asm['ptx'])}, "
                  f"early_load_uses={_early_load_uses(_sass(ck.asm['cubin']))}, "
                  f"shared={ck.metadata.shared}")
        except Exception:  # noqa: BLE001 - report every kernel
            failed += 1
            print(f"FAIL {kernel.fn.__name__}\n{traceback.format_exc()}")
    if a.fp8_experts:
        for gather, swiglu in ((False, False), (True, False), (True, True)):
            what = f"_grouped_gemm_fp8_kernel (gluon) gather={gather}" + (", swiglu=True" if swiglu else "")
            failed += _report_gluon(what, lambda: compile_fp8_gemm_sm90(gather, swiglu))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
