"""grouped_gemm (Triton) against its torch twin, and the expert chain against reference.experts.

Without CUDA the kernel runs in Triton's CPU interpreter; with CUDA the same tests run compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ray_ep import reference  # noqa: E402
from ray_ep.config import EPConfig, nvfp4_row_bytes  # noqa: E402
from ray_ep.errors import EPInputError  # noqa: E402
from ray_ep.fp8 import quantize_fp8_blocks_torch  # noqa: E402
from ray_ep.kernels.activation import swiglu, swiglu_torch  # noqa: E402
from ray_ep.kernels.experts import ExpertScratch, LocalExperts, run_experts, shared_experts  # noqa: E402
from ray_ep.kernels.grouped_gemm import (decode_rows_bf16, grouped_gemm, grouped_gemm_torch,  # noqa: E402
                                         quantize_rows_fp8)
from ray_ep.inputs import make_inputs  # noqa: E402
from ray_ep.types import DispatchHandle, DispatchLayout, RecvLayout  # noqa: E402
from ray_ep.weights import init_expert_weights  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"

# Kernel vs. twin; values are O(1) (b is scaled by 1/sqrt(D)). Why these tolerances:
# - "bf16": same fp32 math, one bf16 rounding at the end. bf16 keeps 8 significant bits (one
#   ulp <= 2^-7 relative); the GPU rounds to nearest like the twin, but sums in another order
#   can tip a rounding; the CPU interpreter truncates fp32 -> bf16 (< 1 ulp). rtol = 2^-6 is
#   one ulp either way; atol covers outputs near zero (fp32 order noise ~1e-6, tiny ulps).
# - "fp8": A is bf16(fp8 * scale) before the dot. With arbitrary scales the interpreter's
#   truncation can move every A element by an ulp (2^-8 relative) against the twin's rounding;
#   over D terms that random walk reaches ~1e-2 on O(1) outputs. (On GPUs A matches exactly.)
# - "chain": gate_up GEMM -> SwiGLU -> down GEMM: up to an ulp of drift at each bf16 stage.
TOL = {
    "bf16": dict(atol=1e-2, rtol=2**-6),
    "fp8": dict(atol=3e-2, rtol=2**-6),
    "chain": dict(atol=3e-2, rtol=2**-5),
}
SENTINEL = -777.0  # exactly representable in bf16; padding rows must keep it


def make_layout(counts, align, slack):
    """Expert-major segments of ``counts`` real rows padded to ``align``, plus ``slack``
    unused rows at the end. Returns (row_offsets_L1, num_tokens_L, real_M) on ``device``."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // align) * align)
    M = offsets[-1] + slack
    real = torch.zeros(M, dtype=torch.bool)
    for e, c in enumerate(counts):
        real[offsets[e]:offsets[e] + c] = True
    return (torch.tensor(offsets, dtype=torch.int32, device=device),
            torch.tensor(counts, dtype=torch.int32, device=device), real.to(device))


def rand_b(L, D, O, gen):
    return (torch.randn(L, D, O, generator=gen) / D**0.5).to(torch.bfloat16).to(device)


def rand_a(rows, D, gen):
    return torch.randn(rows, D, generator=gen).to(torch.bfloat16).to(device)


def check(tol, real, **kwargs):
    """Kernel and twin into sentinel-filled outputs; real rows close, padding untouched."""
    M, O = real.shape[0], kwargs["b_LDO"].shape[2]
    out = torch.full((M, O), SENTINEL, dtype=torch.bfloat16, device=device)
    ref = torch.full((M, O), SENTINEL, dtype=torch.bfloat16, device=device)
    got = grouped_gemm(out=out, **kwargs)
    grouped_gemm_torch(out=ref, **kwargs)
    assert got is out
    torch.testing.assert_close(out[real].float(), ref[real].float(), **TOL[tol])
    assert bool((out[~real] == SENTINEL).all()), "padding rows were written"
    assert bool((ref[~real] == SENTINEL).all()), "the twin wrote padding rows"
    return out


@pytest.mark.parametrize(
    "counts,align,slack,D,O",
    [
        ([7, 0, 45, 1, 70], 16, 9, 160, 96),  # uneven + empty expert; D, O not tile multiples
        ([0, 0, 130, 0], 1, 0, 128, 128),  # all rows to one expert, several m tiles
        ([33, 64, 2], 8, 0, 256, 64),
        ([1], 1, 0, 64, 32),  # one token, one expert
    ],
)
def test_grouped_gemm_matches_twin(counts, align, slack, D, O):
    gen = torch.Generator().manual_seed(100 + sum(counts) + D + O)
    offsets, num_tokens, real = make_layout(counts, align, slack)
    kw = dict(a=rand_a(real.shape[0], D, gen), b_LDO=rand_b(len(counts), D, O, gen),
              row_offsets_L1=offsets, num_tokens_L=num_tokens)
    check("bf16", real, **kw)


def test_grouped_gemm_no_tokens_touches_nothing():
    gen = torch.Generator().manual_seed(7)
    offsets, num_tokens, real = make_layout([0, 0, 0], 8, 5)
    out = check("bf16", real, a=rand_a(real.shape[0], 64, gen), b_LDO=rand_b(3, 64, 32, gen),
                row_offsets_L1=offsets, num_tokens_L=num_tokens)
    assert bool((out == SENTINEL).all())


def test_grouped_gemm_gather_rows_from_larger_a():
    # A is a receive buffer of 300 rows; a_row_ids maps expert-major rows into it
    gen = torch.Generator().manual_seed(8)
    counts = [20, 0, 41, 3]
    offsets, num_tokens, real = make_layout(counts, 8, 6)
    M = real.shape[0]
    a_row_ids = torch.full((M,), -1, dtype=torch.int32)
    a_row_ids[real.cpu()] = torch.randperm(300, generator=gen)[: sum(counts)].to(torch.int32)
    check("bf16", real, a=rand_a(300, 128, gen), b_LDO=rand_b(4, 128, 64, gen),
          row_offsets_L1=offsets, num_tokens_L=num_tokens, a_row_ids=a_row_ids.to(device))


