"""quantize_fp8 / dequantize_fp8 (Triton) against their torch twins.

The quantiser pre-rounds to the e4m3 grid in fp32 (ties to even), so its bytes equal the twin's
exactly, rounding ties included. Without CUDA the kernels run in Triton's CPU interpreter; with
CUDA the same tests run compiled. Legend: T rows, H channels, G = H / 128 scale groups.
"""

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ray_ep.errors import EPInputError  # noqa: E402
from ray_ep import reference  # noqa: E402
from ray_ep.config import FP8_MAX  # noqa: E402
from ray_ep.fp8 import dequantize_fp8_torch, quantize_fp8_torch  # noqa: E402
from ray_ep.kernels.quant import dequantize_fp8, quantize_fp8  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
# triton 3.6's interpreter turns 1-element arrays into Python ints through a numpy path that
# numpy >= 1.25 deprecates (one warning per kernel-side index): noise, not a finding
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# Tolerances of dequantize, kernel vs. twin, per output dtype. Both compute q * scale as one
# correctly rounded fp32 multiply, so fp32 is exact; fp16: both round fp32 -> fp16 to nearest
# (the interpreter through numpy), exact too. bf16: the twin rounds to nearest, the CPU
# interpreter truncates (numpy has no bf16): up to 1 bf16 ulp, 2^-7 relative (GPUs: exact).
DEQ_TOL = {
    torch.float32: dict(atol=0.0, rtol=0.0),
    torch.float16: dict(atol=0.0, rtol=0.0),
    torch.bfloat16: dict(atol=0.0, rtol=2**-7),
}


