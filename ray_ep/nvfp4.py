"""The nvfp4 wire format of dispatch: e2m1 values, one e4m3 scale per 16 channels, one fp32
scale per tensor (NVIDIA's NVFP4).

Legend: T rows, H channels, P = H / 2 packed bytes, B = H / 16 scale blocks, W = bytes of a
wire row (:func:`ray_ep.config.nvfp4_row_bytes`).

Quantisation of a block of 16 channels with largest magnitude ``amax``, per-tensor scale ``g``:

1. block scale ``s = e4m3(amax / (6 * g))``: the fp32 quotient (``6 * g`` rounded to fp32
   first) rounded to nearest even onto the e4m3 grid, saturating at 448; it may round to 0.
2. ``d = s * g`` (fp32) and its reciprocal ``inv = 1 / d`` (0 where d is 0): one IEEE fp32
   division per block, as fp8's ``448 / amax``.
3. each value: the magnitude ``|x| * inv`` rounded to nearest even onto the e2m1 grid
   {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating at 6 (ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
   1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4: the even code wins); the code's sign bit is the
   sign bit of x (so -0.1 in a block of amax 6 gives -0, code 0x8, as fp8 gives -0).

``e2m1(code) * d`` gives x back: with g = 1 every such product is exact in bf16.
A code is 4 bits, sign then exponent (2) and mantissa (1); channel 2i sits in the low nibble
of byte i, channel 2i + 1 in the high nibble.

Dispatch uses ``g = NVFP4_GLOBAL_SCALE`` (1.0), fixed: no pass over the tensor before the
send and no per-source field for the receivers. Blocks whose amax lies in [0.094, 2688] keep
full scale precision; smaller blocks get a subnormal scale (coarser; below 6 * 2^-10 they
become zeros), larger ones saturate at 6 * 448 = 2688. The wire row holds the P packed bytes,
then the B scales, then zero padding to 16 bytes.

These torch implementations run on the CPU backend and in the benchmarks' checks; the Triton
kernels of :mod:`ray_ep.kernels.nvfp4` compute the same bits on GPUs.
"""

from __future__ import annotations

import math

import torch

from .config import E2M1_MAX, FP8_MAX, NVFP4_BLOCK, NVFP4_GLOBAL_SCALE, nvfp4_row_bytes
from .errors import EPInputError
from .validation import check_tensor

# e2m1 magnitudes by code (0..7); the sign is bit 3
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoint c lies between codes c and c + 1 (c = 0..6)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _check_h(H: int) -> None:
    if H % NVFP4_BLOCK:
        raise EPInputError(f"nvfp4 quantisation needs H a multiple of {NVFP4_BLOCK} (one e4m3 scale per "
                           f"{NVFP4_BLOCK} channels), got H = {H}")


def check_global_scale(global_scale: float) -> None:
    if not isinstance(global_scale, (int, float)) or isinstance(global_scale, bool) or \
            not math.isfinite(global_scale) or global_scale <= 0:
        raise EPInputError(f"global_scale must be a positive finite number, got {global_scale!r}")


def check_quantize_inputs(x_TH: torch.Tensor, global_scale: float) -> None:
    check_tensor("x_TH", x_TH, dims=2, dtypes=(torch.bfloat16, torch.float16, torch.float32), inner_contiguous=True)
    _check_h(x_TH.shape[1])
    check_global_scale(global_scale)


def check_dequantize_inputs(q_TP: torch.Tensor, scales_TB: torch.Tensor, global_scale: float) -> None:
    check_tensor("q_TP", q_TP, dims=2, dtypes=(torch.uint8,), inner_contiguous=True)
    T, P = q_TP.shape
    _check_h(2 * P)
    check_tensor("scales_TB", scales_TB, shape=(T, 2 * P // NVFP4_BLOCK), dtypes=(torch.float8_e4m3fn,),
                 inner_contiguous=True, device=q_TP.device)
    check_global_scale(global_scale)


def e2m1_codes_torch(v: torch.Tensor) -> torch.Tensor:
    """Codes 0..7 of non-negative fp32 magnitudes, rounded to nearest even, saturating at 6."""
    mid = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=v.device)
    # the code is the number of midpoints v has passed: above midpoint c it is past it; at
    # midpoint c (a tie) only when the upper code c + 1 is the even one
    upper_even = torch.arange(1, 8, device=v.device) % 2 == 0
    passed = (v[..., None] > mid) | ((v[..., None] == mid) & upper_even)
    return passed.sum(-1, dtype=torch.uint8)


def quantize_nvfp4_torch(x_TH: torch.Tensor, global_scale: float = NVFP4_GLOBAL_SCALE
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_TP [T, H/2] uint8, scales_TB [T, H/16] float8_e4m3fn) of rows x_TH [T, H] (bf16,
    fp16 or fp32; rows may be strided). Example (g = 1): a block with amax 3.0 gets scale
    e4m3(0.5) = 0.5, and 1.3 in it becomes 2.6 -> code 5 (3.0), i.e. 1.5 back."""
    check_quantize_inputs(x_TH, global_scale)
    T, H = x_TH.shape
    blocks = x_TH.float().reshape(T, H // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    g = torch.full_like(amax, float(global_scale))
    # tensor / tensor: IEEE divisions as in the kernel (a Python scalar would make torch
    # multiply by a reciprocal, which rounds differently)
    s = torch.clamp(amax / (g * E2M1_MAX), max=FP8_MAX).to(torch.float8_e4m3fn)
    d = s.float() * g
    inv = torch.where(d > 0, torch.ones_like(d) / torch.where(d > 0, d, 1.0), 0.0)
    mag = e2m1_codes_torch(blocks.abs() * inv[..., None])
    codes = (mag | (torch.signbit(blocks).to(torch.uint8) << 3)).reshape(T, H // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), s


def e2m1_values_torch(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit codes (uint8 holding 0..15)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def dequantize_nvfp4_torch(q_TP: torch.Tensor, scales_TB: torch.Tensor, global_scale: float = NVFP4_GLOBAL_SCALE,
                           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows [T, H] in ``out_dtype``: ``e2m1(code) * (scale * g)`` in fp32 (q and scales may be
    strided views of wire rows)."""
    check_dequantize_inputs(q_TP, scales_TB, global_scale)
    T, P = q_TP.shape
    codes = torch.stack([q_TP & 15, q_TP >> 4], dim=-1).reshape(T, 2 * P // NVFP4_BLOCK, NVFP4_BLOCK)
    d = scales_TB.float() * torch.full(scales_TB.shape, float(global_scale), device=q_TP.device)
    return (e2m1_values_torch(codes) * d[..., None]).reshape(T, 2 * P).to(out_dtype)


def wire_views(rows_TW: torch.Tensor, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_TP, scales_TB): views of the packed values and the block scales inside nvfp4 wire
    rows [T, W] uint8 (row stride W)."""
    W = nvfp4_row_bytes(H)
    if rows_TW.dtype != torch.uint8 or rows_TW.dim() != 2 or rows_TW.shape[1] != W:
        raise EPInputError(f"nvfp4 wire rows of H = {H} must be uint8 [T, {W}], got "
                           f"{rows_TW.dtype} {tuple(rows_TW.shape)}")
    return rows_TW[:, :H // 2], rows_TW[:, H // 2:H // 2 + H // NVFP4_BLOCK].view(torch.float8_e4m3fn)