@pytest.mark.parametrize("scales", ["power-of-two", "amax"])
def test_grouped_gemm_fp8_a(scales):
    gen = torch.Generator().manual_seed(9)
    counts = [17, 0, 40]
    offsets, num_tokens, real = make_layout(counts, 4, 3)
    M, D, rows = real.shape[0], 256, 150
    if scales == "power-of-two":
        # bf16(fp8 * 2^j) is exact on every device, so the bf16 tolerance applies
        q = (torch.randn(rows, D, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = 2.0 ** torch.randint(-9, -3, (rows, D // 128), generator=gen).float()
        tol = "bf16"
    else:
        # what fp8 dispatch produces: scale = amax / 448 per 128 channels
        q, s = reference.quantize_fp8(torch.randn(rows, D, generator=gen).to(torch.bfloat16))
        tol = "fp8"
    a_row_ids = torch.full((M,), -1, dtype=torch.int32)
    a_row_ids[real.cpu()] = torch.randperm(rows, generator=gen)[: sum(counts)].to(torch.int32)
    check(tol, real, a=q.to(device), a_scales=s.to(device), b_LDO=rand_b(3, D, 96, gen),
          row_offsets_L1=offsets, num_tokens_L=num_tokens, a_row_ids=a_row_ids.to(device))


def test_grouped_gemm_fp8_without_gather():
    gen = torch.Generator().manual_seed(10)
    offsets, num_tokens, real = make_layout([5, 12], 8, 0)
    q, s = reference.quantize_fp8(torch.randn(real.shape[0], 128, generator=gen).to(torch.bfloat16))
    check("fp8", real, a=q.to(device), a_scales=s.to(device), b_LDO=rand_b(2, 128, 32, gen),
          row_offsets_L1=offsets, num_tokens_L=num_tokens)


@pytest.mark.parametrize("wire", [True, False], ids=["wire-rows", "contiguous"])
def test_grouped_gemm_nvfp4_a(wire):
    # what nvfp4 dispatch produces: packed codes and e4m3 scales, as strided views of wire rows
    # (packed H / 2 bytes, then H / 16 scales, padded) or as tensors of their own.
    # bf16(e2m1 * e4m3 scale) is exact on every device (<= 6 significant bits), so A matches
    # the twin's exactly and the bf16 tolerance applies
    gen = torch.Generator().manual_seed(19)
    counts = [17, 0, 40, 3]
    offsets, num_tokens, real = make_layout(counts, 4, 3)
    M, D, rows = real.shape[0], 160, 150  # D: 2.5 tiles of 64 (a masked tail of whole blocks)
    x = torch.randn(rows, D, generator=gen) * 10.0 ** torch.randint(-1, 2, (rows, 1), generator=gen)
    q, s = reference.quantize_nvfp4(x.to(torch.bfloat16))
    if wire:
        W = nvfp4_row_bytes(D)
        rows_W = torch.zeros(rows, W, dtype=torch.uint8)
        rows_W[:, :D // 2] = q
        rows_W[:, D // 2:D // 2 + D // 16] = s.view(torch.uint8)
        rows_W = rows_W.to(device)
        q_dev, s_dev = rows_W[:, :D // 2], rows_W[:, D // 2:D // 2 + D // 16].view(torch.float8_e4m3fn)
        assert not q_dev.is_contiguous() and not s_dev.is_contiguous()
    else:
        q_dev, s_dev = q.to(device), s.to(device)
    a_row_ids = torch.full((M,), -1, dtype=torch.int32)
    a_row_ids[real.cpu()] = torch.randperm(rows, generator=gen)[: sum(counts)].to(torch.int32)
    b = rand_b(4, D, 96, gen)
    kw = dict(b_LDO=b, row_offsets_L1=offsets, num_tokens_L=num_tokens, a_row_ids=a_row_ids.to(device))
    out = check("bf16", real, a=q_dev, a_scales=s_dev, **kw)
    # the same as bf16 rows holding the dequantised values
    deq = reference.dequantize_nvfp4(q, s).to(torch.bfloat16).to(device)
    torch.testing.assert_close(out[real].float(), grouped_gemm(a=deq, **kw)[real].float(), atol=0.0, rtol=0.0)


def test_grouped_gemm_non_contiguous():
    # a is a column slice of a wider buffer, b is stored [L, O, D] and viewed as [L, D, O],
    # out is a column slice; the launcher passes every stride to the kernel
    gen = torch.Generator().manual_seed(11)
    offsets, num_tokens, real = make_layout([14, 0, 37], 4, 2)
    M, D, O = real.shape[0], 96, 80
    a = rand_a(M, D + 32, gen)[:, 32:]
    b = rand_b(3, O, D, gen).transpose(1, 2)
    assert not a.is_contiguous() and not b.is_contiguous()
    wide = torch.full((M, O + 16), SENTINEL, dtype=torch.bfloat16, device=device)
    out = wide[:, 8:8 + O]
    grouped_gemm(a=a, b_LDO=b, row_offsets_L1=offsets, num_tokens_L=num_tokens, out=out)
    ref = grouped_gemm_torch(a=a.contiguous(), b_LDO=b.contiguous(), row_offsets_L1=offsets,
                           num_tokens_L=num_tokens)
    torch.testing.assert_close(out[real].float(), ref[real].float(), **TOL["bf16"])
    assert bool((wide[~real] == SENTINEL).all()) and bool((wide[:, :8] == SENTINEL).all())
    assert bool((wide[:, 8 + O:] == SENTINEL).all())


def test_grouped_gemm_persistent_grid_matches():
    # num_sms = 3 loops each program over many tiles; the result must not change
    gen = torch.Generator().manual_seed(12)
    offsets, num_tokens, real = make_layout([30, 0, 70, 9], 16, 0)
    kw = dict(a=rand_a(real.shape[0], 64, gen), b_LDO=rand_b(4, 64, 128, gen),
              row_offsets_L1=offsets, num_tokens_L=num_tokens)
    full = check("bf16", real, **kw)
    few = check("bf16", real, num_sms=3, **kw)
    assert torch.equal(full[real], few[real])



def test_flat_bf16_kernel_matches_the_tile_by_tile_kernel():
    # the persistent bf16 kernel whose tile loop Triton fuses with its K loop (bf16 rows in
    # place, on GPUs): 3 programs over every tile, an empty expert, a partial last tile, D
    # past the last step; the bits of the tile-by-tile kernel, padding rows untouched
    from ray_ep.kernels import grouped_gemm as gg

    gen = torch.Generator().manual_seed(17)
    offsets, num_tokens, real = make_layout([30, 0, 70, 9], 16, 0)
    L, D, O = 4, 96, 128
    a, b = rand_a(real.shape[0], D, gen), rand_b(L, D, O, gen)
    kw = dict(a=a, b_LDO=b, row_offsets_L1=offsets, num_tokens_L=num_tokens)
    want = grouped_gemm(**kw, num_sms=1 << 20)  # a program per tile: the tile-by-tile kernel
    cfg = gg._launch_config(a.device, b_fp8=False, rows_per_expert=real.shape[0] // L, depth=D)
    a_desc, b_desc = gg._descriptor(a, [cfg["BLOCK_M"], cfg["BLOCK_D"]]), gg._weight_descriptor(b, cfg)
    assert a_desc is not None and b_desc is not None
    got = torch.full((real.shape[0], O), SENTINEL, dtype=torch.bfloat16, device=device)
    gg._bf16_flat_kernel[(3,)](a_desc=a_desc, b_desc=b_desc, c_ptr=got, row_offsets_ptr=offsets,
                               num_tokens_ptr=num_tokens, L=L, O=O, stride_cm=got.stride(0), D=D, BLOCK_L=4,
                               BLOCK_M=cfg["BLOCK_M"], BLOCK_O=cfg["BLOCK_O"], BLOCK_D=cfg["BLOCK_D"],
                               DOT_FP32=device == "cpu", num_warps=cfg["num_warps"])
    assert torch.equal(got[real], want[real])
    assert bool((got[~real] == SENTINEL).all())


def test_grouped_gemm_new_output():
    gen = torch.Generator().manual_seed(13)
    offsets, num_tokens, real = make_layout([6, 10], 1, 0)
    kw = dict(a=rand_a(16, 64, gen), b_LDO=rand_b(2, 64, 32, gen), row_offsets_L1=offsets,
              num_tokens_L=num_tokens)
    out = grouped_gemm(**kw)
    assert out.shape == (16, 32) and out.dtype == torch.bfloat16 and out.device.type == device
    torch.testing.assert_close(out.float(), grouped_gemm_torch(**kw).float(), **TOL["bf16"])


@pytest.mark.parametrize("dispatch_dtype", ["bf16", "fp8", "nvfp4"])
def test_expert_chain_matches_reference_experts(dispatch_dtype):
    # gate_up GEMM (gathering from the dispatched rows) -> SwiGLU -> down GEMM, per rank, against
    # reference.experts_world: the twins exactly on CPU, the kernels within the chain tolerance
    cfg = EPConfig(hidden_size=128, n_experts=8, top_k=3, max_tokens_per_rank=24, intermediate_size=64,
                   gpus_per_node=2, expert_alignment=8, dispatch_dtype=dispatch_dtype)
    xs, ids, _ = make_inputs(cfg, [24, 19], seed=14, routing="skewed")
    weights = init_expert_weights(cfg, seed=14)
    dispatched = reference.dispatch_world(cfg, xs, ids)
    expected = reference.experts_world(cfg, dispatched, weights)
    for rank, d in enumerate(dispatched):
        local = weights.local(rank, cfg.experts_per_rank)
        M = d.x.shape[0]
        # rows of the receive buffer in reverse order, to exercise the gather
        recv_x = d.x.flip(0).to(device)
        recv_scales = d.scales.flip(0).to(device) if d.scales is not None else None
        a_row_ids = torch.where(d.src_info[:, 0] >= 0, M - 1 - torch.arange(M), -1).to(torch.int32).to(device)
        args = dict(row_offsets_L1=d.row_offsets.to(device), num_tokens_L=d.num_tokens.to(device))
        real = (a_row_ids >= 0).cpu()
        for gemm, act, tol in ((grouped_gemm_torch, swiglu_torch, None), (grouped_gemm, swiglu, "chain")):
            h = gemm(a=recv_x, a_scales=recv_scales, a_row_ids=a_row_ids,
                     b_LDO=local.w_gate_up.to(device), **args)
            a = act(h_M2F=h, row_ids_M=a_row_ids, total_rows=args["row_offsets_L1"][-1:])
            y = gemm(a=a, b_LDO=local.w_down.to(device), **args).cpu()
            if tol is None and device == "cpu":
                assert torch.equal(y[real], expected[rank][real])
            else:  # the kernels; and the twins on a GPU, whose fp32 matmul sums in another order
                tol = tol or "chain"
                torch.testing.assert_close(y[real].float(), expected[rank][real].float(), **TOL[tol])


def _handle_of(cfg: EPConfig, d: reference.RankDispatch) -> DispatchHandle:
    """A DispatchHandle whose receive rows are the reference's expert-major rows (row m reads
    row m), at the capacity run_experts' scratch has."""
    M, cap = d.x.shape[0], cfg.max_recv_rows
    row_ids = torch.full((cap,), -1, dtype=torch.int32)
    row_ids[:M] = torch.where(d.src_info[:, 0] >= 0, torch.arange(M), -1)
    zeros = torch.zeros(cfg.world_size, cfg.experts_per_rank, dtype=torch.int32, device=device)
    recv = RecvLayout(row_ids.to(device), d.row_offsets.to(device), d.num_tokens.to(device), zeros, zeros[:, 0])
    unused = DispatchLayout(*(torch.zeros(1, dtype=torch.int32, device=device) for _ in range(4)))
    return DispatchHandle(unused, recv, d.x.to(device), d.scales.to(device) if d.scales is not None else None,
                          torch.zeros(M, 3 * cfg.top_k, dtype=torch.int32, device=device), num_tokens=0)


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("dispatch_dtype", ["bf16", "fp8"])
def test_run_experts_bf16_weights_matches_reference(dispatch_dtype, routing):
    # the layer's entry point with bf16 weights (on a GPU the Triton GEMMs on persistent grids:
    # a capacity of 195 rows per expert, prefill's side of the 64; elsewhere the twins) against
    # reference.experts_world, F not a multiple of a tile's columns; on a GPU also the bits of
    # the GEMMs on a grid of a program per tile
    cfg = EPConfig(hidden_size=256, n_experts=16, top_k=3, max_tokens_per_rank=256, intermediate_size=192,
                   gpus_per_node=2, expert_alignment=4, dispatch_dtype=dispatch_dtype)
    assert cfg.max_recv_rows // cfg.experts_per_rank > 64
    xs, ids, _ = make_inputs(cfg, [12, 5] if routing == "skewed" else [24, 17], seed=16, routing=routing)
    weights = init_expert_weights(cfg, seed=16)
    dispatched = reference.dispatch_world(cfg, xs, ids)
    expected = reference.experts_world(cfg, dispatched, weights)
    for rank, d in enumerate(dispatched):
        experts = LocalExperts.build(cfg, weights.local(rank, cfg.experts_per_rank), device)
        h = _handle_of(cfg, d)
        M = d.x.shape[0]
        real = d.src_info[:, 0] >= 0
        y = run_experts(handle=h, experts=experts, scratch=ExpertScratch.allocate(cfg, device))[:M].cpu()
        torch.testing.assert_close(y[real].float(), expected[rank][real].float(), **TOL["chain"])
        if device == "cuda":
            args = dict(row_offsets_L1=h.recv.row_offsets_L1, num_tokens_L=h.recv.num_tokens_L)
            many = 1 << 20  # more programs than tiles: one per tile
            gate_up = grouped_gemm(a=h.x_rows, a_scales=h.scales_rows, a_row_ids=h.recv.row_ids_M,
                                   b_LDO=experts.w_gate_up_LHF2, num_sms=many, **args)
            a = swiglu(h_M2F=gate_up, row_ids_M=h.recv.row_ids_M, total_rows=args["row_offsets_L1"][-1:])
            per_tile = grouped_gemm(a=a, b_LDO=experts.w_down_LFH, num_sms=many, **args)[:M].cpu()
            assert torch.equal(y[real], per_tile[real])


@pytest.mark.parametrize("n_shared", [1, 2])
def test_shared_experts_into_given_output(n_shared):
    # the layer allocates the sum on the stream that reads it and computes it on another:
    # the given output gets exactly the sum a new one would, whatever it held before. One
    # shared expert's sum is its bf16 output as it is (no fp32 copy), several sum in fp32
    cfg = EPConfig(hidden_size=128, n_experts=4, top_k=2, max_tokens_per_rank=8, intermediate_size=64,
                   n_shared_experts=n_shared, gpus_per_node=2)
    weights = init_expert_weights(cfg, seed=3)
    experts = LocalExperts.build(cfg, weights.local(0, cfg.experts_per_rank), device)
    dtype = torch.bfloat16 if n_shared == 1 else torch.float32
    assert experts.shared_sum_dtype == dtype
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
    fresh = shared_experts(x, experts)
    assert fresh.dtype == dtype
    out = torch.full((8, 128), float("nan"), dtype=dtype, device=device)
    assert shared_experts(x, experts, out=out) is out
    assert torch.equal(out, fresh)
    torch.testing.assert_close(fresh.cpu().float(), reference.shared_experts(x.cpu(), weights), **TOL["chain"])
    with pytest.raises(EPInputError, match=r"out must have shape \(8, 128\)"):
        shared_experts(x, experts, out=torch.zeros(8, 64, dtype=dtype, device=device))
    other = torch.float32 if n_shared == 1 else torch.bfloat16
    with pytest.raises(EPInputError, match="out"):
        shared_experts(x, experts, out=torch.zeros(8, 128, dtype=other, device=device))


@pytest.fixture
def hopper_kernel_at_any_size(monkeypatch):
    """The Hopper kernel on the tests' small shapes, which give it fewer tiles than the SMs
    (where the launcher takes the Triton kernel: ``grouped_gemm_sm90.fills_sms``)."""
    from ray_ep.kernels import grouped_gemm_sm90
    monkeypatch.setattr(grouped_gemm_sm90, "MIN_TILES_PER_SM", 0)


@pytest.mark.parametrize("tokens,n_shared", [(0, 2), (8, 2), (300, 2), (300, 1)])
def test_shared_experts_fp8_weights_match_reference(tokens, n_shared, hopper_kernel_at_any_size):
    # fp8 shared experts: the routed chain over one group of every token (on Hopper, 300
    # tokens take the Gluon kernel with the SwiGLU in its epilogue: more than 64 rows, the last
    # tile partial); against reference.shared_experts, which quantises the tokens and the
    # SwiGLU output and dequantises the weights. Tolerance as for the routed fp8 chain.
    cfg = EPConfig(hidden_size=256, n_experts=4, top_k=2, max_tokens_per_rank=8, intermediate_size=256,
                   n_shared_experts=n_shared, gpus_per_node=2, expert_dtype="fp8")
    weights = init_expert_weights(cfg, seed=5)
    assert weights.shared_fp8
    experts = LocalExperts.build(cfg, weights.local(0, cfg.experts_per_rank), device)
    assert experts.shared_gate_up_SHF2.stride(1) == 1 and experts.shared_down_scales.shape == (n_shared, 2, 2)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    got = shared_experts(x.to(device), experts, num_sms=3).cpu()
    assert got.dtype == (torch.bfloat16 if n_shared == 1 else torch.float32)
    got = got.float()
    want = reference.shared_experts(x, weights)
    assert got.shape == want.shape == (tokens, 256)
    if tokens:
        close = torch.isclose(got, want, **TOL["chain"])
        assert close.float().mean() >= 0.98, f"{close.float().mean():.3f} of the elements within the chain tolerance"
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
    # the bf16 shared experts of the same draw: fp8's error is a few percent, not more
    bf16 = reference.shared_experts(x, weights.to_expert_dtype("bf16"))
    if tokens:
        rel = ((got - bf16).norm() / bf16.norm()).item()
        assert 0 < rel < 0.1, rel


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("dispatch_dtype", ["bf16", "fp8", "nvfp4"])
def test_expert_chain_fp8_weights_matches_reference(dispatch_dtype, routing):
    # fp8 experts as LocalExperts holds them (K-major, converted from the seeded world's fp8
    # weights): gate_up GEMM -> SwiGLU quantised to fp8 -> down GEMM, against
    # reference.experts_world (which dequantises the weights). Skewed routing leaves experts
    # empty. Twins and kernels sum per K block, the reference in one matmul: fp32 noise that
    # can tip a bf16 rounding of h (and the interpreter truncates to bf16, a GPU sums in
    # another order). Where h moved by a bf16 ulp the SwiGLU value may land on the next e4m3
    # step, up to 2^-3 of it: with |a| up to ~8 and down weights ~F^-0.5 that moves an output
    # by up to ~0.1 (~3% of max|y|). So: 98% of the elements within the chain tolerance, every
    # one within 5% of max|y|.
    cfg = EPConfig(hidden_size=256, n_experts=16, top_k=3, max_tokens_per_rank=24, intermediate_size=128,
                   gpus_per_node=2, expert_alignment=4, dispatch_dtype=dispatch_dtype, expert_dtype="fp8")
    xs, ids, _ = make_inputs(cfg, [12, 5] if routing == "skewed" else [24, 17], seed=15, routing=routing)
    weights = init_expert_weights(cfg, seed=15)
    assert weights.fp8
    dispatched = reference.dispatch_world(cfg, xs, ids)
    expected = reference.experts_world(cfg, dispatched, weights)
    empty = 0
    for rank, d in enumerate(dispatched):
        local = LocalExperts.build(cfg, weights.local(rank, cfg.experts_per_rank), device)
        assert local.fp8 and local.w_gate_up_LHF2.stride(1) == 1  # K-major
        M = d.x.shape[0]
        a_row_ids = torch.where(d.src_info[:, 0] >= 0, torch.arange(M), -1).to(torch.int32).to(device)
        args = dict(row_offsets_L1=d.row_offsets.to(device), num_tokens_L=d.num_tokens.to(device))
        real = (a_row_ids >= 0).cpu()
        empty += int((d.num_tokens == 0).sum())
        for gemm, act in ((grouped_gemm_torch, swiglu_torch), (grouped_gemm, swiglu)):
            h = gemm(a=d.x.to(device), a_scales=d.scales.to(device) if d.scales is not None else None,
                     a_row_ids=a_row_ids, b_LDO=local.w_gate_up_LHF2, b_scales=local.w_gate_up_scales, **args)
            a = torch.zeros(M, cfg.intermediate_size, dtype=torch.float8_e4m3fn, device=device)
            a_s = torch.ones(M, cfg.intermediate_size // 128, device=device)
            act(h_M2F=h, row_ids_M=a_row_ids, total_rows=args["row_offsets_L1"][-1:], out=a, out_scales=a_s)
            y = gemm(a=a, a_scales=a_s, b_LDO=local.w_down_LFH, b_scales=local.w_down_scales, **args).cpu()
            got, want = y[real].float(), expected[rank][real].float()
            close = torch.isclose(got, want, **TOL["chain"])
            assert close.float().mean() >= 0.98, f"{close.float().mean():.3f} of the elements within the chain tolerance"
            assert (got - want).abs().max() <= 0.05 * want.abs().max()
    if routing == "skewed":
        assert empty > 0, "skewed routing should leave an expert without rows"


def fp8_weights(L, D, O, gen, kmajor=True):
    """Block-quantised random weights: (q [L, D, O] e4m3, scales [L, D/128, O/128], fp32 values
    q * scale). ``kmajor``: D contiguous (how LocalExperts and checkpoints hold them)."""
    q, s = quantize_fp8_blocks_torch(torch.randn(L, D, O, generator=gen) / D**0.5 * 4.0 ** torch.randint(
        -1, 2, (L, 1, 1), generator=gen))
    deq = reference.dequantize_fp8_blocks(q, s)
    if kmajor:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    return q.to(device), s.to(device), deq


@pytest.mark.parametrize("a_kind", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("kmajor", [True, False], ids=["k-major", "row-major"])
def test_grouped_gemm_fp8_weights(a_kind, kmajor):
    # fp8 weights with 128 x 128 block scales: kernel vs twin (the same fp32 products per K
    # block, one bf16 rounding: the bf16 tolerance), padding untouched, an empty expert, a
    # gather; and both equal to the dequantised math within fp32 noise
    gen = torch.Generator().manual_seed(20)
    counts = [17, 0, 40, 5]
    offsets, num_tokens, real = make_layout(counts, 4, 3)
    M, D, O, rows = real.shape[0], 256, 384, 120
    x = torch.randn(rows, D, generator=gen).to(torch.bfloat16)
    if a_kind == "fp8":
        a, a_s = reference.quantize_fp8(x)
    elif a_kind == "nvfp4":
        a, a_s = reference.quantize_nvfp4(x)
    else:
        a, a_s = x, None
    q, s, deq = fp8_weights(len(counts), D, O, gen, kmajor)
    a_row_ids = torch.full((M,), -1, dtype=torch.int32)
    a_row_ids[real.cpu()] = torch.randperm(rows, generator=gen)[: sum(counts)].to(torch.int32)
    kw = dict(a=a.to(device), a_scales=a_s.to(device) if a_s is not None else None, b_LDO=q, b_scales=s,
              row_offsets_L1=offsets, num_tokens_L=num_tokens, a_row_ids=a_row_ids.to(device))
    out = check("bf16", real, **kw)
    # the math: every row quantised to fp8 per 128 channels (as it is, or as quantize_rows_fp8 does)
    if a_kind == "fp8":
        xq, xs = a, a_s
    else:
        rows_bf16 = reference.dequantize_nvfp4(a, a_s).to(torch.bfloat16) if a_kind == "nvfp4" else x
        xq, xs = reference.quantize_fp8(rows_bf16)
    xd = reference.dequantize_fp8(xq, xs)
    want = torch.zeros(M, O)
    offs = offsets.tolist()
    for e, c in enumerate(counts):
        ids = a_row_ids[offs[e]:offs[e] + c].long()
        want[offs[e]:offs[e] + c] = xd[ids] @ deq[e]
    torch.testing.assert_close(out[real].float().cpu(), want[real.cpu()].to(torch.bfloat16).float(), **TOL["bf16"])


def skewed_fp8_case(D, O, gen, gather):
    """The Hopper kernel's test experts: skewed (an empty one, one row, several m tiles; last
    tiles of 44, 1, 1 and 64 rows, which the kernel runs as half tiles, and of 77 and 65, which
    it does not) in segments padded to 128 rows, fp8 block-scaled weights, fp8 rows with their
    scales (1500 gathered ones, or one per expert-major row) and the row ids that read them (-1
    for padding; in place: the expert-major row itself). Returns (row_offsets_L1, num_tokens_L,
    real, q, s, x, xs, ids), the rows and ids on the CPU."""
    counts = [300, 0, 1, 129, 77, 256, 192, 65]
    offsets, num_tokens, real = make_layout(counts, 128, 5)
    q, s, _ = fp8_weights(len(counts), D, O, gen)
    M = real.shape[0]
    rows = 1500 if gather else M
    x, xs = reference.quantize_fp8(torch.randn(rows, D, generator=gen).to(torch.bfloat16))
    ids = torch.full((M,), -1, dtype=torch.int32)
    ids[real.cpu()] = (torch.randperm(rows, generator=gen)[: int(real.sum())] if gather
                       else torch.nonzero(real.cpu())[:, 0]).to(torch.int32)
    return offsets, num_tokens, real, q, s, x, xs, ids


@pytest.mark.gpu
@pytest.mark.parametrize("num_sms", [None, 3], ids=["grid-per-sm", "3-programs"])
@pytest.mark.parametrize("gather", [False, True], ids=["in-place", "gathered"])
def test_grouped_gemm_fp8_weights_hopper_kernel(gather, num_sms, hopper_kernel_at_any_size):
    # prefill shapes on Hopper run the Gluon kernel (ray_ep.kernels.grouped_gemm_sm90): kernel
    # vs twin over skewed experts (an empty one, one row, several m tiles), padding untouched;
    # gathered rows are strided fp8 wire rows with their scales beside; 3 programs take many
    # tiles each (the stage ring's, the tile hand-off's and the half tiles' phases carry across
    # tiles)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for Hopper (sm_90)")
    from ray_ep.kernels import grouped_gemm_sm90

    gen = torch.Generator().manual_seed(23)
    D, O = 512, 512
    offsets, num_tokens, real, q, s, x, xs, ids = skewed_fp8_case(D, O, gen, gather)
    M = real.shape[0]
    wire = torch.zeros(x.shape[0], D + 64, dtype=torch.uint8, device=device)  # D fp8 bytes, then scales
    a = wire[:, :D].view(torch.float8_e4m3fn)
    a.copy_(x.to(device))
    a_s = wire[:, D:].view(torch.float32)[:, : D // 128]
    a_s.copy_(xs.to(device))
    a_row_ids = ids.to(device) if gather else None
    assert grouped_gemm_sm90.usable(a=a, b_LDO=q, rows_per_expert=M // len(num_tokens))
    check("bf16", real, a=a, a_scales=a_s, b_LDO=q, b_scales=s, row_offsets_L1=offsets, num_tokens_L=num_tokens,
          a_row_ids=a_row_ids, num_sms=num_sms)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [[0, 0, 0], [0, 0, 1]], ids=["no-rows", "last-expert-one-row"])
def test_grouped_gemm_fp8_weights_hopper_kernel_edges(counts, hopper_kernel_at_any_size):
    # the Gluon kernel with no tile at all writes nothing; with one K block (D 128) and a last
    # expert of one row (a half tile: its second warpgroup reads the second 128 columns' scales)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for Hopper (sm_90)")
    from ray_ep.kernels import grouped_gemm_sm90

    gen = torch.Generator().manual_seed(41)
    D, O, M = 128, 256, 3 * 128
    used = -(-sum(counts) // 128) * 128
    offsets, num_tokens, real = make_layout(counts, 128, M - used)
    q, s, _ = fp8_weights(len(counts), D, O, gen)
    x, xs = reference.quantize_fp8(torch.randn(M, D, generator=gen).to(torch.bfloat16))
    a, a_s = x.to(device), xs.to(device)
    assert grouped_gemm_sm90.usable(a=a, b_LDO=q, rows_per_expert=M // len(counts))
    check("bf16", real, a=a, a_scales=a_s, b_LDO=q, b_scales=s, row_offsets_L1=offsets, num_tokens_L=num_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("num_sms", [None, 3], ids=["grid-per-sm", "3-programs"])
@pytest.mark.parametrize("gather", [False, True], ids=["in-place", "gathered"])
def test_grouped_gemm_swiglu_out_matches_gemm_then_swiglu(gather, num_sms, hopper_kernel_at_any_size):
    # the SwiGLU in the Hopper kernel's epilogue: the same fp8 bits and scales as the bf16
    # product followed by the SwiGLU kernel, over skewed experts (an empty one, one row, several
    # m tiles, two o tiles of 128 gate and 128 up columns); padding rows untouched
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for Hopper (sm_90)")
    from ray_ep.kernels.grouped_gemm import fuses_swiglu

    gen = torch.Generator().manual_seed(31)
    D, F = 512, 256
    offsets, num_tokens, real, q, s, x, xs, ids = skewed_fp8_case(D, 2 * F, gen, gather)
    M = real.shape[0]
    a, a_s, ids = x.to(device), xs.to(device), ids.to(device)
    kw = dict(a=a, a_scales=a_s, b_LDO=q, b_scales=s, row_offsets_L1=offsets, num_tokens_L=num_tokens,
              a_row_ids=ids if gather else None, num_sms=num_sms)
    assert fuses_swiglu(a=a, b_LDO=q, rows_per_expert=M // len(num_tokens))
    h = grouped_gemm(**kw)
    want_q = torch.zeros(M, F, dtype=torch.float8_e4m3fn, device=device)
    want_s = torch.full((M, F // 128), 5.0, device=device)
    swiglu(h_M2F=h, row_ids_M=ids, total_rows=offsets[-1:], out=want_q, out_scales=want_s)
    got_q = torch.full((M, F), 7.0, device=device).to(torch.float8_e4m3fn)
    got_s = torch.full((M, F // 128), 5.0, device=device)
    assert grouped_gemm(**kw, swiglu_out=(got_q, got_s)) is got_q
    assert torch.equal(got_q[real].view(torch.uint8), want_q[real].view(torch.uint8))
    assert torch.equal(got_s[real], want_s[real])
    assert bool((got_q[~real].float() == 7.0).all()) and bool((got_s[~real] == 5.0).all()), "padding rows written"


def test_hopper_kernel_takes_only_shapes_with_over_half_a_wave_of_tiles():
    # deepseek-v3's shared expert (one expert, gate_up O 4096, down O 7168) on 132 SMs: a decode
    # batch's 128 tokens give the Hopper kernel's 128 x 256 tiles 16 / 28 (the Triton kernel
    # runs them), 256 tokens 32 / 56, 384 tokens 48 / 84 (down takes the Hopper kernel), 768
    # tokens 96 / 168 (both do); the routed experts of a prefill (64 experts x 512 rows) many
    from ray_ep.kernels.grouped_gemm_sm90 import fills_sms

    assert not any(fills_sms(1, t, o, 132) for t in (128, 256) for o in (4096, 7168))
    assert not fills_sms(1, 384, 4096, 132) and fills_sms(1, 384, 7168, 132)
    assert all(fills_sms(1, 768, o, 132) for o in (4096, 7168))
    assert fills_sms(64, 512, 4096, 132) and not fills_sms(64, 512, 4096, 64 * 4 * 16 * 2)


def test_grouped_gemm_swiglu_out_needs_the_hopper_kernel():
    # where the SwiGLU cannot run inside the GEMM (here: no Hopper GPU, or bf16 weights) a clear
    # error says what to run instead
    gen = torch.Generator().manual_seed(5)
    offsets, num_tokens, real = make_layout([3, 2], 4, 0)
    M = real.shape[0]
    b = rand_b(2, 128, 256, gen)
    out = (torch.zeros(M, 128, dtype=torch.float8_e4m3fn, device=device), torch.ones(M, 1, device=device))
    with pytest.raises(EPInputError, match="fuses_swiglu"):
        grouped_gemm(a=rand_a(M, 128, gen), b_LDO=b, row_offsets_L1=offsets, num_tokens_L=num_tokens, swiglu_out=out)


def test_grouped_gemm_fp8_weights_quantises_a_like_fp8_dispatch():
    # bf16 rows with fp8 weights give exactly what their fp8 dispatch (quantize_fp8) gives:
    # quantize_rows_fp8 uses the same bits. Kernel and twin each, bit for bit.
    gen = torch.Generator().manual_seed(21)
    offsets, num_tokens, real = make_layout([9, 30, 0], 8, 2)
    M, D, O = real.shape[0], 384, 128
    x = (torch.randn(M, D, generator=gen) * 10.0 ** torch.randint(-2, 3, (M, 1), generator=gen)).to(torch.bfloat16)
    x[3] = 0.0  # an all-zero row: scale 1, zeros
    q, s, _ = fp8_weights(3, D, O, gen)
    xq, xs = reference.quantize_fp8(x)
    kw = dict(b_LDO=q, b_scales=s, row_offsets_L1=offsets, num_tokens_L=num_tokens)
    for fn in (grouped_gemm, grouped_gemm_torch):
        from_bf16 = fn(a=x.to(device), **kw)
        from_fp8 = fn(a=xq.to(device), a_scales=xs.to(device), **kw)
        assert torch.equal(from_bf16[real], from_fp8[real]), fn.__name__


def conversion_case(seed: int):
    """Rows for the conversion passes before a GEMM, read through expert-major row ids: experts
    of [5, 0, 40, 3] real rows, stale ids (< 60) in the padding, one row under two experts, a
    real slot reading nothing (-1). Returns (offsets, num_tokens, real, x [70, 256] bf16 with
    rows of scales 1e-2 to 1e2, ids, read: the rows some real row reads)."""
    gen = torch.Generator().manual_seed(seed)
    offsets, num_tokens, real = make_layout([5, 0, 40, 3], 8, 5)
    M, rows, D = real.shape[0], 70, 256
    x = (torch.randn(rows, D, generator=gen) * 10.0 ** torch.randint(-2, 3, (rows, 1), generator=gen)).to(torch.bfloat16)
    ids = torch.randint(0, 60, (M,), generator=gen, dtype=torch.int32)
    ids[real.cpu()] = torch.randint(0, 40, (int(real.sum()),), generator=gen, dtype=torch.int32)
    ids[offsets[2].item()] = ids[offsets[0].item()] = 3
    ids[offsets[2].item() + 1] = -1
    read = torch.zeros(rows, dtype=torch.bool)
    read[ids[real.cpu() & (ids >= 0)].long()] = True
    return offsets, num_tokens, real, x, ids, read


@pytest.mark.parametrize("a_kind", ["bf16", "nvfp4"])
def test_quantize_rows_fp8_quantises_each_real_row_once(a_kind):
    # the pass before an fp8-weight GEMM: every row a real expert-major row reads (through the
    # row ids: shared by two experts, or none) gets quantize_fp8's bits at its own index; rows
    # no real row reads, padding's stale ids and -1 ids are not touched; into a given out
    offsets, num_tokens, real, x, ids, read = conversion_case(23)
    M, (rows, D) = real.shape[0], x.shape
    a, a_s = (x, None) if a_kind == "bf16" else reference.quantize_nvfp4(x)
    q = torch.full((rows, D), 7.0).to(torch.float8_e4m3fn).to(device)
    qs = torch.full((rows, D // 128), -1.0, device=device)
    got = quantize_rows_fp8(a=a.to(device), a_scales=a_s.to(device) if a_s is not None else None,
                            row_offsets_L1=offsets, num_tokens_L=num_tokens, a_row_ids=ids.to(device), out=(q, qs))
    assert got[0] is q and got[1] is qs
    rows_bf16 = reference.dequantize_nvfp4(a, a_s).to(torch.bfloat16) if a_kind == "nvfp4" else x
    want_q, want_s = reference.quantize_fp8(rows_bf16)
    q, qs = q.cpu(), qs.cpu()
    assert torch.equal(q[read].view(torch.uint8), want_q[read].view(torch.uint8))
    assert torch.equal(qs[read], want_s[read])
    assert bool((q[~read].float() == 7.0).all()) and bool((qs[~read] == -1.0).all()), "an unread row was written"
    # without row ids: expert-major row m is a[m]; new tensors
    q2, s2 = quantize_rows_fp8(a=a[:M].to(device), a_scales=a_s[:M].to(device) if a_s is not None else None,
                               row_offsets_L1=offsets, num_tokens_L=num_tokens)
    r = real.cpu()
    assert torch.equal(q2.cpu()[r].view(torch.uint8), want_q[:M][r].view(torch.uint8))
    assert torch.equal(s2.cpu()[r], want_s[:M][r])
    # outputs the kernel cannot address row by row are refused
    bad_scales = torch.ones(D // 128, rows, device=device).t()
    with pytest.raises(ValueError, match="stride 1 along their last dim"):
        quantize_rows_fp8(a=a.to(device), a_scales=a_s.to(device) if a_s is not None else None, row_offsets_L1=offsets,
                          num_tokens_L=num_tokens, a_row_ids=ids.to(device), out=(q.to(device), bad_scales))


@pytest.mark.parametrize("a_kind", ["fp8", "nvfp4"])
def test_decode_rows_bf16_decodes_each_real_row_once(a_kind):
    # the pass before a bf16-weight GEMM over fp8 or nvfp4 rows: every row a real expert-major
    # row reads gets bf16(value * scale) at its own index, as the dequantise kernels give it;
    # rows no real row reads (a receive buffer's spare capacity), stale and -1 ids: untouched
    offsets, num_tokens, real, x, ids, read = conversion_case(24)
    M, (rows, D) = real.shape[0], x.shape
    a, a_s = reference.quantize_fp8(x) if a_kind == "fp8" else reference.quantize_nvfp4(x)
    want = (reference.dequantize_fp8(a, a_s) if a_kind == "fp8" else reference.dequantize_nvfp4(a, a_s)).to(torch.bfloat16)
    out = torch.full((rows, D), 7.0, dtype=torch.bfloat16, device=device)
    got = decode_rows_bf16(a=a.to(device), a_scales=a_s.to(device), row_offsets_L1=offsets, num_tokens_L=num_tokens,
                           a_row_ids=ids.to(device), out=out)
    assert got is out
    out = out.cpu()
    # nvfp4 values are exact in bf16; fp8 * scale rounds, and the CPU interpreter truncates
    # fp32 -> bf16 where GPUs round to nearest: one bf16 ulp
    tol = dict(atol=0.0, rtol=0.0 if a_kind == "nvfp4" else 2**-7)
    torch.testing.assert_close(out[read], want[read], **tol)
    assert bool((out[~read] == 7.0).all()), "an unread row was written"
    # without row ids: expert-major row m is a[m]; a new tensor
    new = decode_rows_bf16(a=a[:M].to(device), a_scales=a_s[:M].to(device), row_offsets_L1=offsets,
                           num_tokens_L=num_tokens).cpu()
    torch.testing.assert_close(new[real.cpu()], want[:M][real.cpu()], **tol)


@pytest.mark.parametrize("a_kind,b_kind", [("bf16", "fp8"), ("nvfp4", "fp8"), ("fp8", "bf16"), ("nvfp4", "bf16")])
def test_conversion_over_receive_regions_converts_each_received_row(a_kind, b_kind):
    # a_regions: a receive buffer of R regions of n rows, region s holding counts[s] rows at its
    # start; the pass before the GEMM converts those rows (once each, however many experts read
    # them) and nothing past a region's count; the GEMM's output is the same as without it
    gen = torch.Generator().manual_seed(25)
    R, n, D, O = 3, 24, 256, 128
    counts = torch.tensor([7, 0, 24], dtype=torch.int32)
    received = torch.zeros(R * n, dtype=torch.bool)
    for src, c in enumerate(counts.tolist()):
        received[src * n:src * n + c] = True
    x = (torch.randn(R * n, D, generator=gen) * 10.0 ** torch.randint(-2, 3, (R * n, 1), generator=gen)).to(torch.bfloat16)
    a, a_s = {"bf16": (x, None), "fp8": reference.quantize_fp8(x), "nvfp4": reference.quantize_nvfp4(x)}[a_kind]
    offsets, num_tokens, real = make_layout([20, 0, 31], 8, 3)
    ids = torch.full((real.shape[0],), -1, dtype=torch.int32)
    # every received row read by one expert or two (some twice), in random order
    got_rows = received.nonzero().flatten()
    ids[real.cpu()] = got_rows[torch.randint(0, got_rows.numel(), (int(real.sum()),), generator=gen)].int()
    ids[real.cpu().nonzero().flatten()[:got_rows.numel()]] = got_rows.int()
    regions = (counts.to(device), n)
    dev_a, dev_s = a.to(device), a_s.to(device) if a_s is not None else None
    segs = dict(row_offsets_L1=offsets, num_tokens_L=num_tokens, a_row_ids=ids.to(device))
    if b_kind == "fp8":
        q = torch.full((R * n, D), 7.0).to(torch.float8_e4m3fn).to(device)
        qs = torch.full((R * n, D // 128), -1.0, device=device)
        quantize_rows_fp8(a=dev_a, a_scales=dev_s, out=(q, qs), a_regions=regions, **segs)
        rows = reference.dequantize_nvfp4(a, a_s).to(torch.bfloat16) if a_kind == "nvfp4" else x
        want_q, want_s = reference.quantize_fp8(rows)
        q, qs = q.cpu(), qs.cpu()
        assert torch.equal(q[received].view(torch.uint8), want_q[received].view(torch.uint8))
        assert torch.equal(qs[received], want_s[received])
        assert bool((q[~received].float() == 7.0).all()) and bool((qs[~received] == -1.0).all()), \
            "a row past a region's count was written"
        w, ws, _ = fp8_weights(3, D, O, gen)
        kw = dict(b_LDO=w, b_scales=ws)
    else:
        out = torch.full((R * n, D), 7.0, dtype=torch.bfloat16, device=device)
        decode_rows_bf16(a=dev_a, a_scales=dev_s, out=out, a_regions=regions, **segs)
        want = (reference.dequantize_fp8(a, a_s) if a_kind == "fp8" else reference.dequantize_nvfp4(a, a_s))
        out = out.cpu()
        torch.testing.assert_close(out[received], want.to(torch.bfloat16)[received], atol=0.0,
                                   rtol=0.0 if a_kind == "nvfp4" else 2**-7)
        assert bool((out[~received] == 7.0).all()), "a row past a region's count was written"
        kw = dict(b_LDO=(torch.randn(3, D, O, generator=gen) * 0.05).to(torch.bfloat16).to(device))
    by_region = grouped_gemm(a=dev_a, a_scales=dev_s, a_regions=regions, **segs, **kw)
    by_row = grouped_gemm(a=dev_a, a_scales=dev_s, **segs, **kw)
    assert torch.equal(by_region[real], by_row[real])
    with pytest.raises(ValueError, match="must fit in the 72 rows of a"):
        grouped_gemm(a=dev_a, a_scales=dev_s, a_regions=(counts.to(device), n + 1), **segs, **kw)


def test_grouped_gemm_fp8_weights_persistent_grid_and_no_tokens():
    gen = torch.Generator().manual_seed(22)
    offsets, num_tokens, real = make_layout([30, 0, 70, 9], 16, 0)
    q, s, _ = fp8_weights(4, 128, 256, gen)
    kw = dict(a=rand_a(real.shape[0], 128, gen), b_LDO=q, b_scales=s, row_offsets_L1=offsets, num_tokens_L=num_tokens)
    full = check("bf16", real, **kw)
    few = check("bf16", real, num_sms=3, **kw)
    assert torch.equal(full[real], few[real])
    offsets, num_tokens, real = make_layout([0, 0, 0, 0], 8, 5)
    out = check("bf16", real, **{**kw, "a": rand_a(real.shape[0], 128, gen), "row_offsets_L1": offsets,
                                 "num_tokens_L": num_tokens})
    assert bool((out == SENTINEL).all())


def _good_args():
    L, D, O, M = 2, 128, 32, 8
    return dict(a=torch.zeros(M, D, dtype=torch.bfloat16, device=device),
                b_LDO=torch.zeros(L, D, O, dtype=torch.bfloat16, device=device),
                row_offsets_L1=torch.tensor([0, 4, 8], dtype=torch.int32, device=device),
                num_tokens_L=torch.tensor([4, 4], dtype=torch.int32, device=device))


F8 = torch.float8_e4m3fn
BAD = [
    (dict(a=torch.zeros(8, 128, dtype=torch.float16)), "a must be bfloat16, float8_e4m3fn"),
    (dict(a=torch.zeros(8, 64, dtype=torch.bfloat16)), "a has D = 64"),
    (dict(b_LDO=torch.zeros(2, 128, dtype=torch.bfloat16)), "b_LDO must have 3 dimensions"),
    (dict(b_LDO=torch.zeros(2, 128, 32, dtype=torch.float32)), "b_LDO must be bfloat16, float8_e4m3fn"),
    (dict(row_offsets_L1=torch.tensor([0, 8], dtype=torch.int32)), r"row_offsets_L1 must have shape \(3,\)"),
    (dict(row_offsets_L1=torch.tensor([0, 4, 8], dtype=torch.int64)), "row_offsets_L1 must be int32"),
    (dict(num_tokens_L=torch.tensor([4, 4], dtype=torch.int32, device="meta")), "num_tokens_L must be on"),
    (dict(a_row_ids=torch.zeros(8, dtype=torch.int64)), "a_row_ids must be int32"),
    (dict(a_row_ids=torch.zeros(9, dtype=torch.int32), out=torch.zeros(8, 32, dtype=torch.bfloat16)),
     r"out must have shape \(9, 32\)"),
    (dict(out=torch.zeros(8, 32, dtype=torch.float32)), "out must be bfloat16"),
    (dict(a=torch.zeros(8, 128, dtype=F8)), "fp8 a needs a_scales"),
    (dict(a=torch.zeros(8, 128, dtype=F8), a_scales=torch.ones(8, 2)), r"a_scales must have shape \(8, 1\)"),
    (dict(a=torch.zeros(8, 128, dtype=F8), a_scales=torch.ones(8, 1, dtype=torch.float64)),
     "a_scales must be float32"),
    (dict(a=torch.zeros(8, 64, dtype=F8), b_LDO=torch.zeros(2, 64, 32, dtype=torch.bfloat16)),
     "D % 128 == 0"),
    (dict(a_scales=torch.ones(8, 1)), "a_scales is only for fp8"),
    (dict(a=torch.zeros(8, 64, dtype=torch.uint8)), "nvfp4 a .* needs a_scales"),
    (dict(a=torch.zeros(8, 64, dtype=torch.uint8), a_scales=torch.ones(8, 8)), "a_scales must be float8_e4m3fn"),
    (dict(a=torch.zeros(8, 64, dtype=torch.uint8), a_scales=torch.ones(8, 4).to(F8)),
     r"a_scales must have shape \(8, 8\)"),
    (dict(a=torch.zeros(8, 4, dtype=torch.uint8), b_LDO=torch.zeros(2, 8, 32, dtype=torch.bfloat16)),
     "D % 16 == 0"),
    (dict(num_sms=0), "num_sms must be a positive int"),
    (dict(b_LDO=torch.zeros(2, 128, 128, dtype=F8)), "fp8 b_LDO needs b_scales"),
    (dict(b_LDO=torch.zeros(2, 128, 128, dtype=F8), b_scales=torch.ones(2, 1, 2)),
     r"b_scales must have shape \(2, 1, 1\)"),
    (dict(b_LDO=torch.zeros(2, 128, 128, dtype=F8), b_scales=torch.ones(2, 1, 1, dtype=torch.bfloat16)),
     "b_scales must be float32"),
    (dict(b_LDO=torch.zeros(2, 128, 32, dtype=F8), b_scales=torch.ones(2, 1, 1)), "D and O multiples of 128"),
    (dict(b_scales=torch.ones(2, 1, 1)), "b_scales is only for fp8 b_LDO"),
]


@pytest.mark.parametrize("change,match", BAD)
@pytest.mark.parametrize("fn", [grouped_gemm, grouped_gemm_torch])
def test_grouped_gemm_bad_inputs(fn, change, match):
    args = _good_args()
    for k, v in change.items():
        args[k] = v.to(device) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
    with pytest.raises(ValueError, match=match):
        fn(**args)