def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending (0, subnormals k * 2^-9, normals to 448)."""
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return vals.sort().values


def e4m3_ties() -> tuple[torch.Tensor, torch.Tensor]:
    """Midpoints between adjacent e4m3 values and where round-to-nearest-even takes them."""
    g = e4m3_grid()
    lo, hi = g[:-1], g[1:]
    mid = (lo + hi) / 2  # exact in fp32
    lo_bits = torch.arange(0, 126, dtype=torch.int32)  # e4m3 bit pattern of lo (the grid is monotone)
    want = torch.where(lo_bits % 2 == 0, lo, hi)  # even mantissa (last bit 0) wins
    return mid, want


def q_bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def check_quant(x_TH: torch.Tensor):
    """Kernel, twin and the oracle: scales bitwise equal, q bytewise equal (sign of zero included)."""
    q, s = quantize_fp8(x_TH=x_TH)
    q_ref, s_ref = quantize_fp8_torch(x_TH=x_TH)
    q_oracle, s_oracle = reference.quantize_fp8(x_TH.cpu())
    assert torch.equal(s_ref.cpu(), s_oracle) and torch.equal(q_bytes(q_ref.cpu()), q_bytes(q_oracle)), \
        "the twin (ray_ep.fp8) and the oracle (ray_ep.reference) disagree"
    T, H = x_TH.shape
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (T, H) and q.is_contiguous()
    assert s.dtype == torch.float32 and tuple(s.shape) == (T, H // 128)
    assert torch.equal(s, s_ref), f"scales differ at {(s != s_ref).nonzero().tolist()[:8]}"
    diff = (q_bytes(q) != q_bytes(q_ref)).nonzero()
    if diff.numel():
        t, h = diff[0].tolist()
        raise AssertionError(f"{diff.shape[0]} q bytes differ; first at [{t}, {h}]: x = {x_TH[t, h].item()!r}, "
                             f"kernel {q[t, h].float().item()!r}, twin {q_ref[t, h].float().item()!r}")
    return q, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("T,H", [(1, 128), (37, 256), (5, 384), (70, 640)], ids=lambda v: str(v))
def test_random_rows(T, H, dtype):
    gen = torch.Generator().manual_seed(T * 1000 + H)
    # a different magnitude per group: scales from ~1e-3 to ~1e3
    mag = 10.0 ** torch.randint(-3, 4, (T, H // 128, 1), generator=gen).float()
    x = (torch.randn(T, H // 128, 128, generator=gen) * mag).reshape(T, H).to(dtype).to(device)
    q, s = check_quant(x)
    # the largest |x| of each group maps to exactly +-448
    g = x.float().reshape(T, H // 128, 128)
    top = g.abs().argmax(dim=-1, keepdim=True)
    qg = q.float().reshape(T, H // 128, 128)
    assert bool((qg.gather(-1, top).abs() == FP8_MAX).all())
    torch.testing.assert_close(s, (g.abs().amax(-1) / FP8_MAX).float(), atol=0.0, rtol=2**-23)


# amax / 448 a power of two: x * (448 / amax) is exact, so x lands on any chosen fp32 point
AMAXES = [448.0, 3.5, 56.0, 0.4375, 7168.0, 2.0**-20 * 448]


@pytest.mark.parametrize("amax", AMAXES, ids=lambda a: f"amax{a:g}")
def test_rounding_ties_to_even(amax):
    # each group of 128: the 126 ties of the e4m3 grid (subnormal steps, the subnormal/normal
    # boundary, every binade, 432 between 416 and 448), then 448 (the group's amax), then 0;
    # row 0 positive, row 1 negative; 3 groups (H = 384), the last two with other amaxes
    mid, want = e4m3_ties()
    group = torch.cat([mid, torch.tensor([FP8_MAX, 0.0])])
    assert group.numel() == 128
    row = group.repeat(3)
    amaxes = torch.tensor([amax, amax * 4, amax / 8]).repeat_interleave(128)
    x = torch.stack([row, -row]) * (amaxes / FP8_MAX)
    assert torch.equal(x * (FP8_MAX / amaxes), torch.stack([row, -row])), "construction must be exact"
    q, s = check_quant(x.to(device))
    assert s.cpu().tolist() == [[amax / FP8_MAX, amax * 4 / FP8_MAX, amax / 8 / FP8_MAX]] * 2
    qf = q.float().cpu().reshape(2, 3, 128)
    for g in range(3):
        assert torch.equal(qf[0, g, :126], want), \
            f"ties: {[(m, o, w) for m, o, w in zip(mid.tolist(), qf[0, g].tolist(), want.tolist()) if o != w][:5]}"
        assert torch.equal(qf[1, g, :126], -want)
        assert qf[0, g, 126].item() == FP8_MAX and qf[1, g, 126].item() == -FP8_MAX


def test_named_values():
    # amax 448: scale 1, so q is the rounding of x itself
    cases = [
        (448.0, 448.0), (440.0, 448.0), (432.0, 448.0), (431.0, 416.0), (424.0, 416.0),
        (1.0625, 1.0), (1.1875, 1.25), (7.93, 8.0), (0.30, 0.3125), (0.001, 0.001953125),
        (2.0**-6, 2.0**-6), (15 * 2.0**-10, 2.0**-6), (13 * 2.0**-10, 6 * 2.0**-9),
        (3 * 2.0**-10, 2.0**-8), (2.0**-10, 0.0), (2.0**-11, 0.0), (1.5 * 2.0**-10, 2.0**-9),
        (2.0**-9, 2.0**-9), (0.0, 0.0),
    ]
    x = torch.zeros(1, 128)
    x[0, 0] = 448.0
    for i, (v, _) in enumerate(cases):
        x[0, 1 + 2 * i] = v
        x[0, 2 + 2 * i] = -v
    q, _ = check_quant(x.to(device))
    qf = q.float().cpu()[0]
    for i, (v, w) in enumerate(cases):
        assert qf[1 + 2 * i].item() == w, f"{v} -> {qf[1 + 2 * i].item()}, want {w}"
        assert qf[2 + 2 * i].item() == -w, f"{-v} -> {qf[2 + 2 * i].item()}, want {-w}"
    # a negative value that rounds to zero is -0 (bytes 0x80), as a direct conversion gives
    assert q_bytes(q)[0, 2 + 2 * cases.index((2.0**-11, 0.0))].item() == 0x80


def test_subnormal_range():
    # values across the e4m3 subnormal range (|q| < 2^-6, step 2^-9) and below it
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(16, 384, generator=gen) * 2.0**-5 * torch.where(torch.rand(16, 384, generator=gen) < 0.5, -1, 1)
    x[:, ::128] = FP8_MAX  # amax 448 per group: scale 1
    q, _ = check_quant(x.to(device))
    sub = x.abs() < 2.0**-6
    assert int(sub.sum()) > 1000
    steps = q.float().cpu()[sub] / 2.0**-9
    assert torch.equal(steps, steps.round()), "subnormals must be multiples of 2^-9"
    # and a group scaled far down: scales ~1e-30 (fp32 normal), q still exact
    tiny = (torch.randn(3, 128, generator=gen) * 1e-28).to(device)
    check_quant(tiny)


def test_zero_groups():
    x = torch.randn(4, 640, generator=torch.Generator().manual_seed(4))
    x[0] = 0.0  # a whole row
    x[1, 128:256] = 0.0  # one group
    x[2, 512:] = -0.0  # negative zeros: an all-zero group, q keeps the sign of zero
    x[3, :128] = 0.0
    x[3, 5] = 1e-30  # nearly zero: a real group with a tiny scale
    q, s = check_quant(x.to(device))
    s = s.cpu()
    assert s[0].tolist() == [1.0] * 5 and s[1, 1].item() == 1.0 and s[2, 4].item() == 1.0
    assert bool((q.float().cpu()[0] == 0).all()) and bool((q.float().cpu()[1, 128:256] == 0).all())
    assert bool((q_bytes(q).cpu()[2, 512:] == 0x80).all())
    assert q.float()[3, 5].item() == FP8_MAX


@pytest.mark.parametrize("H", [384, 640], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("layout", ["row-slice", "every-other-row", "odd-stride"])
def test_strided_rows(layout, H):
    gen = torch.Generator().manual_seed(H)
    if layout == "row-slice":  # rows of a wider tensor: row stride H + 256
        wide = torch.randn(9, H + 256, generator=gen).to(torch.bfloat16).to(device)
        x = wide[:, 128:128 + H]
    elif layout == "odd-stride":  # bf16 rows at odd channels: not read as words (they would fault)
        x = torch.randn(9, H + 3, generator=gen).to(torch.bfloat16).to(device)[:, 1:1 + H]
    else:  # every other row of a taller tensor: row stride 2H
        x = torch.randn(18, H, generator=gen).to(torch.bfloat16).to(device)[::2]
    assert not x.is_contiguous() and x.stride(1) == 1
    q, s = check_quant(x)
    q2, s2 = quantize_fp8(x_TH=x.contiguous())
    assert torch.equal(q_bytes(q), q_bytes(q2)) and torch.equal(s, s2)


def test_zero_rows():
    x = torch.zeros(0, 256, dtype=torch.bfloat16, device=device)
    q, s = check_quant(x)
    assert q.shape == (0, 256) and s.shape == (0, 2)
    out = dequantize_fp8(q_TH=q, scales_TG=s)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("T,H", [(3, 128), (33, 384), (20, 640)], ids=lambda v: str(v))
def test_dequantize_round_trip(T, H, out_dtype):
    gen = torch.Generator().manual_seed(T + H)
    mag = 10.0 ** torch.randint(-2, 3, (T, H // 128, 1), generator=gen).float()
    x = (torch.randn(T, H // 128, 128, generator=gen) * mag).reshape(T, H).to(device)
    x[0, :128] = 0.0  # an all-zero group comes back as zeros
    q, s = check_quant(x)
    got = dequantize_fp8(q_TH=q, scales_TG=s, out_dtype=out_dtype)
    want = dequantize_fp8_torch(q_TH=q, scales_TG=s, out_dtype=out_dtype)
    assert got.dtype == out_dtype and tuple(got.shape) == (T, H)
    torch.testing.assert_close(got.float(), want.float(), **DEQ_TOL[out_dtype])
    assert bool((got[0, :128] == 0).all())
    if out_dtype == torch.float32:
        # round trip: e4m3 keeps 3 mantissa bits, so a normal value is within half an ulp,
        # 2^-4 relative; below 2^-6 * scale (subnormal) within half a step, 2^-10 * scale
        scale = s.repeat_interleave(128, dim=1)
        bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 2.0**-20)
        assert bool(((got - x).abs() <= bound).all())
        # and quantising the dequantised rows again is a fixed point
        q2, s2 = quantize_fp8(x_TH=got)
        assert torch.equal(q_bytes(q2), q_bytes(q)) and torch.equal(s2, s)


def test_dequantize_matches_the_oracle():
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(8)).to(device)
    q, s = quantize_fp8(x_TH=x)
    want = reference.dequantize_fp8(q.cpu(), s.cpu())
    assert torch.equal(dequantize_fp8(q_TH=q, scales_TG=s, out_dtype=torch.float32).cpu(), want)
    assert torch.equal(dequantize_fp8_torch(q, s, out_dtype=torch.float32).cpu(), want)


def _bad_quant_inputs():
    z = torch.zeros
    return [
        ("H-not-multiple", dict(x_TH=z(4, 200)), "multiple of 128"),
        ("1-D", dict(x_TH=z(256)), "x_TH must have 2 dimensions"),
        ("int", dict(x_TH=z(2, 128, dtype=torch.int32)), "x_TH must be bfloat16, float16, float32"),
        ("fp8-in", dict(x_TH=z(2, 128).to(torch.float8_e4m3fn)), "x_TH must be"),
        ("transposed", dict(x_TH=z(128, 4).t()), "contiguous last dimension"),
    ]


def on_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the test device with its strides kept (``.to`` would make a strided view
    contiguous on a GPU, and the strided-input checks would have nothing to catch)."""
    if t.device == torch.device(device):
        return t
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device).copy_(t)


