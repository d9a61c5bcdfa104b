"""Fused SwiGLU over the expert-major rows between the two grouped GEMMs of an expert.

Legend: M_max rows of the expert-major buffer (padding included), F expert intermediate size.
``h_M2F`` holds ``[gate | up]`` per row (2F columns, the output of the gate_up GEMM).

``a[m] = bf16(silu(gate[m]) * up[m])`` in fp32 arithmetic, for every real row m. A row is
real iff ``m < total_rows`` and ``row_ids_M[m] >= 0``; padding rows are neither read nor
written. ``total_rows`` (= ``row_offsets[L]``) lives on the device, so the launcher never
waits on the host: a grid the SMs hold loops over the row blocks below ``total_rows``.

Example (F = 1, M_max = 4, total_rows = [3], row_ids = [0, -1, 5, 9])::

    h = [[1., 2.], [7., 7.], [-1., 4.], [3., 3.]]
    a = [[1.4609], [out], [-1.0781], [out]]    # silu(1) * 2, row 1 padding, row 3 >= total

fp8 output (for a down projection with fp8 weights): ``out`` float8_e4m3fn [M_max, F] and
``out_scales`` [M_max, F / 128] fp32, ``silu(gate) * up`` quantised from fp32 per 128
channels (never rounded to bf16 first) with the bits of :func:`ray_ep.fp8.quantize_fp8_torch`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import FP8_GROUP
from ..errors import EPInputError
from ..fp8 import quantize_fp8_torch
from ..validation import check_tensor
from ._util import cdiv, fast_sigmoid, interpreted, next_power_of_2, num_sms, tile_shape
from .quant import quantize_group


@triton.jit
def _swiglu_kernel(h_ptr, a_ptr, s_ptr, row_ids_ptr, total_rows_ptr, F,
                   stride_hm, stride_hf, stride_am, stride_af, stride_sm, stride_sg,
                   BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr):
    """Blocks of BLOCK_M rows x BLOCK_F channels (axis 1 of the grid: the channel block),
    every program looping over the row blocks below ``total_rows`` (read on the device)."""
    pid_f = tl.program_id(1)
    total = tl.load(total_rows_ptr)
    cols = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    for blk in range(tl.program_id(0), tl.cdiv(total, BLOCK_M), tl.num_programs(0)):
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        in_range = rows < total
        ids = tl.load(row_ids_ptr + rows, mask=in_range, other=-1)
        real = in_range & (ids >= 0)
        mask = real[:, None] & (cols[None, :] < F)
        # int64 rows: M_max * stride can pass 2^31
        rows64 = rows.to(tl.int64)
        gate_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :] * stride_hf
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + F * stride_hf, mask=mask, other=0.0).to(tl.float32)
        a = gate * fast_sigmoid(gate) * up
        a_ptrs = a_ptr + rows64[:, None] * stride_am + cols[None, :] * stride_af
        if FP8:
            # BLOCK_F is a multiple of 128 and F too: every group of the tile is whole
            q, scales = quantize_group(a, BLOCK_F // GROUP)
            tl.store(a_ptrs, q, mask=mask)
            groups = pid_f * (BLOCK_F // GROUP) + tl.arange(0, BLOCK_F // GROUP)
            tl.store(s_ptr + rows64[:, None] * stride_sm + groups[None, :] * stride_sg, scales,
                     mask=real[:, None] & (groups[None, :] < F // GROUP))
        else:
            tl.store(a_ptrs, a.to(a_ptr.dtype.element_ty), mask=mask)


def _check_swiglu(h_M2F: torch.Tensor, row_ids_M: torch.Tensor, total_rows: torch.Tensor,
                  out: torch.Tensor | None, out_scales: torch.Tensor | None = None) -> tuple[int, int]:
    """Validate the arguments of :func:`swiglu` / :func:`swiglu_torch`; returns (M_max, F)."""
    check_tensor("h_M2F", h_M2F, dims=2, dtypes=(torch.bfloat16,))
    M, F2 = h_M2F.shape
    if F2 % 2:
        raise EPInputError(f"h_M2F must hold [gate | up] with an even number of columns (2F), "
                           f"got shape {tuple(h_M2F.shape)}")
    dev = h_M2F.device
    check_tensor("row_ids_M", row_ids_M, shape=(M,), dtypes=(torch.int32,), device=dev)
    check_tensor("total_rows", total_rows, shape=(1,), dtypes=(torch.int32,), device=dev)
    F = F2 // 2
    if out_scales is not None:  # fp8 output
        if F % FP8_GROUP:
            raise EPInputError(f"fp8 output needs F % {FP8_GROUP} == 0 (one scale per {FP8_GROUP} channels), "
                               f"got F = {F}")
        if out is None:
            raise EPInputError("fp8 output: give out [M_max, F] float8_e4m3fn with out_scales")
        check_tensor("out", out, shape=(M, F), dtypes=(torch.float8_e4m3fn,), device=dev)
        check_tensor("out_scales", out_scales, shape=(M, F // FP8_GROUP), dtypes=(torch.float32,), device=dev)
    elif out is not None:
        if out.dtype == torch.float8_e4m3fn:
            raise EPInputError("an fp8 out needs out_scales [M_max, F / 128] fp32")
        check_tensor("out", out, shape=(M, F), dtypes=(torch.bfloat16,), device=dev)
    return M, F


# programs per SM of the SwiGLU's grid, and the channels of a row each takes per block (one
# H200, fp8 output, F 2048, 32.6k real rows of 65k / 131k capacity rows, us: a program per
# capacity row x 1024 channels (before) 176 / 289; looping, 1 row x 2048 channels at 4 warps and
# 16 programs per SM 130 / 163; 1 x 1024 at 16 145 / 179; 2 x 1024 at 16 137 / 168; 2 x 2048 at
# 8 warps and 8 per SM 144 / 172; 4 x 2048 at 8 warps and 4 per SM 161 / 195)
PROGRAMS_PER_SM = 16
BLOCK_CHANNELS = 2048


def _tile(F: int, device: torch.device, fp8: bool) -> tuple[int, int, int]:
    """(rows, channels, warps) of a SwiGLU block: on a GPU one row's BLOCK_CHANNELS at 4
    warps (16 channels a thread), in the interpreter its tile_shape (many rows per op)."""
    multiple = FP8_GROUP if fp8 else 8
    if interpreted():
        rows, channels = tile_shape(F, device, multiple=multiple)
        return rows, channels, 4
    return 1, max(multiple, min(BLOCK_CHANNELS, next_power_of_2(F))), 4


def _check_launchable(device: torch.device) -> None:
    if device.type != "cuda" and not interpreted():
        raise EPInputError(f"swiglu runs Triton on CUDA tensors (or on CPU with TRITON_INTERPRET=1), "
                           f"got tensors on {device}; use swiglu_torch on other devices")


def swiglu(*, h_M2F: torch.Tensor, row_ids_M: torch.Tensor, total_rows: torch.Tensor,
           out: torch.Tensor | None = None, out_scales: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of the real rows of an expert-major buffer, without a host sync.

    Args:
        h_M2F: [M_max, 2F] bf16, gate in columns [0, F), up in [F, 2F). Any strides.
        row_ids_M: [M_max] int32; ``-1`` marks a padding row (any value >= 0 is a real row).
        total_rows: [1] int32 on the device, the rows in use (``row_offsets[L]``; a view such
            as ``row_offsets[-1:]`` works). Rows at or past it are not touched.
        out: optional [M_max, F] bf16 (any strides) to write into; padding rows keep their
            contents. When None a new tensor is allocated with ``torch.empty``: its padding
            rows are then undefined.
        out_scales: optional [M_max, F / 128] fp32 (any strides); with it ``out`` must be
            float8_e4m3fn and receives ``silu(gate) * up`` quantised per 128 channels, these
            their scales (F a multiple of 128).

    Returns:
        a_MF [M_max, F]: ``bf16(silu(gate) * up)`` computed in fp32 on real rows (or its fp8
        quantisation, see ``out_scales``).

    Example::

        a = swiglu(h_M2F=h, row_ids_M=ids, total_rows=row_offsets[-1:])
    """
    M, F = _check_swiglu(h_M2F, row_ids_M, total_rows, out, out_scales)
    _check_launchable(h_M2F.device)
    if out is None:
        out = torch.empty(M, F, dtype=torch.bfloat16, device=h_M2F.device)
    if M == 0 or F == 0:
        return out
    # 1-D index vectors are tiny: a contiguous copy (on the device, no sync) keeps the kernel simple
    row_ids_M = row_ids_M.contiguous()
    fp8 = out_scales is not None
    block_m, block_f, warps = _tile(F, h_M2F.device, fp8)
    f_blocks = cdiv(F, block_f)
    # a grid the SMs hold, looping over the real rows (known on the device only): a program per
    # capacity row, most of them leaving at once, cost more than the rows (see PROGRAMS_PER_SM)
    programs = max(1, min(cdiv(M, block_m), num_sms(h_M2F.device) * PROGRAMS_PER_SM // f_blocks))
    grid = (programs, f_blocks)
    s = out_scales if fp8 else out  # dummy pointer when unused
    _swiglu_kernel[grid](h_ptr=h_M2F, a_ptr=out, s_ptr=s, row_ids_ptr=row_ids_M, total_rows_ptr=total_rows, F=F,
                         stride_hm=h_M2F.stride(0), stride_hf=h_M2F.stride(1), stride_am=out.stride(0),
                         stride_af=out.stride(1), stride_sm=s.stride(0), stride_sg=s.stride(1),
                         BLOCK_M=block_m, BLOCK_F=block_f, FP8=fp8, GROUP=FP8_GROUP, num_warps=warps)
    return out


def swiglu_torch(*, h_M2F: torch.Tensor, row_ids_M: torch.Tensor, total_rows: torch.Tensor,
                 out: torch.Tensor | None = None, out_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of :func:`swiglu` (same arguments, any device; padding rows of a new output
    are zero). Rounds like :func:`ray_ep.reference.swiglu_expert` (bf16 output) and
    :func:`ray_ep.reference.swiglu_expert_fp8` (fp8 output)."""
    M, F = _check_swiglu(h_M2F, row_ids_M, total_rows, out, out_scales)
    if out is None:
        out = torch.zeros(M, F, dtype=torch.bfloat16, device=h_M2F.device)
    # only the rows that arrived: the CPU backend runs this twin, and a capacity-sized pass
    # (max_recv_rows, millions of rows at a large max_tokens_per_rank) would cost seconds per
    # layer for a handful of tokens. Reading the count is a host sync, free on a CPU.
    n = min(M, int(total_rows[0]))
    h = h_M2F[:n].float()
    a = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
    real = row_ids_M[:n] >= 0
    if out_scales is not None:
        q, s = quantize_fp8_torch(a)
        # torch.where has no fp8 kernel: select on the raw bytes
        out[:n] = torch.where(real[:, None], q.view(torch.uint8), out[:n].view(torch.uint8)).view(torch.float8_e4m3fn)
        out_scales[:n] = torch.where(real[:, None], s, out_scales[:n])
        return out
    out[:n] = torch.where(real[:, None], a.to(torch.bfloat16), out[:n])
    return out
