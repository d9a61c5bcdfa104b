"""fp8 e4m3 per-token quantisation with one fp32 scale per 128 channels, and back.

Legend: T rows, H channels, G = H / 128 scale groups.

The device helpers :func:`quantize_group` (and :func:`quantize_group_words`, for bf16 rows read
as int32 words: :func:`bf16_words`), :func:`to_e4m3` and :func:`e4m3_pairs` are shared with the
dispatch kernel, which quantises inside the send, and with :mod:`ray_ep.kernels.nvfp4`. The
torch implementations (the twins) are :func:`ray_ep.fp8.quantize_fp8_torch` and
:func:`ray_ep.fp8.dequantize_fp8_torch`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import FP8_GROUP, FP8_MAX
from ..fp8 import check_dequantize_inputs, check_quantize_inputs
from ._util import INTERPRETED, cdiv, tile_shape

_GROUP = tl.constexpr(FP8_GROUP)
_FP8_MAX = tl.constexpr(FP8_MAX)
# The CPU interpreter mis-rounds fp32 -> e4m3 (see round_to_e4m3), so it rounds in fp32 first;
# a GPU converts with one cvt.rn.satfinite per two values (nearest even, saturating at 448),
# which gives the same bits without the ~13 integer and float ops per value (the fp8 send
# under an SM budget is bound by its instructions)
# below 2^-6 e4m3 is subnormal, with a fixed step of 2^-9
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)


@triton.jit
def round_to_e4m3(v):
    """Round fp32 values in [-448, 448] to the e4m3 grid, nearest even, in fp32 arithmetic.

    The final ``.to(tl.float8e4nv)`` of the result is then exact. Why not convert directly:
    the Triton CPU interpreter mis-rounds when the mantissa carry reaches the exponent
    (7.93 -> 4.0); on GPUs both ways agree.
    Example: 7.93 -> 8.0, 0.30 -> 0.3125, 0.001 -> 0.001953125 (subnormal step 2^-9).
    """
    bits = v.to(tl.int32, bitcast=True)
    # keep 3 mantissa bits: add half an ulp (minus one, plus the kept lsb for ties-to-even)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    # below 2^-6 e4m3 is subnormal with a fixed step of 2^-9: the add/sub of 1.5 * 2^14
    # makes fp32 itself round at that step. It works on |v| and puts the sign bit back, so
    # a negative value that rounds to zero gives -0 as a direct conversion does (the twin)
    sub = (tl.abs(v) + 24576.0) - 24576.0  # 24576 = 1.5 * 2^14: fp32's ulp there is 2^-9
    sign = v.to(tl.int32, bitcast=True) & -2147483648  # -2147483648 == 0x80000000
    sub = (sub.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) < _E4M3_MIN_NORMAL, sub, normal)


@triton.jit
def to_e4m3(v):
    """fp32 values with |v| <= 448 (up to fp32 rounding) to float8e4nv, nearest even."""
    if INTERPRETED:
        v = round_to_e4m3(tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX))
    return v.to(tl.float8e4nv)


@triton.jit
def bf16_words(w):
    """(even, odd) fp32 channels of int32 words that each hold two bf16 channels (the even one
    in the low half): a shift and a mask, where converting each bf16 value takes two ops. On
    a GPU both are opaque to the compiler, which otherwise folds a later |odd| into the mask
    (one more op) where a float op takes |x| for free."""
    if INTERPRETED:
        return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)
    even = tl.inline_asm_elementwise("shl.b32 $0, $1, 16;", "=r,r", [w], dtype=tl.int32, is_pure=True, pack=1)
    odd = tl.inline_asm_elementwise("and.b32 $0, $1, 0xFFFF0000;", "=r,r", [w], dtype=tl.int32, is_pure=True,
                                    pack=1)
    return even.to(tl.float32, bitcast=True), odd.to(tl.float32, bitcast=True)


@triton.jit
def abs_f32(x):
    """|x| as PTX's abs.f32, which the compiler folds into the next float op as an operand
    modifier; tl.abs lowers to a mask, an op of its own when x comes from bit ops."""
    if INTERPRETED:
        return tl.abs(x)
    return tl.inline_asm_elementwise("abs.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


def reads_words(x_TH: torch.Tensor) -> bool:
    """Whether a send or quantise kernel reads rows x_TH as int32 words of two channels
    (:func:`bf16_words`): bf16 rows that start 4-byte aligned (others would fault)."""
    return x_TH.dtype == torch.bfloat16 and x_TH.data_ptr() % 4 == 0 and x_TH.stride(0) % 2 == 0


@triton.jit
def e4m3_pairs(lo, hi):
    """int16 [...] of two fp32 tiles' e4m3 codes (as to_e4m3): lo's in the low byte, hi's in
    the high one; on a GPU one cvt.rn.satfinite per pair, as to_e4m3 converts neighbours."""
    if INTERPRETED:
        lo8 = to_e4m3(lo).to(tl.uint8, bitcast=True).to(tl.int16)
        hi8 = to_e4m3(hi).to(tl.uint8, bitcast=True).to(tl.int16)
        return lo8 | (hi8 << 8)
    return tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,f,f", [lo, hi],
                                     dtype=tl.int16, is_pure=True, pack=1)


@triton.jit
def group_scales(amax):
    """(448 / amax, amax / 448) of groups with largest magnitude amax: the multiplier to e4m3
    and the scale back (1 and 1 for an all-zero group)."""
    nonzero = amax > 0
    safe = tl.where(nonzero, amax, 1.0)
    limit = tl.full(safe.shape, _FP8_MAX, tl.float32)
    return tl.where(nonzero, tl.math.div_rn(limit, safe), 1.0), tl.where(nonzero, tl.math.div_rn(safe, limit), 1.0)


@triton.jit
def quantize_group(x, GROUPS: tl.constexpr):
    """Quantise a [ROWS, GROUPS * 128] fp32 tile. Returns (q as float8e4nv [ROWS, GROUPS*128],
    scales fp32 [ROWS, GROUPS]). scale = amax / 448 per group (1 for an all-zero group)."""
    ROWS: tl.constexpr = x.shape[0]
    g = tl.reshape(x, (ROWS, GROUPS, _GROUP))
    inv, scales = group_scales(tl.max(tl.abs(g), axis=2))
    q = to_e4m3(g * inv[:, :, None])
    return tl.reshape(q, (ROWS, GROUPS * _GROUP)), scales


@triton.jit
def quantize_group_words(w, GROUPS: tl.constexpr):
    """:func:`quantize_group` of bf16 channels held as int32 words [ROWS, GROUPS * 64], two
    channels a word (:func:`bf16_words`: a shift or a mask per channel, where a bf16
    conversion takes two ops). Returns (the codes as int16 [ROWS, GROUPS * 64]: a word's
    two channels' e4m3 bytes in its order, to be stored as they are; scales fp32 [ROWS,
    GROUPS])."""
    ROWS: tl.constexpr = w.shape[0]
    even, odd = bf16_words(tl.reshape(w, (ROWS, GROUPS, _GROUP // 2)))
    inv, scales = group_scales(tl.maximum(tl.max(abs_f32(even), axis=2), tl.max(abs_f32(odd), axis=2)))
    q = e4m3_pairs(even * inv[:, :, None], odd * inv[:, :, None])
    return tl.reshape(q, (ROWS, GROUPS * _GROUP // 2)), scales


@triton.jit
def store_scales(ptrs, scales, mask, AS_REDUCED: tl.constexpr):
    """Store a [ROWS, GROUPS] fp32 tile of :func:`quantize_group`'s scales at ``ptrs`` where
    ``mask``.

    AS_REDUCED (a GPU): from the layout the group reduction left them in, by inline PTX, where
    Triton would first move them through shared memory, between two barriers of every warp,
    to the layout it picks for the pointers; the threads that share a group each store the
    same value to the same address. For a program alone on its SM (an SM budget), whose warps
    would wait for one another at every step; 2x H200, prefill fp8 dispatch at 24 / 16 SMs:
    229.9 / 322.5 -> 192.2 / 265.9 us. With every SM (many programs per SM hide the barriers)
    it cost more than it saved: 120.3 -> 127.3 us. The interpreter stores them normally."""
    if INTERPRETED or not AS_REDUCED:
        tl.store(ptrs, scales, mask=mask)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }", "=r,l,r,r",
            [ptrs.to(tl.int64), scales.to(tl.int32, bitcast=True), mask.to(tl.int32)], dtype=tl.int32,
            is_pure=False, pack=1)


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, s_ptr, T, H, stride_x, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                         WORDS: tl.constexpr):
    """WORDS: bf16 rows read as int32 words (:func:`reads_words`), codes stored two a store."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows[:, None] < T
    for h0 in range(0, H, BLOCK_H):
        if WORDS:
            wc = h0 // 2 + tl.arange(0, BLOCK_H // 2)
            mask = rmask & (wc[None, :] < H // 2)
            w_ptr = x_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None].to(tl.int64) * (stride_x // 2)
            q, s = quantize_group_words(tl.load(w_ptr + wc[None, :], mask=mask, other=0), BLOCK_H // _GROUP)
            tl.store(q_ptr.to(tl.pointer_type(tl.int16)) + rows[:, None].to(tl.int64) * (H // 2) + wc[None, :], q,
                     mask=mask)
        else:
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = rmask & (cols[None, :] < H)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0)
            q, s = quantize_group(x.to(tl.float32), BLOCK_H // _GROUP)
            tl.store(q_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], q, mask=mask)
        g = h0 // _GROUP + tl.arange(0, BLOCK_H // _GROUP)
        tl.store(s_ptr + rows[:, None] * (H // _GROUP) + g[None, :], s, mask=rmask & (g[None, :] < H // _GROUP))


@triton.jit
def _dequantize_fp8_kernel(q_ptr, s_ptr, out_ptr, T, H, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows[:, None] < T
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = rmask & (cols[None, :] < H)
        q = tl.load(q_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], mask=mask, other=0.0)
        g = h0 // _GROUP + tl.arange(0, BLOCK_H // _GROUP)
        s = tl.load(s_ptr + rows[:, None] * (H // _GROUP) + g[None, :], mask=rmask & (g[None, :] < H // _GROUP),
                    other=1.0)
        v = tl.reshape(q.to(tl.float32), (BLOCK_T, BLOCK_H // _GROUP, _GROUP)) * s[:, :, None]
        v = tl.reshape(v, (BLOCK_T, BLOCK_H))
        tl.store(out_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_fp8(*, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise rows to fp8 e4m3 with one fp32 scale per 128 channels.

    x_TH [T, H] bf16/fp16/fp32 (rows may be strided). Returns q_TH [T, H] float8_e4m3fn and
    scales_TG [T, H / 128] fp32. Example: a row of 128 channels with amax 3.5 gets scale
    3.5 / 448 = 0.0078125 and q = x / 0.0078125 rounded to e4m3.
    """
    check_quantize_inputs(x_TH)
    T, H = x_TH.shape
    q = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=x_TH.device)
    s = torch.empty(T, H // FP8_GROUP, dtype=torch.float32, device=x_TH.device)
    if T:
        bt, bh = tile_shape(H, x_TH.device, multiple=FP8_GROUP)
        _quantize_fp8_kernel[(cdiv(T, bt),)](x_ptr=x_TH, q_ptr=q, s_ptr=s, T=T, H=H, stride_x=x_TH.stride(0),
                                                     BLOCK_T=bt, BLOCK_H=bh, WORDS=reads_words(x_TH))
    return q, s


def dequantize_fp8(*, q_TH: torch.Tensor, scales_TG: torch.Tensor,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8 rows with per-128-channel scales back to ``out_dtype`` [T, H]."""
    check_dequantize_inputs(q_TH, scales_TG)
    T, H = q_TH.shape
    out = torch.empty(T, H, dtype=out_dtype, device=q_TH.device)
    if T:
        bt, bh = tile_shape(H, q_TH.device, multiple=FP8_GROUP)
        _dequantize_fp8_kernel[(cdiv(T, bt),)](q_ptr=q_TH, s_ptr=scales_TG, out_ptr=out, T=T, H=H,
                                                       BLOCK_T=bt, BLOCK_H=bh)
    return out
