"""quantize_nvfp4 / dequantize_nvfp4 (Triton) against their torch twins and the oracle.

Three implementations written apart (kernels/nvfp4.py: the smallest of three rounded sums, integer packing;
ray_ep/nvfp4.py: the twin; reference.py: nearest grid point in fp64) must give the same bytes:
codes, sign of zero and block scales. Without CUDA the kernels run in Triton's CPU interpreter;
with CUDA the same tests run compiled. Legend: T rows, H channels, P = H / 2 packed bytes,
B = H / 16 scale blocks; s a block's e4m3 scale, g the per-tensor scale.
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
from ray_ep.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4  # noqa: E402
from ray_ep.nvfp4 import dequantize_nvfp4_torch, quantize_nvfp4_torch, wire_views  # noqa: E402
from ray_ep.validation import validate_moe_inputs  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
# triton 3.6's interpreter turns 1-element arrays into Python ints through a numpy path that
# numpy >= 1.25 deprecates (one warning per kernel-side index): noise, not a finding
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # e2m1 magnitudes by code


def codes_of(q_TP: torch.Tensor) -> torch.Tensor:
    """[T, H] codes 0..15 of packed rows (channel 2i in the low nibble of byte i)."""
    q = q_TP.cpu()
    return torch.stack([q & 15, q >> 4], dim=-1).reshape(q.shape[0], 2 * q.shape[1])


def values_of(q_TP: torch.Tensor) -> torch.Tensor:
    """[T, H] e2m1 values (unscaled) of packed rows."""
    c = codes_of(q_TP).long()
    return torch.tensor(GRID)[c % 8] * torch.where(c >= 8, -1.0, 1.0)


def check_quant(x_TH: torch.Tensor, global_scale: float = 1.0):
    """Kernel, twin and oracle: codes and scale bits equal. Returns the kernel's (q, s)."""
    q, s = quantize_nvfp4(x_TH=x_TH, global_scale=global_scale)
    q_twin, s_twin = quantize_nvfp4_torch(x_TH, global_scale)
    q_or, s_or = reference.quantize_nvfp4(x_TH.cpu(), global_scale)
    assert torch.equal(q_twin.cpu(), q_or) and torch.equal(s_twin.cpu().view(torch.uint8), s_or.view(torch.uint8)), \
        "the twin (ray_ep.nvfp4) and the oracle (ray_ep.reference) disagree"
    T, H = x_TH.shape
    assert q.dtype == torch.uint8 and tuple(q.shape) == (T, H // 2) and q.is_contiguous()
    assert s.dtype == torch.float8_e4m3fn and tuple(s.shape) == (T, H // 16)
    sd = (s.view(torch.uint8) != s_twin.view(torch.uint8)).nonzero()
    assert not sd.numel(), f"{sd.shape[0]} scales differ; first at {sd[0].tolist()}"
    diff = (codes_of(q) != codes_of(q_twin)).nonzero()
    if diff.numel():
        t, h = diff[0].tolist()
        raise AssertionError(f"{diff.shape[0]} codes differ; first at [{t}, {h}]: x = {x_TH[t, h].item()!r}, "
                             f"kernel {codes_of(q)[t, h].item()}, twin {codes_of(q_twin)[t, h].item()}")
    return q, s


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and equal signs of zero (torch.equal takes -0 == +0)."""
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.cpu().view(ints), b.cpu().view(ints))


def blocks_of(x_TH: torch.Tensor) -> torch.Tensor:
    T, H = x_TH.shape
    return x_TH.float().cpu().reshape(T, H // 16, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("T,H", [(1, 16), (37, 48), (5, 256), (70, 640), (3, 7168)], ids=lambda v: str(v))
def test_random_rows(T, H, dtype):
    gen = torch.Generator().manual_seed(T * 1000 + H)
    # a different magnitude per block: scales from ~1e-2 to ~1e2 (normal e4m3 scales)
    mag = 10.0 ** torch.randint(-1, 3, (T, H // 16, 1), generator=gen).float()
    x = (torch.randn(T, H // 16, 16, generator=gen) * mag).reshape(T, H).to(dtype).to(device)
    q, s = check_quant(x)
    # the largest |x| of each block is always code 7 (+-6): s is amax / 6 within 2^-4, so
    # amax / s lies in [5.65, 6.4], above the 5 -> 6 midpoint (saturating at 6)
    b = blocks_of(x)
    top = b.abs().argmax(dim=-1, keepdim=True)
    v = values_of(q).reshape(b.shape)
    assert bool((v.gather(-1, top).abs() == 6.0).all())
    torch.testing.assert_close(s.float().cpu(), b.abs().amax(-1) / 6, atol=0.0, rtol=2**-4)


def _tie_block(amax: float) -> torch.Tensor:
    """16 values whose block (amax = 6 * 2^j, so s = 2^j and x / s is exact): the 7 midpoints
    of the e2m1 grid, then the 7 grid points below 6, then 6 itself and a zero."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    pts = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    return torch.tensor(mids + pts + [6.0, 0.0]) * (amax / 6)


TIES_TO = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # each midpoint goes to the even code


@pytest.mark.parametrize("amax", [6.0, 3.0, 48.0, 0.375, 6 * 2.0**-6, 2688.0], ids=lambda a: f"amax{a:g}")
def test_rounding_ties_to_even(amax):
    # row 0 positive, row 1 negative; 3 blocks with amax, 4 * amax (capped at 2688) and amax / 8
    amaxes = [amax, min(4 * amax, 2688.0), amax / 8]
    row = torch.cat([_tie_block(a) for a in amaxes])
    x = torch.stack([row, -row]).to(device)
    q, s = check_quant(x)
    assert s.float().cpu().tolist() == [[a / 6 for a in amaxes]] * 2
    v = values_of(q).reshape(2, 3, 16)
    want = torch.tensor(TIES_TO + [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0])
    for blk in range(3):
        assert v[0, blk].tolist() == want.tolist(), f"block {blk}: {v[0, blk].tolist()}"
        assert v[1, blk].tolist() == (-want).tolist()
    # a value that rounds to zero keeps its sign: -0.25 * s is code 0x8 (-0)
    assert codes_of(q)[1, 0].item() == 0x8 and codes_of(q)[0, 0].item() == 0x0


def test_just_off_the_midpoints():
    # one fp32 ulp either side of every midpoint (s = 1): away from a tie, nearest wins
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    below = torch.nextafter(mids, torch.zeros(7))
    above = torch.nextafter(mids, torch.full((7,), 10.0))
    x = torch.cat([below, above, torch.tensor([6.0, 0.0])]).reshape(1, 16).to(device)
    q, _ = check_quant(x)
    v = values_of(q)[0]
    assert v[:7].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    assert v[7:14].tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_magnitude_rounded_before_its_code():
    # s = 1.125 (amax 6.75), so 1 / s is not exact in fp32: each x below times fp32(1 / s) is a
    # midpoint once rounded to fp32, but a little above it exactly. The code is that of the
    # rounded magnitude (the tie's even side); a product fused into the code's rounding sum
    # (one rounding, as a GPU would contract it) would round up instead
    x = torch.tensor([0.28125, 0.84375, 1.40625, 1.96875, 2.8125, 3.9375, 5.625, 6.75] + [0.0] * 8)
    q, s = check_quant(x.reshape(1, 16).to(device))
    assert s.float().item() == 1.125
    assert values_of(q)[0, :8].tolist() == TIES_TO + [6.0]


def test_named_values():
    # amax 3: s = 0.5; 1.3 -> 2.6 -> 3 (1.5 back); -0.2 -> -0.4 -> -0.5 (code 0x9, -0.25 back);
    # -0.1 -> -0.2 -> -0 (code 0x8); 0.7 -> 1.4 -> 1.5; 2.2 -> 4.4 -> 4
    x = torch.zeros(1, 16)
    x[0, :6] = torch.tensor([3.0, 1.3, -0.2, -0.1, 0.7, 2.2])
    q, s = check_quant(x.to(device))
    assert s.float().item() == 0.5 and s.view(torch.uint8).item() == 0x30
    assert codes_of(q)[0, :6].tolist() == [7, 5, 0x9, 0x8, 3, 6]
    assert q.cpu()[0, 0].item() == 7 | (5 << 4)


def test_scale_range():
    # per block: amax above 6 * 448 (scale saturates at 448, values at +-6); amax 6 * 2^-8
    # (a subnormal e4m3 scale, exact); amax below 6 * 2^-10 (the scale rounds to 0: all codes 0,
    # signs kept); and a subnormal scale that rounds (amax / 6 = 1.4 * 2^-9 -> 2^-9)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=gen)
    x[0, :16] *= 1e4 / x[0, :16].abs().max()
    x[0, 16:32] *= 6 * 2.0**-8 / x[0, 16:32].abs().max()
    x[0, 32:48] *= 5 * 2.0**-10 / x[0, 32:48].abs().max()
    x[0, 48:64] *= 6 * 1.4 * 2.0**-9 / x[0, 48:64].abs().max()
    q, s = check_quant(x.to(device))
    sf = s.float().cpu()[0]
    assert sf.tolist() == [448.0, 2.0**-8, 0.0, 2.0**-9]
    v = values_of(q)[0]
    assert v[:16].abs().max().item() == 6.0
    assert bool((v[32:48].abs() == 0).all())
    assert torch.equal(codes_of(q)[0, 32:48] >= 8, torch.signbit(x[0, 32:48]))
    assert v[48:64].abs().max().item() == 6.0  # amax / s = 8.4 saturates


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_scale_and_its_midpoints(dtype):
    # A GPU divides without div.rn's range check (block_scales): check both divisions where a
    # last-bit error would show. Each block leads with an amax: every finite nonzero bf16
    # magnitude, and in fp32 also 6 times each midpoint between neighbouring e4m3 scales and
    # the fp32 values either side (amax / 6 exactly on the tie, or one ulp off it). The other
    # channels are the e2m1 midpoints times the block's d, both signs: x * (1 / d) lands on a
    # midpoint only if 1 / d is the correctly rounded reciprocal.
    amax = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    if dtype == torch.float32:
        e4m3 = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
        six_mid = 6 * (e4m3[:-1] + e4m3[1:]) / 2
        amax = torch.cat([amax, six_mid, torch.nextafter(six_mid, torch.zeros(1)),
                          torch.nextafter(six_mid, torch.full((1,), 1e4))])
    d = torch.clamp(amax / torch.full_like(amax, 6.0), max=448.0).to(torch.float8_e4m3fn).float()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    blocks = torch.cat([amax[:, None], mids * d[:, None], -mids * d[:, None], torch.zeros(len(amax), 1)], dim=1)
    blocks[1::2] *= -1
    H = 4096
    x = torch.cat([blocks, torch.zeros(-len(blocks) % (H // 16), 16)]).reshape(-1, H)
    assert torch.equal(x.to(dtype).float(), x), "every value must be exact in the input dtype"
    check_quant(x.to(dtype).to(device))


def test_zero_blocks():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    x[0] = 0.0  # a whole row
    x[1, 16:32] = -0.0  # negative zeros: scale 0, codes 0x8
    x[2, 48:] = 0.0
    x[2, 50] = 1e-30  # nearly zero: the scale rounds to 0
    q, s = check_quant(x.to(device))
    sb = s.view(torch.uint8).cpu()
    assert sb[0].tolist() == [0] * 4 and sb[1, 1].item() == 0 and sb[2, 3].item() == 0
    assert bool((q.cpu()[0] == 0).all()) and bool((q.cpu()[1, 8:16] == 0x88).all())


@pytest.mark.parametrize("layout", ["row-slice", "every-other-row", "odd-stride"])
def test_strided_rows(layout):
    gen = torch.Generator().manual_seed(7)
    H = 96
    if layout == "row-slice":  # rows of a wider tensor: row stride H + 64
        x = torch.randn(9, H + 64, generator=gen).to(torch.bfloat16).to(device)[:, 32:32 + H]
    elif layout == "odd-stride":  # bf16 rows at odd channels (not read as words: they would fault)
        x = torch.randn(9, H + 3, generator=gen).to(torch.bfloat16).to(device)[:, 1:1 + H]
    else:
        x = torch.randn(18, H, generator=gen).to(torch.bfloat16).to(device)[::2]
    assert not x.is_contiguous() and x.stride(1) == 1
    q, s = check_quant(x)
    q2, s2 = quantize_nvfp4(x_TH=x.contiguous())
    assert torch.equal(q, q2) and torch.equal(s.view(torch.uint8), s2.view(torch.uint8))


def test_zero_rows():
    x = torch.zeros(0, 32, dtype=torch.bfloat16, device=device)
    q, s = check_quant(x)
    assert q.shape == (0, 16) and s.shape == (0, 2)
    out = dequantize_nvfp4(q_TP=q, scales_TB=s)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("g", [2.0**-5, 8.0], ids=lambda g: f"g{g:g}")
def test_power_of_two_global_scale(g):
    # with g = 2^k every step is exact: quantising x with g equals quantising x / g with 1,
    # and dequantising gives g times the values
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(6, 128, generator=gen) * 40
    q, s = check_quant(x.to(device), g)
    q1, s1 = check_quant((x / g).to(device), 1.0)
    assert torch.equal(q, q1) and torch.equal(s.view(torch.uint8), s1.view(torch.uint8))
    d = dequantize_nvfp4(q_TP=q, scales_TB=s, global_scale=g, out_dtype=torch.float32)
    assert same_bits(d, dequantize_nvfp4(q_TP=q1, scales_TB=s1, out_dtype=torch.float32) * g)


def test_any_global_scale():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9)) * 3
    for g in (0.37, 3.3e-3, 17.0):
        q, s = check_quant(x.to(device), g)
        want = reference.dequantize_nvfp4(q.cpu(), s.cpu(), g)
        assert same_bits(dequantize_nvfp4(q_TP=q, scales_TB=s, global_scale=g, out_dtype=torch.float32), want)
        assert same_bits(dequantize_nvfp4_torch(q, s, g, out_dtype=torch.float32), want)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("T,H", [(3, 32), (33, 384), (20, 640)], ids=lambda v: str(v))
def test_dequantize_round_trip(T, H, out_dtype):
    gen = torch.Generator().manual_seed(T + H)
    mag = 10.0 ** torch.randint(-1, 3, (T, H // 16, 1), generator=gen).float()
    x = (torch.randn(T, H // 16, 16, generator=gen) * mag).reshape(T, H).to(device)
    x[0, :16] = 0.0  # an all-zero block comes back as zeros
    q, s = check_quant(x)
    got = dequantize_nvfp4(q_TP=q, scales_TB=s, out_dtype=out_dtype)
    want = dequantize_nvfp4_torch(q, s, out_dtype=out_dtype)
    # e2m1 (2 significant bits) x e4m3 (4) is exact in fp32, bf16 and fp16: every device,
    # the interpreter's truncating bf16 conversion included, gives the same bits
    assert got.dtype == out_dtype and tuple(got.shape) == (T, H)
    assert same_bits(got, want)
    assert same_bits(got.float(), reference.dequantize_nvfp4(q.cpu(), s.cpu()))
    assert bool((got[0, :16] == 0).all())
    # within one scale of x (the largest half step, 1 s between 4 and 6, or saturation at 6,
    # at most 0.4 s); and quantising the dequantised rows again is a fixed point
    scale = s.float().repeat_interleave(16, dim=1)
    assert bool(((got.float() - x).abs() <= scale).all())
    q2, s2 = quantize_nvfp4(x_TH=got)
    assert torch.equal(q2, q) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))


def test_dequantize_wire_row_views():
    # the receive side reads packed codes and scales as strided views of the wire rows
    H = 128
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(10)).to(device)
    q, s = quantize_nvfp4(x_TH=x)
    rows = torch.zeros(7, nvfp4_row_bytes(H), dtype=torch.uint8, device=device)
    qv, sv = wire_views(rows, H)
    qv.copy_(q)
    sv.view(torch.uint8).copy_(s.view(torch.uint8))
    assert rows.shape[1] == 80 and bool((rows[:, 72:] == 0).all())  # 64 packed + 8 scales + 8 padding
    assert same_bits(dequantize_nvfp4(q_TP=qv, scales_TB=sv), dequantize_nvfp4(q_TP=q, scales_TB=s))
    assert same_bits(dequantize_nvfp4_torch(qv, sv), dequantize_nvfp4_torch(q, s))
    with pytest.raises(EPInputError, match=r"uint8 \[T, 80\]"):
        wire_views(rows[:, :72], H)


def _bad_quant_inputs():
    z = torch.zeros
    return [
        ("H-not-multiple", dict(x_TH=z(4, 40)), "multiple of 16"),
        ("1-D", dict(x_TH=z(256)), "x_TH must have 2 dimensions"),
        ("int", dict(x_TH=z(2, 32, dtype=torch.int32)), "x_TH must be bfloat16, float16, float32"),
        ("transposed", dict(x_TH=z(32, 4).t()), "contiguous last dimension"),
        ("g-zero", dict(x_TH=z(2, 32), global_scale=0.0), "global_scale must be a positive finite"),
        ("g-nan", dict(x_TH=z(2, 32), global_scale=float("nan")), "global_scale must be a positive finite"),
        ("g-inf", dict(x_TH=z(2, 32), global_scale=float("inf")), "global_scale must be a positive finite"),
    ]


def _bad_dequant_inputs():
    f8 = torch.float8_e4m3fn
    q = torch.zeros(3, 16, dtype=torch.uint8)
    s = torch.zeros(3, 2).to(f8)
    return [
        ("q-int8", dict(q_TP=q.to(torch.int8), scales_TB=s), "q_TP must be uint8"),
        ("q-H-not-multiple", dict(q_TP=torch.zeros(3, 12, dtype=torch.uint8), scales_TB=s), "multiple of 16"),
        ("scales-shape", dict(q_TP=q, scales_TB=torch.zeros(3, 1).to(f8)), r"scales_TB must have shape \(3, 2\)"),
        ("scales-dtype", dict(q_TP=q, scales_TB=torch.ones(3, 2)), "scales_TB must be float8_e4m3fn"),
    ]


_BAD_INPUTS = [(quantize_nvfp4, quantize_nvfp4_torch, c) for c in _bad_quant_inputs()] + \
              [(dequantize_nvfp4, dequantize_nvfp4_torch, c) for c in _bad_dequant_inputs()]


@pytest.mark.parametrize("impl", ["kernel", "twin"])
@pytest.mark.parametrize("kernel,twin,case", _BAD_INPUTS, ids=[f"{k.__name__}-{c[0]}" for k, _, c in _BAD_INPUTS])
def test_bad_inputs_raise(kernel, twin, case, impl):
    name, args, match = case
    fn = kernel if impl == "kernel" else twin
    args = {k: v.to(device) if isinstance(v, torch.Tensor) and v.is_contiguous() else v for k, v in args.items()}
    with pytest.raises(EPInputError, match=match):
        fn(**args)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_non_finite_x_is_refused_at_the_entry(bad):
    # the kernels quantise without looking at values (no host sync); the entry the user called
    # refuses NaN / Inf once, before anything is sent (as for every dispatch dtype)
    cfg = EPConfig.preset("tiny", dispatch_dtype="nvfp4")
    x = torch.randn(4, cfg.hidden_size)
    x[2, 17] = float(bad)
    ids = torch.tensor([[0, 1, 2, 3]] * 4, dtype=torch.int32)
    w = torch.full((4, 4), 0.25)
    with pytest.raises(EPInputError, match="rank 1: x contains NaN or Inf"):
        validate_moe_inputs(cfg, x, ids, w, rank=1)
