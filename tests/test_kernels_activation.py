"""swiglu (Triton) against its torch twin and against reference.swiglu_expert.

Without CUDA the kernel runs in Triton's CPU interpreter; with CUDA the same tests run compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ray_ep import reference  # noqa: E402
from ray_ep.config import EPConfig  # noqa: E402
from ray_ep.kernels.activation import swiglu, swiglu_torch  # noqa: E402
from ray_ep.weights import init_expert_weights  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"

# Kernel vs. twin: the same fp32 math, one bf16 rounding at the end. bf16 keeps 8 significant
# bits, so one ulp is at most 2^-7 relative. The GPU rounds to nearest like the twin (exp and
# sigmoid may still differ in the last fp32 bit and tip a rounding); the CPU interpreter
# truncates fp32 -> bf16 (up to 1 ulp off). rtol = 2^-6 covers one ulp on either device; atol
# covers values near zero, where an ulp is tiny anyway.
TOL = {torch.bfloat16: dict(atol=1e-3, rtol=2**-6)}
SENTINEL = -777.0  # exactly representable in bf16; padding rows must keep it


def make_layout(counts, align, slack, gen):
    """Expert-major layout of ``counts`` rows per expert, segments padded to ``align``, plus
    ``slack`` unused rows at the end. Returns (row_offsets_L1, row_ids_M) int32 on ``device``;
    real rows get distinct ids >= 0, padding rows -1."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // align) * align)
    M = offsets[-1] + slack
    row_ids = torch.full((M,), -1, dtype=torch.int32)
    ids = torch.randperm(4 * M + 1, generator=gen)[: sum(counts)].to(torch.int32)
    used = 0
    for e, c in enumerate(counts):
        row_ids[offsets[e]:offsets[e] + c] = ids[used:used + c]
        used += c
    return torch.tensor(offsets, dtype=torch.int32, device=device), row_ids.to(device)


def run_both(h, row_ids, total_rows):
    """Kernel and twin into sentinel-filled outputs; checks real rows and untouched padding."""
    M, F = h.shape[0], h.shape[1] // 2
    out = torch.full((M, F), SENTINEL, dtype=torch.bfloat16, device=device)
    ref = torch.full((M, F), SENTINEL, dtype=torch.bfloat16, device=device)
    got = swiglu(h_M2F=h, row_ids_M=row_ids, total_rows=total_rows, out=out)
    swiglu_torch(h_M2F=h, row_ids_M=row_ids, total_rows=total_rows, out=ref)
    assert got is out
    real = (torch.arange(M, device=device) < total_rows.long()) & (row_ids >= 0)
    torch.testing.assert_close(out[real].float(), ref[real].float(), **TOL[torch.bfloat16])
    assert bool((out[~real] == SENTINEL).all()), "padding rows were written"
    assert bool((ref[~real] == SENTINEL).all()), "the twin wrote padding rows"
    return out, real


def rand_h(M, F, gen, scale=3.0):
    return (torch.randn(M, 2 * F, generator=gen) * scale).to(torch.bfloat16).to(device)


@pytest.mark.parametrize(
    "counts,align,slack,F",
    [
        ([5, 0, 37, 1, 64], 8, 11, 96),  # uneven, an empty expert, F not a power of two
        ([0, 150, 0], 1, 0, 64),  # all rows to one expert, no padding
        ([3, 1], 32, 40, 200),  # mostly padding; F spans two column blocks on the interpreter
        ([1], 1, 0, 8),  # one token
    ],
)
def test_swiglu_matches_twin(counts, align, slack, F):
    gen = torch.Generator().manual_seed(1000 + sum(counts) + F)
    offsets, row_ids = make_layout(counts, align, slack, gen)
    h = rand_h(row_ids.shape[0], F, gen)
    out, real = run_both(h, row_ids, offsets[-1:])  # total_rows as a view of row_offsets
    assert int(real.sum()) == sum(counts)


def test_swiglu_zero_rows_touches_nothing():
    gen = torch.Generator().manual_seed(2)
    offsets, row_ids = make_layout([0, 0, 0], 4, 20, gen)
    h = rand_h(row_ids.shape[0], 32, gen)
    out, real = run_both(h, row_ids, offsets[-1:])
    assert not bool(real.any())


def test_swiglu_total_rows_bounds_real_rows():
    # rows past total_rows are skipped even when their row id is >= 0 (stale ids from a
    # previous, larger batch)
    gen = torch.Generator().manual_seed(3)
    M, F = 120, 48
    row_ids = torch.arange(M, dtype=torch.int32, device=device)
    row_ids[10:14] = -1
    h = rand_h(M, F, gen)
    out, real = run_both(h, row_ids, torch.tensor([77], dtype=torch.int32, device=device))
    assert int(real.sum()) == 73


