"""The fp8 wire format of dispatch: e4m3 values, one fp32 scale per 128 channels.

Legend: T rows, H channels, G = H / FP8_GROUP scale groups.

A group of 128 channels with largest magnitude ``amax`` gets ``scale = amax / 448`` (1 for an
all-zero group) and values ``q = e4m3(x * (448 / amax))``, rounded to nearest even; ``q *
scale`` gives x back within fp8 precision. Both divisions are IEEE divisions of fp32 tensors
(a multiply by a reciprocal would round differently from the Triton kernels).

These torch implementations run on the CPU backend and in the benchmarks' checks; the Triton
kernels of :mod:`ray_ep.kernels.quant` compute the same bits on GPUs.
"""

from __future__ import annotations

import torch

from .config import FP8_GROUP, FP8_MAX
from .errors import EPInputError
from .validation import check_tensor


def _check_h(H: int) -> None:
    if H % FP8_GROUP:
        raise EPInputError(f"fp8 quantisation needs H a multiple of {FP8_GROUP}, got H = {H}")


def check_quantize_inputs(x_TH: torch.Tensor) -> None:
    check_tensor("x_TH", x_TH, dims=2, dtypes=(torch.bfloat16, torch.float16, torch.float32), inner_contiguous=True)
    _check_h(x_TH.shape[1])


def check_dequantize_inputs(q_TH: torch.Tensor, scales_TG: torch.Tensor) -> None:
    check_tensor("q_TH", q_TH, dims=2, dtypes=(torch.float8_e4m3fn,), contiguous=True)
    T, H = q_TH.shape
    _check_h(H)
    check_tensor("scales_TG", scales_TG, shape=(T, H // FP8_GROUP), dtypes=(torch.float32,),
                 contiguous=True, device=q_TH.device)


def quantize_fp8_torch(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_TH [T, H] float8_e4m3fn, scales_TG [T, G] fp32) of rows x_TH [T, H] (bf16, fp16
    or fp32; rows may be strided). Example: a group with amax 3.5 gets scale 3.5 / 448 =
    0.0078125 and q = x / 0.0078125 rounded to e4m3."""
    check_quantize_inputs(x_TH)
    T, H = x_TH.shape
    groups = x_TH.float().reshape(T, H // FP8_GROUP, FP8_GROUP)
    amax = groups.abs().amax(dim=-1)
    zero = amax == 0
    amax = amax.masked_fill(zero, 1.0)
    limit = torch.full_like(amax, FP8_MAX)
    scales = (amax / limit).masked_fill(zero, 1.0)
    factor = (limit / amax).masked_fill(zero, 1.0)
    q = torch.clamp(groups * factor.unsqueeze(-1), min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(T, H), scales


def dequantize_fp8_torch(q_TH: torch.Tensor, scales_TG: torch.Tensor,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows [T, H] in ``out_dtype`` from fp8 values and their per-group scales (fp32 math)."""
    check_dequantize_inputs(q_TH, scales_TG)
    T, H = q_TH.shape
    values = q_TH.float().view(T, H // FP8_GROUP, FP8_GROUP) * scales_TG.float().unsqueeze(-1)
    return values.view(T, H).to(out_dtype)


# ---- weight blocks -------------------------------------------------------------------------
def _check_blocks(w: torch.Tensor) -> tuple[int, int]:
    if w.dim() < 2 or w.shape[-2] % FP8_GROUP or w.shape[-1] % FP8_GROUP:
        raise EPInputError(f"fp8 weight blocks need both matrix dims multiples of {FP8_GROUP}, got shape "
                           f"{tuple(w.shape)}")
    return w.shape[-2] // FP8_GROUP, w.shape[-1] // FP8_GROUP


def quantize_fp8_blocks_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [..., D, O] (any float dtype) to fp8 e4m3 with one fp32 scale per 128 x 128
    block: (q [..., D, O] float8_e4m3fn, scales [..., D / 128, O / 128] fp32), ``q * scale``
    is the weight (DeepSeek-V3's ``weight_scale_inv``, in the [in, out] layout). A block's
    scale is amax / 448 (1 for an all-zero block), as for activation rows. Example: a block
    with amax 0.25 gets scale 0.25 / 448 and its largest value becomes +-448."""
    Db, Ob = _check_blocks(w)
    if w.dim() > 2:
        # one [D, O] matrix at a time: the fp32 temporaries of a whole rank's experts at once
        # (~6x their bf16 bytes) ran a CPU host out of memory (qwen3-moe, 2 ranks, 24 GB)
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
        scales = torch.empty(*w.shape[:-2], Db, Ob, dtype=torch.float32, device=w.device)
        for i, m in enumerate(w.reshape(-1, *w.shape[-2:])):
            qi, si = quantize_fp8_blocks_torch(m)
            q.view(-1, *w.shape[-2:])[i] = qi
            scales.view(-1, Db, Ob)[i] = si
        return q, scales
    blocks = w.float().reshape(Db, FP8_GROUP, Ob, FP8_GROUP)
    amax = blocks.abs().amax(dim=(-3, -1))
    zero = amax == 0
    amax = amax.masked_fill(zero, 1.0)
    limit = torch.full_like(amax, FP8_MAX)
    scales = (amax / limit).masked_fill(zero, 1.0)
    factor = (limit / amax).masked_fill(zero, 1.0)
    q = torch.clamp(blocks * factor[:, None, :, None], min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(w.shape), scales


def dequantize_fp8_blocks_torch(q: torch.Tensor, scales: torch.Tensor,
                                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8 weights [..., D, O] with block scales [..., D / 128, O / 128] back to ``out_dtype``
    (fp32 math: ``q * scale``)."""
    Db, Ob = _check_blocks(q)
    if q.dim() > 2:  # one matrix at a time, as quantize_fp8_blocks_torch
        out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
        flat = out.view(-1, *q.shape[-2:])
        for i, (m, sc) in enumerate(zip(q.reshape(-1, *q.shape[-2:]), scales.reshape(-1, Db, Ob))):
            flat[i] = dequantize_fp8_blocks_torch(m, sc, out_dtype)
        return out
    s = scales.float().repeat_interleave(FP8_GROUP, dim=-2).repeat_interleave(FP8_GROUP, dim=-1)
    return (q.float() * s).to(out_dtype)
