"""nvfp4 quantisation (e2m1 values packed two per byte, one e4m3 scale per 16 channels, one
fp32 per-tensor scale) and back, as Triton kernels.

Legend: T rows, H channels, P = H / 2 packed bytes, B = H / 16 scale blocks.

The format and its rounding are defined in :mod:`ray_ep.nvfp4` (whose torch functions are the
twins of these kernels). Hopper has no fp4 type: codes come from fp32 rounding sums and are
packed and unpacked with integer ops;
the block scales are rounded to e4m3 by :func:`ray_ep.kernels.quant.to_e4m3`.
The device helpers :func:`quantize_nvfp4_blocks` (with :func:`load_blocks`), its bf16 form
:func:`quantize_nvfp4_words` (with :func:`load_block_words`), :func:`e2m1_to_f32` and
:func:`e4m3_bits_to_f32` are shared with the dispatch send and the grouped GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import E2M1_MAX, FP8_MAX, NVFP4_BLOCK, NVFP4_GLOBAL_SCALE
from ..nvfp4 import check_dequantize_inputs, check_quantize_inputs
from ._util import INTERPRETED, cdiv, tile_shape
from .quant import abs_f32, bf16_words, reads_words, to_e4m3

_BLOCK = tl.constexpr(NVFP4_BLOCK)
_E2M1_MAX = tl.constexpr(E2M1_MAX)
_FP8_MAX = tl.constexpr(FP8_MAX)


# 1.5 * 2^23: fp32 sums in [2^23, 2^24) step by 1, so adding it rounds to an integer (nearest even)
_MAGIC = tl.constexpr(12582912.0)


def _f32_hex(v: torch.Tensor) -> str:
    """PTX's spelling of a one-element fp32 tensor (its exact bits)."""
    return "0f%08X" % (v.view(torch.int32).item() & 0xFFFFFFFF)


# The dispatch's per-tensor scale is a constant, so a block's amax / (6 g) divides by a
# constant: q0 = amax * RN(1 / 6g), then one correction from the exact residual (Markstein),
# which is the quotient rounded to nearest even for every amax that does not underflow; a
# GPU's div.rn takes this same path behind a range check and a branch to a slow path
_SIX_G = torch.tensor(E2M1_MAX, dtype=torch.float32) * torch.tensor(NVFP4_GLOBAL_SCALE, dtype=torch.float32)
_RCP_SIX_G = torch.ones((), dtype=torch.float32) / _SIX_G
_DIV_SIX_G = tl.constexpr("{ .reg .f32 q, r; mul.rn.f32 q, $1, %s; fma.rn.f32 r, q, %s, $1; "
                          "fma.rn.f32 $0, r, %s, q; }" % (_f32_hex(_RCP_SIX_G), _f32_hex(-_SIX_G),
                                                          _f32_hex(_RCP_SIX_G)))
# 1 / d for a block's d = e4m3 scale * g (g = 1: 2^-9 <= d <= 448, never subnormal): the
# approximate reciprocal and two Newton steps by fused multiply-adds, the path div.rn takes
# when its range check passes (as it always does here), without the check and its branch
_RCP_RN = tl.constexpr("{ .reg .f32 r, e, n; neg.f32 n, $1; rcp.approx.ftz.f32 r, $1; "
                       "fma.rn.f32 e, n, r, 0f3F800000; fma.rn.f32 r, r, e, r; "
                       "fma.rn.f32 e, n, r, 0f3F800000; fma.rn.f32 $0, r, e, r; }")


@triton.jit
def e2m1_sums(v):
    """int32 bits of rounded sums whose low 3 bits are the e2m1 codes 0..7 of fp32 magnitudes
    v >= 0 on the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} (nearest even, saturating at 6), and
    whose bit 3 is 0; in seven float ops.

    The grid steps by 0.5 below 2 (code 2v), by 1 up to 4 (code v + 2) and by 2 above (code
    v / 2 + 4). Each sum below rounds its scaled v to an integer with fp32's own rounding
    (nearest even: integer parity is code parity) and carries the code in its low bits; the
    smallest of the three is the code of v's own range (below 2, 2v <= v + 2 <= v / 2 + 4;
    from 2 up v + 2 is smallest, from 4 up v / 2 + 4), capped at 7.
    Example (the low 3 bits): 0.75 -> 2 (1.0), 1.25 -> 2, 1.75 -> 4 (2.0), 2.6 -> 5 (3.0),
    9.0 -> 7 (6.0)."""
    t = tl.minimum(tl.minimum(v * 2.0 + _MAGIC, v + (_MAGIC + 2.0)),
                   tl.minimum(v * 0.5 + (_MAGIC + 4.0), _MAGIC + 7.0))
    return t.to(tl.int32, bitcast=True)  # bits above the third are those of _MAGIC's