@pytest.mark.parametrize("fp8", [False, True])
def test_swiglu_programs_loop_over_row_blocks(monkeypatch, fp8):
    """The grid is what the SMs hold, not a program per row block: with one program per SM,
    each takes many blocks in turn, up to total_rows (read on the device), padding and the
    rows past it untouched."""
    from ray_ep.kernels import activation

    monkeypatch.setattr(activation, "PROGRAMS_PER_SM", 1)
    gen = torch.Generator().manual_seed(7 + fp8)
    offsets, row_ids = make_layout([300, 0, 41, 257], 8, 50, gen)
    F = 256 if fp8 else 72
    h = rand_h(row_ids.shape[0], F, gen)
    total = offsets[-1:] - 16  # past total_rows: the last expert's 7 padding rows and its last 9 rows
    if not fp8:
        out, real = run_both(h, row_ids, total)
        assert int(real.sum()) == 300 + 41 + 257 - 9
        return
    M = row_ids.shape[0]
    outs = []
    for fn in (swiglu, swiglu_torch):
        q = torch.full((M, F), FP8_SENTINEL, device=device).to(torch.float8_e4m3fn)
        s = torch.full((M, F // 128), FP8_SENTINEL, device=device)
        fn(h_M2F=h, row_ids_M=row_ids, total_rows=total, out=q, out_scales=s)
        outs.append((q, s))
    real = (torch.arange(M, device=device) < total.long()) & (row_ids >= 0)
    for q, s in outs:
        assert bool((q[~real].float() == FP8_SENTINEL).all()) and bool((s[~real] == FP8_SENTINEL).all())
    deq = [reference.dequantize_fp8(q[real].cpu(), s[real].cpu()) for q, s in outs]
    torch.testing.assert_close(deq[0], deq[1], atol=1e-6, rtol=2**-3)


def test_swiglu_non_contiguous():
    # h is a column slice of a wider buffer, out a transposed view: the launcher passes strides
    gen = torch.Generator().manual_seed(4)
    offsets, row_ids = make_layout([9, 30, 0, 17], 4, 5, gen)
    M, F = row_ids.shape[0], 40
    wide = rand_h(M, F + 8, gen)
    h = wide[:, 16:16 + 2 * F]
    assert not h.is_contiguous()
    out_T = torch.full((F, M), SENTINEL, dtype=torch.bfloat16, device=device)
    out = out_T.t()
    swiglu(h_M2F=h, row_ids_M=row_ids, total_rows=offsets[-1:], out=out)
    ref = swiglu_torch(h_M2F=h.contiguous(), row_ids_M=row_ids, total_rows=offsets[-1:])
    real = row_ids >= 0
    torch.testing.assert_close(out[real].float(), ref[real].float(), **TOL[torch.bfloat16])
    assert bool((out[~real] == SENTINEL).all())
    # a strided row_ids vector (every other element of a longer one) works too
    ids2 = torch.stack([row_ids, row_ids], dim=1).reshape(-1)[::2]
    assert not ids2.is_contiguous()
    got = swiglu(h_M2F=h, row_ids_M=ids2, total_rows=offsets[-1:], out=torch.full_like(ref, SENTINEL))
    torch.testing.assert_close(got[real].float(), ref[real].float(), **TOL[torch.bfloat16])


def test_swiglu_new_output_shape():
    gen = torch.Generator().manual_seed(5)
    offsets, row_ids = make_layout([4, 6], 1, 0, gen)
    h = rand_h(10, 16, gen)
    out = swiglu(h_M2F=h, row_ids_M=row_ids, total_rows=offsets[-1:])
    ref = swiglu_torch(h_M2F=h, row_ids_M=row_ids, total_rows=offsets[-1:])
    assert out.shape == (10, 16) and out.dtype == torch.bfloat16 and out.device.type == device
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


def test_swiglu_ref_matches_swiglu_expert():
    # the twin rounds exactly like the reference expert: bf16 h, fp32 silu * up, bf16 a
    cfg = EPConfig.preset("tiny")
    w = init_expert_weights(cfg, seed=6)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(13, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    h = (x.float() @ w.w_gate_up[0].float()).to(torch.bfloat16)
    ids = torch.arange(13, dtype=torch.int32)
    a = swiglu_torch(h_M2F=h, row_ids_M=ids, total_rows=torch.tensor([13], dtype=torch.int32))
    y = (a.float() @ w.w_down[0].float()).to(torch.bfloat16)
    assert torch.equal(y, reference.swiglu_expert(x, w.w_gate_up[0], w.w_down[0]))
    # and the kernel within tolerance of it
    a_k = swiglu(h_M2F=h.to(device), row_ids_M=ids.to(device),
                 total_rows=torch.tensor([13], dtype=torch.int32, device=device))
    torch.testing.assert_close(a_k.cpu().float(), a.float(), **TOL[torch.bfloat16])


FP8_SENTINEL = -256.0  # exactly representable in e4m3


@pytest.mark.parametrize("counts,align,slack,F", [([5, 0, 37, 1, 64], 8, 11, 256), ([0, 0, 0], 4, 9, 128),
                                                  ([1], 1, 0, 384)])
def test_swiglu_fp8_output_matches_twin(counts, align, slack, F):
    # fp8 output for a down projection with fp8 weights: silu(gate) * up in fp32, quantised per
    # 128 channels. Kernel and twin compute the same fp32 value up to the last bit of sigmoid,
    # then quantise with the same bits (quantize_group = quantize_fp8_torch): almost every byte
    # equal; where that last bit tips an e4m3 rounding, one step (2^-3 relative) apart.
    # Padding rows (values and scales) untouched; the twin's values are the reference's.
    gen = torch.Generator().manual_seed(50 + F + sum(counts))
    offsets, row_ids = make_layout(counts, align, slack, gen)
    M = row_ids.shape[0]
    h = rand_h(M, F, gen)
    outs = []
    for fn in (swiglu, swiglu_torch):
        q = torch.full((M, F), FP8_SENTINEL, device=device).to(torch.float8_e4m3fn)
        s = torch.full((M, F // 128), FP8_SENTINEL, device=device)
        assert fn(h_M2F=h, row_ids_M=row_ids, total_rows=offsets[-1:], out=q, out_scales=s) is q
        outs.append((q, s))
    real = row_ids >= 0
    (qk, sk), (qt, st) = outs
    for q, s in outs:
        assert bool((q[~real].float() == FP8_SENTINEL).all()) and bool((s[~real] == FP8_SENTINEL).all())
    if not bool(real.any()):
        return
    same = (qk.view(torch.uint8) == qt.view(torch.uint8))[real].float().mean()
    assert same >= 0.99, f"only {same:.4f} of the fp8 bytes agree"
    deq = [reference.dequantize_fp8(q[real].cpu(), s[real].cpu()) for q, s in outs]
    torch.testing.assert_close(deq[0], deq[1], atol=1e-6, rtol=2**-3)
    # the twin is the reference's rounding: quantize_fp8 of fp32 silu(gate) * up
    hf = h[real].float().cpu()
    want_q, want_s = reference.quantize_fp8(torch.nn.functional.silu(hf[:, :F]) * hf[:, F:])
    assert torch.equal(qt[real].cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(st[real].cpu(), want_s)


@pytest.mark.parametrize("fn", [swiglu, swiglu_torch])
def test_swiglu_fp8_bad_outputs(fn):
    M, F = 8, 128
    h = torch.zeros(M, 2 * F, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(M, dtype=torch.int32, device=device)
    tot = torch.tensor([M], dtype=torch.int32, device=device)
    q = torch.zeros(M, F, dtype=torch.float8_e4m3fn, device=device)
    s = torch.ones(M, 1, device=device)
    with pytest.raises(ValueError, match="an fp8 out needs out_scales"):
        fn(h_M2F=h, row_ids_M=ids, total_rows=tot, out=q)
    with pytest.raises(ValueError, match="give out"):
        fn(h_M2F=h, row_ids_M=ids, total_rows=tot, out_scales=s)
    with pytest.raises(ValueError, match=r"out_scales must have shape \(8, 1\)"):
        fn(h_M2F=h, row_ids_M=ids, total_rows=tot, out=q, out_scales=torch.ones(M, 2, device=device))
    with pytest.raises(ValueError, match="F % 128 == 0"):
        fn(h_M2F=h[:, :128], row_ids_M=ids, total_rows=tot, out=q[:, :64], out_scales=s)


def _good_args():
    M, F = 8, 16
    return dict(h_M2F=torch.zeros(M, 2 * F, dtype=torch.bfloat16, device=device),
                row_ids_M=torch.zeros(M, dtype=torch.int32, device=device),
                total_rows=torch.tensor([M], dtype=torch.int32, device=device))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(h_M2F=torch.zeros(8, 32, dtype=torch.float32)), "h_M2F must be bfloat16"),
        (dict(h_M2F=torch.zeros(8, 31, dtype=torch.bfloat16)), "even number of columns"),
        (dict(h_M2F=torch.zeros(8, 2, 16, dtype=torch.bfloat16)), "h_M2F must have 2 dimensions"),
        (dict(row_ids_M=torch.zeros(7, dtype=torch.int32)), r"row_ids_M must have shape \(8,\)"),
        (dict(row_ids_M=torch.zeros(8, dtype=torch.int64)), "row_ids_M must be int32"),
        (dict(total_rows=torch.tensor(8, dtype=torch.int32)), r"total_rows must have shape \(1,\)"),
        (dict(total_rows=torch.tensor([8], dtype=torch.int64)), "total_rows must be int32"),
        (dict(total_rows=torch.tensor([8], dtype=torch.int32, device="meta")), "total_rows must be on"),
        (dict(out=torch.zeros(8, 32, dtype=torch.bfloat16)), r"out must have shape \(8, 16\)"),
        (dict(out=torch.zeros(8, 16, dtype=torch.float32)), "out must be bfloat16"),
    ],
)
@pytest.mark.parametrize("fn", [swiglu, swiglu_torch])
def test_swiglu_bad_inputs(fn, change, match):
    args = _good_args()
    for k, v in change.items():
        args[k] = v.to(device) if v.device.type == "cpu" else v
    with pytest.raises(ValueError, match=match):
        fn(**args)