def _bad_dequant_inputs():
    f8 = torch.float8_e4m3fn
    q = torch.zeros(3, 256).to(f8)
    s = torch.ones(3, 2)
    return [
        ("q-bf16", dict(q_TH=q.float().to(torch.bfloat16), scales_TG=s), "q_TH must be float8_e4m3fn"),
        ("q-H-not-multiple", dict(q_TH=torch.zeros(3, 200).to(f8), scales_TG=s), "multiple of 128"),
        ("q-strided", dict(q_TH=torch.zeros(6, 256).to(f8)[::2], scales_TG=s), "q_TH must be contiguous"),
        ("scales-shape", dict(q_TH=q, scales_TG=torch.ones(3, 1)), r"scales_TG must have shape \(3, 2\)"),
        ("scales-dtype", dict(q_TH=q, scales_TG=s.to(torch.bfloat16)), "scales_TG must be float32"),
        ("scales-strided", dict(q_TH=q, scales_TG=torch.ones(3, 4)[:, ::2]), "scales_TG must be contiguous"),
    ]


# (kernel, twin, a table of bad inputs): both must raise the same EPInputError
_BAD_INPUTS = [(quantize_fp8, quantize_fp8_torch, c) for c in _bad_quant_inputs()] + \
              [(dequantize_fp8, dequantize_fp8_torch, c) for c in _bad_dequant_inputs()]


@pytest.mark.parametrize("impl", ["kernel", "twin"])
@pytest.mark.parametrize("kernel,twin,case", _BAD_INPUTS, ids=[f"{k.__name__}-{c[0]}" for k, _, c in _BAD_INPUTS])
def test_bad_inputs_raise(kernel, twin, case, impl):
    name, args, match = case
    fn = kernel if impl == "kernel" else twin
    args = {k: on_device(v) for k, v in args.items()}
    with pytest.raises(EPInputError, match=match):
        fn(**args)
    assert issubclass(EPInputError, ValueError)