@triton.jit
def _abs_mul_rn(a, b):
    """fp32 |a| * b rounded before it is added to anything: a GPU would fuse the product into
    the add that follows (one rounding instead of two), and the codes must be those of the
    rounded magnitude, as in the torch twin and the interpreter."""
    if INTERPRETED:
        return tl.abs(a) * b
    return tl.inline_asm_elementwise("{ .reg .f32 t; abs.f32 t, $1; mul.rn.f32 $0, t, $2; }", "=f,f,f", [a, b],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _with_sign(t, top):
    """Sign-and-code nibbles: the code bits 0-2 of :func:`e2m1_sums`'s t, bit 3 of top (a
    value's top four bits, as the high word of its bits * 16: one multiply; top < 16, so
    ``(t & 7) | (top & ~7)``). One three-input logic op; left to itself the compiler spreads
    the or over the packing's shifts."""
    if INTERPRETED:
        return (t & 7) | (top & 8)
    return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, 7, 0xE4;", "=r,r,r", [t, top], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _codes(x, inv):
    """int32 sign-and-code nibbles (0..15) of fp32 values x, scaled by inv (broadcast)."""
    top = tl.umulhi(x.to(tl.uint32, bitcast=True), 16).to(tl.int32, bitcast=True)
    return _with_sign(e2m1_sums(_abs_mul_rn(x, inv)), top)


@triton.jit
def _pack_half(x, inv):
    """[..., 8] fp32 channels (half of each of a tile's blocks) and the blocks' 1 / d [...] ->
    int32 [...]: channel j's sign-and-code nibble at bits 4j (little-endian bytes: channel
    2i in the low nibble of byte i)."""
    shift = 4 * tl.arange(0, 8)
    return tl.sum(_codes(x, tl.expand_dims(inv, -1)) << shift, axis=-1)  # disjoint bits: the sum is their or


@triton.jit
def _pack_words(even, odd, inv):
    """As :func:`_pack_half` for 8 channels given as the even and odd ones [..., 4] of 4 words
    (:func:`bf16_words`): channel 2i to the low nibble of byte i, 2i + 1 to its high nibble."""
    inv = tl.expand_dims(inv, -1)
    shift = 8 * tl.arange(0, 4)
    return tl.sum((_codes(even, inv) + (_codes(odd, inv) << 4)) << shift, axis=-1)


@triton.jit
def block_scales(amax, g, FAST: tl.constexpr):
    """(e4m3 bits uint8, fp32 1 / d) of blocks with largest magnitude amax and per-tensor scale
    g (:mod:`ray_ep.nvfp4`, steps 1 and 2). FAST: g is the dispatch's NVFP4_GLOBAL_SCALE, so
    both divisions go without a GPU's range check and slow path (same bits)."""
    if FAST and not INTERPRETED:
        q = tl.inline_asm_elementwise(_DIV_SIX_G, "=f,f", [amax], dtype=tl.float32, is_pure=True, pack=1)
    else:
        q = tl.math.div_rn(amax, tl.full(amax.shape, _E2M1_MAX, tl.float32) * g)
    s8 = to_e4m3(tl.minimum(q, _FP8_MAX))  # >= 0
    d = s8.to(tl.float32) * g
    pos = d > 0
    if FAST and not INTERPRETED:
        inv = tl.inline_asm_elementwise(_RCP_RN, "=f,f", [tl.where(pos, d, 1.0)], dtype=tl.float32, is_pure=True,
                                        pack=1)
    else:
        inv = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(pos, d, 1.0))
    return s8.to(tl.uint8, bitcast=True), tl.where(pos, inv, 0.0)


@triton.jit
def quantize_nvfp4_blocks(lo, hi, g, FAST: tl.constexpr):
    """Quantise nvfp4 blocks given as halves: lo, hi [..., 8] fp32 are channels 0-7 and 8-15
    of a tile's blocks (those of :func:`load_blocks`: [NB, ROWS]), with per-tensor scale g
    (FAST: see :func:`block_scales`). A block's 16 channels are then one thread's (a tile of
    whole blocks would spread them over two threads: a shuffle for each amax, each scale
    worked out twice, and packed bytes moved between threads to be stored).

    Returns (int64 [...]: each block's 8 packed bytes, little-endian; block scales as e4m3
    bits uint8 [...]). Example (g = 1): a block with amax 3.0 gets scale 0.5 (bits 0x30); 1.3
    in it is 2.6 -> code 5 (3.0); -0.2 is 0.4 -> code 0x9 (-0.5).
    """
    amax = tl.maximum(tl.max(tl.abs(lo), axis=-1), tl.max(tl.abs(hi), axis=-1))
    s, inv = block_scales(amax, g, FAST)
    packed = _pack_half(lo, inv).to(tl.uint32).to(tl.int64) | (_pack_half(hi, inv).to(tl.int64) << 32)
    return packed, s


@triton.jit
def quantize_nvfp4_words(lo, hi, g, FAST: tl.constexpr):
    """:func:`quantize_nvfp4_blocks` of bf16 blocks held as words: lo, hi int32 [..., 4] are
    channels 0-7 and 8-15 of each block, two per word (:func:`load_block_words`)."""
    even_lo, odd_lo = bf16_words(lo)
    even_hi, odd_hi = bf16_words(hi)
    amax = tl.maximum(tl.maximum(tl.max(abs_f32(even_lo), axis=-1), tl.max(abs_f32(odd_lo), axis=-1)),
                      tl.maximum(tl.max(abs_f32(even_hi), axis=-1), tl.max(abs_f32(odd_hi), axis=-1)))
    s, inv = block_scales(amax, g, FAST)
    packed = (_pack_words(even_lo, odd_lo, inv).to(tl.uint32).to(tl.int64)
              | (_pack_words(even_hi, odd_hi, inv).to(tl.int64) << 32))
    return packed, s


@triton.jit
def load_blocks(x_row3, h0, H, rm3, NB: tl.constexpr):
    """The two halves (channels 0-7 and 8-15) of NB blocks from channel h0 of the rows x_row3
    [1, ROWS, 1] (pointers to their first channels) as [NB, ROWS, 8] tiles, zeros past H and
    where rm3 [1, ROWS, 1] is False. Blocks first: Triton lays out a tile's threads along its
    contiguous axis, then along the first of the others, so a warp takes neighbouring blocks
    of a row (its loads and stores coalesce) and the block scales [NB, ROWS] keep the same
    threads (no exchange through shared memory to store them)."""
    c = h0 + 16 * tl.arange(0, NB)[:, None, None] + tl.arange(0, 8)[None, None, :]
    m = rm3 & (c < H)
    return tl.load(x_row3 + c, mask=m, other=0.0), tl.load(x_row3 + c + 8, mask=m, other=0.0)


@triton.jit
def load_block_pairs(x_row4, h0, H, rm4, NP: tl.constexpr):
    """As :func:`load_blocks` for NP pairs of neighbouring blocks: [NP, ROWS, 2, 8] tiles from
    the rows x_row4 [1, ROWS, 1, 1] (rm4 alike). The pair's axis is neither the contiguous one
    nor the first, so a thread holds both blocks of its pair: their packed bytes and scales
    leave in one store each, twice as wide as a block's."""
    c = (h0 + 32 * tl.arange(0, NP)[:, None, None, None] + 16 * tl.arange(0, 2)[None, None, :, None]
         + tl.arange(0, 8)[None, None, None, :])
    m = rm4 & (c < H)
    return tl.load(x_row4 + c, mask=m, other=0.0), tl.load(x_row4 + c + 8, mask=m, other=0.0)


@triton.jit
def load_block_words(w_row3, h0, H, rm3, NB: tl.constexpr):
    """As :func:`load_blocks` for bf16 rows read as int32 words (w_row3: int32 pointers to the
    rows' first channels): [NB, ROWS, 4] words each, two channels a word."""
    c = h0 // 2 + 8 * tl.arange(0, NB)[:, None, None] + tl.arange(0, 4)[None, None, :]
    m = rm3 & (c < H // 2)
    return tl.load(w_row3 + c, mask=m, other=0), tl.load(w_row3 + c + 4, mask=m, other=0)


@triton.jit
def load_block_pair_words(w_row4, h0, H, rm4, NP: tl.constexpr):
    """As :func:`load_block_pairs` for bf16 rows read as int32 words (as
    :func:`load_block_words`): [NP, ROWS, 2, 4] words each."""
    c = (h0 // 2 + 16 * tl.arange(0, NP)[:, None, None, None] + 8 * tl.arange(0, 2)[None, None, :, None]
         + tl.arange(0, 4)[None, None, None, :])
    m = rm4 & (c < H // 2)
    return tl.load(w_row4 + c, mask=m, other=0), tl.load(w_row4 + c + 4, mask=m, other=0)


def block_warps(rows: int, channels: int, most: int, blocks_per_thread: int = 1) -> int:
    """Warps (at most ``most``) for a [rows, channels] tile quantised ``blocks_per_thread``
    whole blocks per thread (:func:`quantize_nvfp4_blocks`): no more threads than that needs,
    or some repeat others' work."""
    return max(1, min(most, rows * channels // (32 * NVFP4_BLOCK * blocks_per_thread)))


@triton.jit
def wire_row_bytes(H):
    """Bytes of an nvfp4 wire row of H channels (:func:`ray_ep.config.nvfp4_row_bytes`):
    H / 2 packed, then H / 16 scales padded to 16 bytes. Example: H 128 -> 64 + 16 = 80."""
    return H // 2 + (H // 16 + 15) // 16 * 16


@triton.jit
def e2m1_to_f32(code):
    """fp32 values of int32 codes 0..15 (integer ops only: Hopper has no fp4 type).
    Example: 0x5 -> 3.0, 0x9 -> -0.5, 0x8 -> -0.0."""
    e = (code >> 1) & 3
    m = code & 1
    # e >= 1: 2^(e - 1) * (1 + m / 2), i.e. fp32 exponent e + 126 and mantissa bit 22 = m;
    # e = 0: 0 or 0.5 (0x3F000000)
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * 0x3F000000)
    v = bits.to(tl.float32, bitcast=True)
    # times -1, not unary minus: Triton lowers -v to 0 - v, which turns -0 into +0
    return tl.where(code >= 8, v * -1.0, v)


@triton.jit
def e4m3_bits_to_f32(bits):
    """fp32 values of e4m3 block scales held as uint8 bits."""
    return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def unpack_nvfp4_tile(packed, bits, global_scale):
    """fp32 [ROWS, 2 * P] of packed codes [ROWS, P] (uint8 or int32) and their block scales'
    bits [ROWS, P / 8], times the per-tensor scale: ``e2m1(code) * (scale * global_scale)``."""
    ROWS: tl.constexpr = packed.shape[0]
    P: tl.constexpr = packed.shape[1]
    p = packed.to(tl.int32)
    codes = tl.reshape(tl.join(p & 15, p >> 4), (ROWS, P // (_BLOCK // 2), _BLOCK))
    v = e2m1_to_f32(codes) * (e4m3_bits_to_f32(bits) * global_scale)[:, :, None]
    return tl.reshape(v, (ROWS, 2 * P))


@triton.jit
def _quantize_nvfp4_kernel(x_ptr, q_ptr, s_ptr, T, H, stride_x, global_scale,
                           BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, FAST: tl.constexpr, WORDS: tl.constexpr):
    """q_ptr: the packed bytes as int64 [T, H / 16] (a block's 8 bytes each). FAST: global_scale
    is the dispatch's (:func:`block_scales`); WORDS: bf16 rows that start 4-byte aligned, read
    as words (:func:`quantize_nvfp4_words`)."""
    NB: tl.constexpr = BLOCK_H // _BLOCK
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    r = rows[None, :].to(tl.int64)  # [1, BLOCK_T]
    x_row3 = x_ptr + r[:, :, None] * stride_x
    for h0 in range(0, H, BLOCK_H):
        if WORDS:
            lo, hi = load_block_words(x_row3.to(tl.pointer_type(tl.int32)), h0, H, r[:, :, None] < T, NB)
            packed, s = quantize_nvfp4_words(lo, hi, global_scale, FAST)
        else:
            lo, hi = load_blocks(x_row3, h0, H, r[:, :, None] < T, NB)
            packed, s = quantize_nvfp4_blocks(lo.to(tl.float32), hi.to(tl.float32), global_scale, FAST)
        b = h0 // _BLOCK + tl.arange(0, NB)[:, None]  # [NB, 1]
        m = (r < T) & (b < H // _BLOCK)
        tl.store(q_ptr + r * (H // _BLOCK) + b, packed, mask=m)
        tl.store(s_ptr + r * (H // _BLOCK) + b, s, mask=m)


@triton.jit
def _dequantize_nvfp4_kernel(q_ptr, s_ptr, out_ptr, T, H, stride_q, stride_s, global_scale,
                             BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows[:, None] < T
    r64 = rows[:, None].to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        pc = h0 // 2 + tl.arange(0, BLOCK_H // 2)
        p = tl.load(q_ptr + r64 * stride_q + pc[None, :], mask=rmask & (pc[None, :] < H // 2), other=0)
        bc = h0 // _BLOCK + tl.arange(0, BLOCK_H // _BLOCK)
        bits = tl.load(s_ptr + r64 * stride_s + bc[None, :], mask=rmask & (bc[None, :] < H // _BLOCK), other=0)
        v = unpack_nvfp4_tile(p, bits, global_scale)
        cols = h0 + tl.arange(0, BLOCK_H)
        tl.store(out_ptr + r64 * H + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=rmask & (cols[None, :] < H))


def quantize_nvfp4(*, x_TH: torch.Tensor, global_scale: float = NVFP4_GLOBAL_SCALE
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise rows to nvfp4 (see :mod:`ray_ep.nvfp4` for the format and its rounding).

    x_TH [T, H] bf16/fp16/fp32, H a multiple of 16 (rows may be strided). Returns q_TP [T, H/2]
    uint8 (two e2m1 codes per byte, channel 2i in the low nibble) and scales_TB [T, H/16]
    float8_e4m3fn. Example (g = 1): a block with amax 3.0 gets scale 0.5, and 1.3 in it becomes
    code 5 (3.0 * 0.5 = 1.5 back).
    """
    check_quantize_inputs(x_TH, global_scale)
    T, H = x_TH.shape
    q = torch.empty(T, H // 2, dtype=torch.uint8, device=x_TH.device)
    s = torch.empty(T, H // NVFP4_BLOCK, dtype=torch.uint8, device=x_TH.device)
    if T:
        bt, bh = tile_shape(H, x_TH.device, multiple=2 * NVFP4_BLOCK)
        warps = block_warps(bt, bh, 4)
        _quantize_nvfp4_kernel[(cdiv(T, bt),)](x_ptr=x_TH, q_ptr=q.view(torch.int64), s_ptr=s, T=T, H=H,
                                                       stride_x=x_TH.stride(0), global_scale=float(global_scale),
                                                       BLOCK_T=bt, BLOCK_H=bh,
                                                       FAST=float(global_scale) == NVFP4_GLOBAL_SCALE,
                                                       WORDS=reads_words(x_TH),
                                                       num_warps=warps)
    return q, s.view(torch.float8_e4m3fn)


def dequantize_nvfp4(*, q_TP: torch.Tensor, scales_TB: torch.Tensor, global_scale: float = NVFP4_GLOBAL_SCALE,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """nvfp4 rows back to ``out_dtype`` [T, H]: ``e2m1(code) * (scale * global_scale)`` in fp32.
    q_TP [T, H/2] uint8 and scales_TB [T, H/16] float8_e4m3fn may be strided (views of wire rows)."""
    check_dequantize_inputs(q_TP, scales_TB, global_scale)
    T, P = q_TP.shape
    out = torch.empty(T, 2 * P, dtype=out_dtype, device=q_TP.device)
    if T:
        bt, bh = tile_shape(2 * P, q_TP.device, multiple=2 * NVFP4_BLOCK)
        _dequantize_nvfp4_kernel[(cdiv(T, bt),)](q_ptr=q_TP, s_ptr=scales_TB.view(torch.uint8), out_ptr=out,
                                                         T=T, H=2 * P, stride_q=q_TP.stride(0),
                                                         stride_s=scales_TB.stride(0), global_scale=float(global_scale),
                                                         BLOCK_T=bt, BLOCK_H=bh)
    return out
