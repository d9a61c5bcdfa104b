"""Grouped GEMM over expert-major rows: every local expert multiplies its own rows by its weight.

Legend: L local experts, M_max expert-major rows (padding included), D reduction (depth) size,
O output columns, G = D / 128 fp8 scale groups. (K stays the top-k of the rest of the package.)

Local expert e owns output rows ``[row_offsets[e], row_offsets[e] + num_tokens[e])``; the
rest of its segment (up to ``row_offsets[e+1]``) is padding and is not written. For an
output row m of expert e::

    c[m] = bf16(A_row(m) @ b[e])        # bf16 operands, fp32 accumulation
    A_row(m) = a[a_row_ids[m]] if a_row_ids is given else a[m]

An fp8 ``a`` (e4m3) comes with ``a_scales`` [rows of a, G] fp32: ``A = bf16(fp8 * scale)``. An
nvfp4 ``a`` is uint8 [rows of a, D / 2], two e2m1 codes per byte, with ``a_scales`` [rows of a,
D / 16] float8_e4m3fn (both may be strided views of the dispatch's wire rows): ``A =
bf16(e2m1(code) * scale)``, exact (per-tensor scale 1, see :mod:`ray_ep.nvfp4`). With bf16
weights the real rows are decoded to bf16 once, in one pass (:func:`decode_rows_bf16`), not in
the A load of every output tile: that redid it for each of the 16 column tiles of
deepseek-v3's gate_up (2x H200, prefill with fp8 dispatch: GEMMs 6490 us against 5265 for bf16
rows).

fp8 weights (``b`` float8_e4m3fn with ``b_scales`` [L, D / 128, O / 128] fp32, one scale per
128 x 128 block) run on fp8 tensor cores, one K block of 128 at a time::

    c[m] = bf16(sum_k dot(qa[m, k block], qb[k block, :]) * (sa[m, k] * sb[k, o block]))

where an fp8 ``a`` enters as it is (``qa = a``, ``sa = a_scales``: the dispatched rows need no
dequantise) and a bf16 or nvfp4 ``a`` is first quantised per 128 channels, each real row once
(:func:`quantize_rows_fp8`), with the bits :func:`ray_ep.fp8.quantize_fp8_torch` gives (so
bf16 dispatch with fp8 weights computes exactly what fp8 dispatch does). Why a pass of its
own: quantising inside the GEMM's A load redid it for every output tile (32 times per row of
deepseek-v3's gate_up) and spilled registers: 16.2 ms against 3.2 ms for fp8 rows (one H200,
gate_up of 64 experts x 512 rows); the pass reads and writes each row once.

On a Hopper GPU, fp8 weights on prefill shapes run :mod:`ray_ep.kernels.grouped_gemm_sm90`
instead (the same sums, warp-specialised in Gluon; see there).

``row_offsets`` / ``num_tokens`` stay on the device:
the grid covers the worst case and each program finds its (expert, m tile, n tile) from
``num_tokens``, so the host never waits. A tile never spans two experts.

Example (L = 2, D = O = 1, row_offsets = [0, 2, 4], num_tokens = [1, 2])::

    a = [[2.], [9.], [3.], [4.]];  b = [[[10.]], [[100.]]]
    c = [[20.], [out], [300.], [400.]]           # row 1 is expert 0's padding
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config import FP8_GROUP, NVFP4_BLOCK
from ..errors import EPInputError
from ..nvfp4 import dequantize_nvfp4_torch
from ..validation import check_tensor
from ._util import (cdiv, expert_tile, interpreted, next_power_of_2, num_sms as sm_count, prefill_rows, tile_in_group,
                    tma_addressable)
from ..fp8 import quantize_fp8_torch
from . import grouped_gemm_sm90 as sm90
from .nvfp4 import unpack_nvfp4_tile
from .quant import quantize_group

# 128-channel groups per step of _convert_rows_kernel over bf16 / fp8 rows (nvfp4 rows: one):
# a row's 1024 channels in one load (16 bytes a thread) where 128 took 2 KB a step per program
STEP_GROUPS = 8
A_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.uint8)  # uint8: nvfp4, two codes per byte
B_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


@triton.jit
def _expert_tiles(num_tokens_ptr, L, O, BLOCK_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr):
    """The experts' tile table of a launch: (experts, real rows, m tiles, tiles and their
    inclusive ends per expert, total tiles), tiles expert-major; inside an expert m runs fastest
    (:func:`ray_ep.kernels._util.expert_tile`), so programs in flight share one [D, BLOCK_O]
    slice of b[e] and the expert's A rows stay in L2 across o tiles."""
    experts = tl.arange(0, BLOCK_L)
    tokens_L = tl.load(num_tokens_ptr + experts, mask=experts < L, other=0)
    m_tiles_L = (tokens_L + BLOCK_M - 1) // BLOCK_M
    tiles_L = m_tiles_L * tl.cdiv(O, BLOCK_O)
    tile_ends_L = tl.cumsum(tiles_L, axis=0)
    return experts, tokens_L, m_tiles_L, tiles_L, tile_ends_L, tl.sum(tiles_L, axis=0)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_desc, a_scales_ptr, a_row_ids_ptr, b_ptr, b_desc, b_scales_ptr, c_ptr, row_offsets_ptr, num_tokens_ptr,
    L, O,
    stride_am, stride_ad, stride_sm, stride_sd,
    stride_bl, stride_bd, stride_bo, stride_bsl, stride_bsd, stride_bso, stride_cm, stride_co,
    D: tl.constexpr, HAS_ROW_IDS: tl.constexpr, GROUP_D: tl.constexpr,
    DOT_FP32: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_D: tl.constexpr, B_FP8: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr,
):
    # D is constexpr: the interpreter (numpy >= 2) cannot loop up to a runtime scalar, and a
    # fixed D per weight shape costs one compile per GEMM of the model.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    experts, tokens_L, m_tiles_L, tiles_L, tile_ends_L, total_tiles = _expert_tiles(num_tokens_ptr, L, O, BLOCK_L,
                                                                                    BLOCK_M, BLOCK_O)

    offs_d = tl.arange(0, BLOCK_D)
    tile = pid
    # persistent loop (a while: its bound lives on the device); one pass when grid = worst case
    while tile < total_tiles:
        e, m_tile, o_tile, tokens = expert_tile(tile, experts, tokens_L, m_tiles_L, tiles_L, tile_ends_L)
        seg_start = tl.load(row_offsets_ptr + e)

        offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < tokens
        rows = (seg_start + offs_m).to(tl.int64)  # int64: rows * stride can pass 2^31
        if HAS_ROW_IDS:
            src = tl.load(a_row_ids_ptr + rows, mask=m_mask, other=-1).to(tl.int64)
        else:
            src = rows
        # a negative row id inside a real range reads nothing and gives a zero row
        a_mask = m_mask & (src >= 0)
        offs_o = o_tile * BLOCK_O + tl.arange(0, BLOCK_O)
        o_mask = offs_o < O

        a_ptrs = a_ptr + src[:, None] * stride_am + offs_d[None, :] * stride_ad
        b_ptrs = (b_ptr + e.to(tl.int64) * stride_bl
                  + offs_d[:, None] * stride_bd + offs_o[None, :] * stride_bo)
        acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
        if B_FP8:
            # the tile's columns lie in one weight block (_launch_config), so its one column of
            # weight scales joins the row scales; the first d tile's scale product (the loop
            # carries the next one's, below)
            tl.static_assert(BLOCK_O <= GROUP_D, "fp8 weights take BLOCK_O <= 128: one weight scale per tile")
            sb_tile = b_scales_ptr + e.to(tl.int64) * stride_bsl + (o_tile * BLOCK_O // GROUP_D) * stride_bso
            s = tl.load(a_scales_ptr + src * stride_sm, mask=a_mask, other=0.0) * tl.load(sb_tile)
        for d0 in range(0, D, BLOCK_D):
            d_mask = offs_d < D - d0
            if A_TMA:  # rows in place (no row ids): padding rows load too, their outputs are not stored
                a = a_desc.load([seg_start + m_tile * BLOCK_M, d0])
            else:
                a = tl.load(a_ptrs, mask=a_mask[:, None] & d_mask[None, :], other=0.0)
            if B_FP8:
                # fp8 rows only (the launcher quantises others first). BLOCK_D == GROUP_D == 128:
                # one activation scale per row and one weight scale per 128 output columns
                # cover the whole d tile (D and O are multiples of 128)
                if B_TMA:  # K-major weights: the descriptor is over their [L, O, D] storage
                    b = tl.trans(tl.reshape(b_desc.load([e, o_tile * BLOCK_O, d0]), (BLOCK_O, BLOCK_D)))
                else:
                    b = tl.load(b_ptrs, mask=o_mask[None, :], other=0.0)
                if DOT_FP32:
                    # fp32 holds e4m3 exactly, and an e4m3 x e4m3 product too (8 significant bits)
                    part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(a, b)  # fp8 tensor cores, fp32 accumulation
                # one FMA per element (the tensor cores wait on it), with the scale product of
                # this d tile; the next tile's is loaded here and formed after the FMA (the last
                # tile loads its own again): formed from this tile's loads, ptxas put the
                # multiply, and so a wait for them, before each dot
                d_next = tl.minimum(d0 + BLOCK_D, D - BLOCK_D) // GROUP_D
                sa_next = tl.load(a_scales_ptr + src * stride_sm + d_next * stride_sd, mask=a_mask, other=0.0)
                sb_next = tl.load(sb_tile + d_next * stride_bsd)
                acc += part * s[:, None]
                s = sa_next * sb_next
            else:  # bf16 rows and weights
                if B_TMA:  # a bulk copy; what lies past D or O reads as zeros
                    b = tl.reshape(b_desc.load([e, d0, o_tile * BLOCK_O]), (BLOCK_D, BLOCK_O))
                else:
                    b = tl.load(b_ptrs, mask=d_mask[:, None] & o_mask[None, :], other=0.0)
                if DOT_FP32:
                    # the CPU interpreter multiplies bf16 as raw uint16 bits; fp32 holds bf16
                    # exactly, and "ieee" keeps TF32 out should this ever run on a GPU
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_D * stride_ad
            b_ptrs += BLOCK_D * stride_bd

        c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_o[None, :] * stride_co
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & o_mask[None, :])
        tile += num_programs


@triton.jit
def _bf16_flat_kernel(a_desc, b_desc, c_ptr, row_offsets_ptr, num_tokens_ptr, L, O, stride_cm,
                      D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr,
                      BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr = False):
    """:func:`_grouped_gemm_kernel` for bf16 rows in place and bf16 weights, both by TMA, on a
    persistent grid whose tile loop Triton fuses with the K loop (``flatten``): the next tile's
    first K steps load during this tile's epilogue instead of after it (the same products in
    the same order: the same bits)."""
    experts, tokens_L, m_tiles_L, tiles_L, tile_ends_L, total = _expert_tiles(num_tokens_ptr, L, O, BLOCK_L, BLOCK_M,
                                                                              BLOCK_O)
    for tile in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=True):
        e, m_tile, o_tile, tokens = expert_tile(tile, experts, tokens_L, m_tiles_L, tiles_L, tile_ends_L)
        row0 = tl.load(row_offsets_ptr + e) + m_tile * BLOCK_M
        acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):  # past D the bulk copies read zeros
            a = a_desc.load([row0, d0])
            b = tl.reshape(b_desc.load([e, d0, o_tile * BLOCK_O]), (BLOCK_D, BLOCK_O))
            if DOT_FP32:  # the interpreter (tests): bf16 dots as in _grouped_gemm_kernel
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        # one store for every tile (a branch to a bulk store here stops Triton fusing the loops)
        offs_m = tl.arange(0, BLOCK_M)
        offs_o = o_tile * BLOCK_O + tl.arange(0, BLOCK_O)
        rows = (row0 + offs_m).to(tl.int64)
        tl.store(c_ptr + rows[:, None] * stride_cm + offs_o[None, :], acc.to(tl.bfloat16),
                 mask=(m_tile * BLOCK_M + offs_m < tokens)[:, None] & (offs_o < O)[None, :])


@triton.jit
def _convert_rows_kernel(
    a_ptr, a_scales_ptr, a_row_ids_ptr, q_ptr, q_scales_ptr, row_offsets_ptr, num_tokens_ptr, L, N,
    stride_am, stride_ad, stride_sm, stride_sd, stride_qm, stride_qsm,
    D: tl.constexpr, HAS_ROW_IDS: tl.constexpr, BY_REGION: tl.constexpr, IN_FP8: tl.constexpr,
    NVFP4: tl.constexpr, OUT_FP8: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_D: tl.constexpr,
    GROUPS: tl.constexpr = 1,
):
    """Each real row of ``a`` decoded to fp32, stored at its own row of q: quantised to fp8
    with its scales (OUT_FP8) or as bf16. Real rows: those the expert-major rows read (through
    the row ids), or with BY_REGION the rows of L receive regions of N rows
    (``num_tokens_ptr`` their counts: region s holds rows [s N, s N + counts[s])), each once."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    groups = tl.arange(0, BLOCK_L)  # experts, or receive regions
    in_L = groups < L
    if BY_REGION:
        counts = tl.load(num_tokens_ptr + groups, mask=in_L, other=0)
        tiles_L = (counts + BLOCK_R - 1) // BLOCK_R
        tile_ends_L = tl.cumsum(tiles_L, axis=0)
        num_tiles = tl.sum(tiles_L, axis=0)
    else:
        seg_ends = tl.load(row_offsets_ptr + 1 + groups, mask=in_L, other=2147483647)
        real_ends = (tl.load(row_offsets_ptr + groups, mask=in_L, other=0)
                     + tl.load(num_tokens_ptr + groups, mask=in_L, other=0))
        total = tl.load(row_offsets_ptr + L)
        num_tiles = (total + BLOCK_R - 1) // BLOCK_R
    tile = pid
    # persistent over the row tiles (a bound that lives on the device)
    while tile < num_tiles:
        if BY_REGION:
            s, local = tile_in_group(tile, tiles_L, tile_ends_L, groups)
            i = local * BLOCK_R + tl.arange(0, BLOCK_R)
            ok = i < tl.sum(tl.where(groups == s, counts, 0), axis=0)
            src = s.to(tl.int64) * N + i
        else:
            m = tile * BLOCK_R + tl.arange(0, BLOCK_R)
            e = tl.sum((seg_ends[None, :] <= m[:, None]).to(tl.int32), axis=1)  # expert of row m
            real_end = tl.sum(tl.where(groups[None, :] == e[:, None], real_ends[None, :], 0), axis=1)
            real = (m < total) & (m < real_end)
            if HAS_ROW_IDS:
                src = tl.load(a_row_ids_ptr + m, mask=real, other=-1).to(tl.int64)
            else:
                src = m.to(tl.int64)
            ok = real & (src >= 0)
        for d0 in range(0, D, GROUP_D * GROUPS):
            # D is a multiple of 128 for fp8 rows, of 16 only for nvfp4 rows decoded to bf16
            cols = d0 + tl.arange(0, GROUP_D * GROUPS)
            cm = ok[:, None] & (cols[None, :] < D)
            if NVFP4:
                pc = d0 // 2 + tl.arange(0, GROUP_D // 2)
                packed = tl.load(a_ptr + src[:, None] * stride_am + pc[None, :] * stride_ad,
                                 mask=ok[:, None] & (pc[None, :] < D // 2), other=0)
                bc = d0 // 16 + tl.arange(0, GROUP_D // 16)
                bits = tl.load(a_scales_ptr + src[:, None] * stride_sm + bc[None, :] * stride_sd,
                               mask=ok[:, None] & (bc[None, :] < D // 16), other=0)
                x = unpack_nvfp4_tile(packed, bits, 1.0)
            else:
                x = tl.load(a_ptr + src[:, None] * stride_am + cols[None, :] * stride_ad, mask=cm,
                            other=0.0).to(tl.float32)
                if IN_FP8:
                    gs = d0 // GROUP_D + tl.arange(0, GROUPS)
                    sc = tl.load(a_scales_ptr + src[:, None] * stride_sm + gs[None, :] * stride_sd,
                                 mask=ok[:, None] & (gs[None, :] < D // GROUP_D), other=0.0)
                    x = tl.reshape(tl.reshape(x, (BLOCK_R, GROUPS, GROUP_D)) * sc[:, :, None],
                                   (BLOCK_R, GROUPS * GROUP_D))
            # a row that two local experts share is written twice, with the same bytes
            if OUT_FP8:
                q, qs = quantize_group(x, GROUPS)
                tl.store(q_ptr + src[:, None] * stride_qm + cols[None, :], q, mask=cm)
                gs = d0 // GROUP_D + tl.arange(0, GROUPS)
                tl.store(q_scales_ptr + src[:, None] * stride_qsm + gs[None, :], qs,
                         mask=ok[:, None] & (gs[None, :] < D // GROUP_D))
            else:
                tl.store(q_ptr + src[:, None] * stride_qm + cols[None, :], x.to(tl.bfloat16), mask=cm)
        tile += num_programs


def quantize_rows_fp8(*, a: torch.Tensor, a_scales: torch.Tensor | None, row_offsets_L1: torch.Tensor,
                      num_tokens_L: torch.Tensor, a_row_ids: torch.Tensor | None = None,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      a_regions: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The real rows of a grouped GEMM's ``a`` (bf16, or nvfp4 with its ``a_scales``) quantised to
    fp8 e4m3 with one fp32 scale per 128 channels, as :func:`ray_ep.fp8.quantize_fp8_torch`
    would (nvfp4 rows decoded first, exactly); no host sync.

    Real rows: ``a[a_row_ids[m]]`` (or ``a[m]``) for the expert-major rows m that hold a token;
    each lands at its own row of ``out = (q [rows of a, D] float8_e4m3fn, scales [rows of a,
    D / 128] fp32)`` (new tensors when None; rows that no real row reads stay as they were).
    The grouped GEMM then reads ``q`` through the same ``a_row_ids``. ``a_regions``: see
    :func:`grouped_gemm` (each receive row once, however many local experts read it).

    Example (a bf16 [4, 128], rows 0 and 2 real)::

        q, s = quantize_rows_fp8(a=a, a_scales=None, row_offsets_L1=offs, num_tokens_L=counts)
        # q[0], s[0] == quantize_fp8_torch(a[0:1]); q[1] untouched
    """
    nvfp4 = a.dtype == torch.uint8
    D = 2 * a.shape[1] if nvfp4 else a.shape[1]
    rows = a.shape[0]
    if out is None:
        out = (torch.empty(rows, D, dtype=torch.float8_e4m3fn, device=a.device),
               torch.empty(rows, D // FP8_GROUP, dtype=torch.float32, device=a.device))
    q, qs = out
    check_tensor("out[0]", q, shape=(rows, D), dtypes=(torch.float8_e4m3fn,), device=a.device)
    check_tensor("out[1]", qs, shape=(rows, D // FP8_GROUP), dtypes=(torch.float32,), device=a.device)
    if q.stride(1) != 1 or qs.stride(1) != 1:
        raise EPInputError("quantize_rows_fp8: out[0] and out[1] need contiguous rows (stride 1 along their "
                           "last dim)")
    _convert_rows(a, a_scales, row_offsets_L1, num_tokens_L, a_row_ids, a_regions, q, qs)
    return q, qs


def decode_rows_bf16(*, a: torch.Tensor, a_scales: torch.Tensor, row_offsets_L1: torch.Tensor,
                     num_tokens_L: torch.Tensor, a_row_ids: torch.Tensor | None = None,
                     out: torch.Tensor | None = None,
                     a_regions: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """The real rows of a grouped GEMM's fp8 or nvfp4 ``a`` (with its ``a_scales``) decoded to
    bf16 (``bf16(fp8 * scale)``, ``bf16(e2m1(code) * scale)``), each at its own row of ``out``
    [rows of a, D] bf16 (a new tensor when None; rows that no real row reads stay as they were);
    no host sync. Only the real rows: a receive buffer holds capacity for far more rows than a
    decode step fills. The bf16 grouped GEMM then reads ``out`` through the same ``a_row_ids``.
    ``a_regions``: see :func:`grouped_gemm`."""
    D = 2 * a.shape[1] if a.dtype == torch.uint8 else a.shape[1]
    if out is None:
        out = torch.empty(a.shape[0], D, dtype=torch.bfloat16, device=a.device)
    check_tensor("out", out, shape=(a.shape[0], D), dtypes=(torch.bfloat16,), device=a.device, inner_contiguous=True)
    _convert_rows(a, a_scales, row_offsets_L1, num_tokens_L, a_row_ids, a_regions, out, None)
    return out


def _check_regions(a_regions, rows: int, device: torch.device) -> None:
    counts, n = a_regions
    check_tensor("a_regions[0]", counts, dims=1, dtypes=(torch.int32,), device=device)
    if not isinstance(n, int) or n < 0 or counts.shape[0] * n > rows:
        raise EPInputError(f"a_regions = (counts [R], n): R = {counts.shape[0]} regions of n = {n!r} rows must fit "
                           f"in the {rows} rows of a (n a non-negative int)")


def _convert_rows(a, a_scales, row_offsets_L1, num_tokens_L, a_row_ids, a_regions, q, qs) -> None:
    """Launch :func:`_convert_rows_kernel`: into fp8 rows ``q`` and scales ``qs``, or into bf16
    rows ``q`` when ``qs`` is None; over the expert-major rows, or the receive regions."""
    nvfp4 = a.dtype == torch.uint8
    rows = a.shape[0]
    if a_regions is not None:
        _check_regions(a_regions, rows, a.device)
        num_tokens_L, region_rows = a_regions[0], a_regions[1]
        M = num_tokens_L.shape[0] * region_rows
    else:
        M, region_rows = (a_row_ids.shape[0] if a_row_ids is not None else rows), 0
    L = num_tokens_L.shape[0]
    if M == 0 or rows == 0:
        return
    sms = sm_count(a.device)
    # a program walks its rows' 128-channel groups one after another (load, amax, store), so
    # what hides the loads' latency is programs in flight: at least 4 per SM where the rows
    # allow (one H200, a shared expert's 4096 x 7168 bf16 rows: 1024 steps of 4 rows, 65.0 ->
    # 52.5 us against 128 of 32; a receive of 4 x 4096 rows: steps of 16, 111.3 -> 103.9 us)
    # bf16 / fp8 rows: steps of STEP_GROUPS groups (4 rows x 1024 channels where 32 x 128 were:
    # the same 4096 elements, in 16-byte loads; one H200, the fp8 shared expert over 4096
    # tokens: 410 -> 390 us with its quantisation, docs/perf.md v40)
    groups = 1 if nvfp4 else STEP_GROUPS
    block_r = max(1, 32 // groups)
    while block_r > max(1, 4 // groups) and cdiv(M, block_r) < 4 * sms:
        block_r //= 2
    tiles = cdiv(M, block_r)
    grid = (max(1, min(tiles, 8 * sms)),)
    scales = a_scales.view(torch.uint8) if nvfp4 else a_scales if a_scales is not None else a  # a: a dummy pointer
    q_scales = qs if qs is not None else q  # dummy pointer for bf16 rows
    _convert_rows_kernel[grid](
        a_ptr=a, a_scales_ptr=scales, a_row_ids_ptr=a_row_ids.contiguous() if a_row_ids is not None else num_tokens_L,
        q_ptr=q, q_scales_ptr=q_scales, row_offsets_ptr=row_offsets_L1.contiguous(),
        num_tokens_ptr=num_tokens_L.contiguous(), L=L, N=region_rows, stride_am=a.stride(0), stride_ad=a.stride(1),
        stride_sm=scales.stride(0), stride_sd=scales.stride(1), stride_qm=q.stride(0), stride_qsm=q_scales.stride(0),
        D=2 * a.shape[1] if nvfp4 else a.shape[1], HAS_ROW_IDS=a_row_ids is not None, BY_REGION=a_regions is not None,
        IN_FP8=a.dtype == torch.float8_e4m3fn, NVFP4=nvfp4, OUT_FP8=qs is not None,
        BLOCK_L=max(2, next_power_of_2(L)), BLOCK_R=block_r, GROUP_D=FP8_GROUP, num_warps=4,
        GROUPS=groups,
    )


def _launch_config(device: torch.device, b_fp8: bool = False, rows_per_expert: int = 1 << 30,
                   depth: int = 1 << 30) -> dict[str, int]:
    """Tile shape: a Hopper-sized one on GPUs; small tiles for the interpreter, where every
    program runs in Python and tests want several tiles per expert. ``rows_per_expert``: the
    capacity rows per local expert (M_max / L), known on the host (the real counts are not);
    ``depth``: D, the reduction size.

    Measured on one H200 (triton 3.6, 64 experts x ~512 rows, deepseek-v3 shapes, bf16):
    128x256x64 with 4 stages (196 KB of shared memory, fits H100/H200) ran gate_up (D 7168,
    O 4096) at 634 TFLOP/s and down (D 2048, O 7168) at 607, against 520/516 with 3 stages,
    444/416 for 128x128 tiles and 573/553 for torch._grouped_mm. Decode (16 rows per expert)
    is weight-bandwidth bound: 4.5 / 3.8 TB/s of weights, within 2% for BLOCK_M 64 or 128.
    BLOCK_D must divide 128 (one fp8 scale per d tile) and be a multiple of 32 (whole nvfp4
    blocks, whole packed bytes).

    fp8 weights (fp8 rows): BLOCK_D is the 128 of a scale block and BLOCK_O 128: the per-block
    partial product is a second fp32 tile beside the accumulator. Same sweep: 128x128x128 at
    8 warps and 4 stages ran 603 / 527 TFLOP/s (128 x 256 tiles or 4 warps spill: 140-220);
    decode shapes ran 891 -> 557 us (gate_up) and 461 -> 304 us (down) with 64-row tiles at
    4 warps, 3.4 / 3.1 TB/s of fp8 weights (torch._scaled_grouped_mm: 676 / 373 us). Folding
    the tile's one weight scale into the row scales (one FMA per element after each K block's
    dot instead of a multiply and an FMA) then took prefill gate_up / down from 3283 / 1832 us
    (591 / 527 TFLOP/s) to 2733 / 1566 us (710 / 616), decode from 805 / 476 to 703 / 419 us
    (one H200, same run; torch._scaled_grouped_mm 2141 / 1212 and 706 / 386 us).

    Weight tiles arrive by bulk copies (TMA descriptors) where the layout allows:
    same run, one H200, pointer loads -> TMA: bf16 prefill gate_up 3167 -> 2805 us (rows read
    through row ids: 3175 -> 3055), down 1614 -> 1542; fp8 gate_up 2691 -> 2666 (2727 -> 2656
    with row ids), down 1544 -> 1513; decode within 1-6% faster (fp8 down 389 -> 367). Rows in
    place (no row ids: the down GEMM) arrive by bulk copies too; another run, B by TMA -> A and B:
    fp8 gate_up 2656 -> 2557 us, down 1530 -> 1461, bf16 gate_up 2941 -> 2876, down 1547 -> 1543
    (that run's repeats of identical kernels spread up to 10%: the gains are within it for bf16).

    Decode with fp8 weights (64 experts x ~16 rows, capacity 64 per expert, one H200, 15 tiles
    swept): gate_up (D 7168) ran 477 us (3.94 TB/s of weights) at 64 x 128 and 4 stages, no tile
    faster (32 x 256: 476; 3 stages 491; 5 stages 610: one program per SM then); down (D 2048,
    16 K steps per tile) 251 us at 4 stages, 241 at 3 (three programs fit an SM: a program's
    start and end, frequent at short K, leave fewer gaps in the weight stream).

    bf16 weights on prefill shapes (more than 64 capacity rows per expert) run a persistent
    grid, one program per SM (:func:`grouped_gemm`'s default): one H200, deepseek-v3 prefill
    on 4 ranks' rows (64 experts x ~512 rows), against a program per tile in the same run:
    gate_up 2766 -> 2733 us, down 1581 -> 1476 (609 -> 653 TFLOP/s), the same bits; on one
    rank's rows (256 experts x ~128) both GEMMs 6634 -> 6613. Decode (4 ranks x 128 tokens)
    lost 1% with it (down 447 -> 453 us), so it keeps a program per tile. Other tiles lost on
    4 ranks' rows: 256 x 128 3829 / 1765 us, 3 stages 2774 / 1587, BLOCK_D 32 with 6 stages
    2819 / 1604. So did the SwiGLU in the gate_up GEMM's epilogue (two 128-column halves, gate
    and up): 3017 us against 2868 + the SwiGLU kernel's ~96 on 4 ranks' rows, and the experts
    6% slower on one rank's (docs/perf.md v38)."""
    if device.type != "cuda":
        return dict(BLOCK_M=32, BLOCK_O=64, BLOCK_D=128 if b_fp8 else 64, num_warps=4, num_stages=1)
    if b_fp8:
        if not prefill_rows(rows_per_expert):
            stages = 3 if depth <= 16 * FP8_GROUP else 4
            return dict(BLOCK_M=64, BLOCK_O=128, BLOCK_D=FP8_GROUP, num_warps=4, num_stages=stages)
        return dict(BLOCK_M=128, BLOCK_O=128, BLOCK_D=FP8_GROUP, num_warps=8, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_O=256, BLOCK_D=64, num_warps=8, num_stages=4)


# stages of the flattened bf16 kernel (one H200, the down GEMM over 4 ranks' rows: 1527 us with
# 3, 1550 with 4, 1559 for the tile-by-tile loop, docs/perf.md v39; v40: 1506-1512 against 1540)
FLAT_STAGES = 3


def _flat_bf16(a: torch.Tensor, a_desc, b_fp8: bool, programs: int, worst_tiles: int, out: torch.Tensor) -> bool:
    """Whether a launch takes :func:`_bf16_flat_kernel`: persistent (fewer ``programs`` than
    tiles), bf16 rows in place (a TMA descriptor), bf16 weights, output columns contiguous, on
    a GPU. Rows gathered through row ids keep the tile loop (flattened, pointer-loaded rows
    ran 8% slower: the gate_up GEMM, docs/perf.md v39)."""
    return (programs < worst_tiles and not b_fp8 and a_desc is not None and a.dtype == torch.bfloat16
            and out.stride(1) == 1 and a.device.type == "cuda" and not interpreted())


def _check_grouped_gemm(a, b_LDO, row_offsets_L1, num_tokens_L, a_row_ids, a_scales, out,
                        num_sms, b_scales=None) -> tuple[int, int, int, int]:
    """Validate the arguments of :func:`grouped_gemm` / its twin; returns (M_max, D, O, L)."""
    check_tensor("a", a, dims=2, dtypes=A_DTYPES)
    dev = a.device
    nvfp4 = a.dtype == torch.uint8
    D = 2 * a.shape[1] if nvfp4 else a.shape[1]
    check_tensor("b_LDO", b_LDO, dims=3, dtypes=B_DTYPES, device=dev)
    L, Db, O = b_LDO.shape
    if Db != D:
        raise EPInputError(f"b_LDO is [L, D, O] with D = {Db}, but a has D = {D} columns; "
                           f"they must match")
    if L == 0:
        raise EPInputError("b_LDO must hold at least one expert (L >= 1)")
    if b_LDO.dtype == torch.float8_e4m3fn:
        if D % FP8_GROUP or O % FP8_GROUP:
            raise EPInputError(f"fp8 b_LDO needs D and O multiples of {FP8_GROUP} (one scale per "
                               f"{FP8_GROUP} x {FP8_GROUP} block), got D = {D}, O = {O}")
        if b_scales is None:
            raise EPInputError("fp8 b_LDO needs b_scales [L, D / 128, O / 128] fp32")
        check_tensor("b_scales", b_scales, shape=(L, D // FP8_GROUP, O // FP8_GROUP), dtypes=(torch.float32,),
                     device=dev)
    elif b_scales is not None:
        raise EPInputError("b_scales is only for fp8 b_LDO; b_LDO is bfloat16")
    check_tensor("row_offsets_L1", row_offsets_L1, shape=(L + 1,), dtypes=(torch.int32,), device=dev)
    check_tensor("num_tokens_L", num_tokens_L, shape=(L,), dtypes=(torch.int32,), device=dev)
    if a_row_ids is not None:
        check_tensor("a_row_ids", a_row_ids, dims=1, dtypes=(torch.int32,), device=dev)
        M = a_row_ids.shape[0]
    else:
        M = a.shape[0]
    if out is not None:
        check_tensor("out", out, shape=(M, O), dtypes=(torch.bfloat16,), device=dev)
    if a.dtype == torch.float8_e4m3fn:
        if D % FP8_GROUP:
            raise EPInputError(f"fp8 a needs D % {FP8_GROUP} == 0 (one scale per {FP8_GROUP} "
                               f"columns), got D = {D}")
        if a_scales is None:
            raise EPInputError("fp8 a needs a_scales [rows of a, D / 128] fp32")
        check_tensor("a_scales", a_scales, shape=(a.shape[0], D // FP8_GROUP),
                     dtypes=(torch.float32,), device=dev)
    elif nvfp4:
        if D % NVFP4_BLOCK:
            raise EPInputError(f"nvfp4 a [rows, D / 2] needs D % {NVFP4_BLOCK} == 0 (one scale per "
                               f"{NVFP4_BLOCK} columns), got D = {D}")
        if a_scales is None:
            raise EPInputError("nvfp4 a (uint8, two codes per byte) needs a_scales [rows of a, D / 16] float8_e4m3fn")
        check_tensor("a_scales", a_scales, shape=(a.shape[0], D // NVFP4_BLOCK), dtypes=(torch.float8_e4m3fn,),
                     device=dev)
    elif a_scales is not None:
        raise EPInputError(f"a_scales is only for fp8 and nvfp4 a; a is {str(a.dtype).replace('torch.', '')}")
    if num_sms is not None and (not isinstance(num_sms, int) or num_sms <= 0):
        raise EPInputError(f"num_sms must be a positive int or None, got {num_sms!r}")
    return M, D, O, L


def grouped_gemm(*, a: torch.Tensor, b_LDO: torch.Tensor, row_offsets_L1: torch.Tensor,
                 num_tokens_L: torch.Tensor, a_row_ids: torch.Tensor | None = None,
                 a_scales: torch.Tensor | None = None, b_scales: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, num_sms: int | None = None,
                 fp8_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                 a_regions: tuple[torch.Tensor, int] | None = None,
                 swiglu_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Per-expert ``c = A @ b[e]`` over expert-major rows, without a host sync.

    Args:
        a: [rows, D] bf16 or float8_e4m3fn, or [rows, D / 2] uint8 (nvfp4: two e2m1 codes per
            byte); any strides. Without ``a_row_ids``, rows = M_max and output row m reads ``a[m]``.
        b_LDO: [L, D, O] bf16 or float8_e4m3fn expert weights (D the reduction dim); any
            strides (bf16: row-major [D, O] per expert is fastest; fp8: D contiguous, the
            K-major layout of a checkpoint's [out, in] rows, which fp8 tensor cores read).
        row_offsets_L1: [L + 1] int32 on the device, start of each expert's segment.
        num_tokens_L: [L] int32 on the device, real rows per expert
            (``num_tokens[e] <= row_offsets[e+1] - row_offsets[e]``, not checked: no sync).
        a_row_ids: optional [M_max] int32: output row m reads ``a[a_row_ids[m]]`` (a gather,
            e.g. from a receive buffer); only real rows are read.
        a_scales: [rows, D / 128] fp32, required iff ``a`` is fp8 (``A = bf16(a * scale)``);
            [rows, D / 16] float8_e4m3fn, required iff ``a`` is nvfp4 (any strides). With fp8
            ``b_LDO`` an fp8 ``a`` is not dequantised: its scales multiply the fp8 products.
        b_scales: [L, D / 128, O / 128] fp32, required iff ``b_LDO`` is fp8: the scale of each
            128 x 128 block (``weight = b * scale``); D and O multiples of 128.
        out: optional [M_max, O] bf16 (any strides); padding rows keep their contents. When
            None, a ``torch.empty`` tensor is returned whose padding rows are undefined.
        num_sms: an int launches a persistent grid of that many programs looping over the
            tiles; None one program per SM for bf16 weights on a GPU with more than 64 capacity
            rows per expert (prefill), else one per worst-case tile (most exit at once).
        fp8_rows: with fp8 ``b_LDO`` and a bf16 or nvfp4 ``a``: where :func:`quantize_rows_fp8`
            puts the rows quantised to fp8 first (``(q [rows of a, D], scales [rows of a,
            D / 128])``, e.g. a scratch held for CUDA graphs); None: new tensors.
        a_regions: ``(counts_R [R] int32 on the device, n)`` when ``a`` is a receive buffer of
            R regions of n rows whose region s holds rows ``[s n, s n + counts_R[s])`` (each read
            by at least one expert-major row): the pass that quantises (or decodes) rows for
            the other tensor-core dtype then converts each of them once, not once per local
            expert that reads it (deepseek-v3 on 2 ranks: ~4 expert rows per receive row).
        swiglu_out: ``(q [M_max, O / 2] float8_e4m3fn, scales [M_max, O / 256] fp32)`` (any
            strides), only where :func:`fuses_swiglu` is true (fp8 weights on a Hopper GPU,
            prefill shapes): the product's O = 2F columns are ``[gate | up]``, and instead of
            ``c`` each real row's ``silu(gate) * up`` quantised per 128 channels is written
            here, the bits :func:`ray_ep.kernels.activation.swiglu` gives from ``c`` (``out``
            is then not written; padding rows keep their contents).

    Returns:
        c [M_max, O] bf16 (``swiglu_out[0]`` with ``swiglu_out``).

    D is a compile-time constant of the kernel: each weight shape compiles once.

    Example::

        h = grouped_gemm(a=recv_x, b_LDO=w_gate_up, row_offsets_L1=offs, num_tokens_L=counts,
                         a_row_ids=row_ids)       # [M_max, 2F]
    """
    M, D, O, L = _check_grouped_gemm(a, b_LDO, row_offsets_L1, num_tokens_L, a_row_ids, a_scales,
                                     out, num_sms, b_scales)
    dev = a.device
    if dev.type != "cuda" and not interpreted():
        raise EPInputError(f"grouped_gemm runs Triton on CUDA tensors (or on CPU with "
                           f"TRITON_INTERPRET=1), got tensors on {dev}; use grouped_gemm_torch")
    if out is None:
        out = torch.empty(M, O, dtype=torch.bfloat16, device=dev)
    if swiglu_out is not None:
        _check_swiglu_out(swiglu_out, a, b_LDO, M)
    if M == 0 or O == 0:
        return out if swiglu_out is None else swiglu_out[0]
    b_fp8 = b_LDO.dtype == torch.float8_e4m3fn
    if b_fp8 and a.dtype != torch.float8_e4m3fn:  # fp8 tensor cores take fp8 rows: quantise once
        a, a_scales = quantize_rows_fp8(a=a, a_scales=a_scales, row_offsets_L1=row_offsets_L1,
                                        num_tokens_L=num_tokens_L, a_row_ids=a_row_ids, out=fp8_rows,
                                        a_regions=a_regions)
    elif not b_fp8 and a.dtype != torch.bfloat16:  # bf16 tensor cores take bf16 rows: decode once
        a, a_scales = decode_rows_bf16(a=a, a_scales=a_scales, row_offsets_L1=row_offsets_L1,
                                       num_tokens_L=num_tokens_L, a_row_ids=a_row_ids, a_regions=a_regions), None
    hopper = b_fp8 and sm90.usable(a=a, b_LDO=b_LDO, rows_per_expert=M // L)  # prefill shapes
    if swiglu_out is not None and not hopper:
        # fuses_swiglu said yes, but the rows converted for the fp8 tensor cores (fp8_rows) are not
        # ones TMA can address: the Triton kernel would not write swiglu_out
        raise EPInputError("swiglu_out: fp8_rows must be contiguous rows 16-byte aligned for the Hopper kernel")
    if hopper:
        return sm90.grouped_gemm_fp8_sm90(
            a=a, a_scales=a_scales, a_row_ids=a_row_ids, b_LDO=b_LDO, b_scales=b_scales, row_offsets_L1=row_offsets_L1,
            num_tokens_L=num_tokens_L, out=out if swiglu_out is None else swiglu_out[0], num_sms=num_sms,
            swiglu_scales=None if swiglu_out is None else swiglu_out[1])
    cfg = _launch_config(dev, b_fp8=b_fp8, rows_per_expert=M // L, depth=D)
    bm, bo = cfg["BLOCK_M"], cfg["BLOCK_O"]
    # sum_e ceil(n_e / BM) <= (sum_e n_e + L (BM - 1)) / BM, and every tile holds >= 1 row
    worst_m_tiles = min(M, (M + L * (bm - 1)) // bm)
    worst_tiles = worst_m_tiles * cdiv(O, bo)
    if num_sms is None and not b_fp8 and dev.type == "cuda" and prefill_rows(M // L):
        num_sms = sm_count(dev)  # bf16 weights on prefill shapes: persistent (see _launch_config)
    grid = (max(1, worst_tiles if num_sms is None else min(num_sms, worst_tiles)),)
    # 1-D index vectors are tiny: contiguous copies (on the device, no sync) keep the kernel simple
    row_offsets_L1 = row_offsets_L1.contiguous()
    num_tokens_L = num_tokens_L.contiguous()
    row_ids = a_row_ids.contiguous() if a_row_ids is not None else num_tokens_L  # dummy when unused
    scales = a_scales if b_fp8 else a  # dummy pointer when unused
    bs = b_scales if b_fp8 else b_LDO  # dummy pointer when unused
    b_desc = _weight_descriptor(b_LDO, cfg)
    # rows in place (no gather) arrive by bulk copies too; fp8 and bf16 rows only
    a_desc = (_descriptor(a, [cfg["BLOCK_M"], cfg["BLOCK_D"]])
              if b_desc is not None and a_row_ids is None and a.dtype != torch.uint8 else None)
    if _flat_bf16(a, a_desc, b_fp8, grid[0], worst_tiles, out):
        _bf16_flat_kernel[grid](
            a_desc=a_desc, b_desc=b_desc, c_ptr=out, row_offsets_ptr=row_offsets_L1, num_tokens_ptr=num_tokens_L,
            L=L, O=O, stride_cm=out.stride(0), D=D, BLOCK_L=max(2, next_power_of_2(L)),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_O=cfg["BLOCK_O"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"],
            num_stages=FLAT_STAGES)
        return out
    _grouped_gemm_kernel[grid](
        a_ptr=a, a_desc=a_desc, a_scales_ptr=scales, a_row_ids_ptr=row_ids, b_ptr=b_LDO, b_desc=b_desc,
        b_scales_ptr=bs, c_ptr=out,
        row_offsets_ptr=row_offsets_L1, num_tokens_ptr=num_tokens_L, L=L, O=O, stride_am=a.stride(0),
        stride_ad=a.stride(1), stride_sm=scales.stride(0), stride_sd=scales.stride(1), stride_bl=b_LDO.stride(0),
        stride_bd=b_LDO.stride(1), stride_bo=b_LDO.stride(2), stride_bsl=bs.stride(0), stride_bsd=bs.stride(1),
        stride_bso=bs.stride(2), stride_cm=out.stride(0), stride_co=out.stride(1),
        D=D, HAS_ROW_IDS=a_row_ids is not None, B_FP8=b_fp8, GROUP_D=FP8_GROUP,
        DOT_FP32=dev.type != "cuda", BLOCK_L=max(2, next_power_of_2(L)), A_TMA=a_desc is not None,
        B_TMA=b_desc is not None, **cfg,
    )
    return out


def fuses_swiglu(*, a: torch.Tensor, b_LDO: torch.Tensor, rows_per_expert: int) -> bool:
    """Whether :func:`grouped_gemm` takes ``swiglu_out`` for these rows and weights: fp8
    weights that the Hopper kernel (:mod:`ray_ep.kernels.grouped_gemm_sm90`) runs, on prefill
    shapes (``rows_per_expert``: the capacity rows per local expert). Rows in another dtype
    than fp8 are quantised first into rows it can read."""
    if a.dtype == torch.float8_e4m3fn and not tma_addressable(a):
        return False
    return sm90.weights_usable(b_LDO, rows_per_expert)


def _check_swiglu_out(swiglu_out, a: torch.Tensor, b_LDO: torch.Tensor, M: int) -> None:
    L, _, O = b_LDO.shape
    if not fuses_swiglu(a=a, b_LDO=b_LDO, rows_per_expert=M // L):
        raise EPInputError("swiglu_out: the SwiGLU runs inside the GEMM only for fp8 weights on a Hopper GPU with "
                           "more than 64 capacity rows per expert and tiles for over half of the SMs (fuses_swiglu); "
                           "elsewhere give out and run ray_ep.kernels.activation.swiglu on it")
    q, s = swiglu_out
    check_tensor("swiglu_out[0]", q, shape=(M, O // 2), dtypes=(torch.float8_e4m3fn,), device=a.device)
    check_tensor("swiglu_out[1]", s, shape=(M, O // 2 // FP8_GROUP), dtypes=(torch.float32,), device=a.device)


def _weight_descriptor(b_LDO: torch.Tensor, cfg: dict) -> TensorDescriptor | None:
    """A bulk-copy (TMA) descriptor of the weights' tiles, or None where the layout has none
    (pointer loads then): bf16 [L, D, O] with O contiguous, fp8 over the [L, O, D] storage of
    K-major weights; rows 16-byte aligned."""
    fp8 = b_LDO.dtype == torch.float8_e4m3fn
    w = b_LDO.transpose(1, 2) if fp8 else b_LDO
    return _descriptor(w, [1, cfg["BLOCK_O"], cfg["BLOCK_D"]] if fp8 else [1, cfg["BLOCK_D"], cfg["BLOCK_O"]])


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor | None:
    """A TMA descriptor of ``t``'s ``block`` tiles, or None where TMA cannot address them (last
    dim not contiguous, base or row strides not 16-byte aligned, a tile row under 16 bytes)."""
    if not tma_addressable(t) or block[-1] * t.element_size() < 16:
        return None
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def grouped_gemm_torch(*, a: torch.Tensor, b_LDO: torch.Tensor, row_offsets_L1: torch.Tensor,
                       num_tokens_L: torch.Tensor, a_row_ids: torch.Tensor | None = None,
                       a_scales: torch.Tensor | None = None, b_scales: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, num_sms: int | None = None,
                       fp8_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                       a_regions: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """Torch twin of :func:`grouped_gemm` (same arguments, any device; reads the counts on
    the host; padding rows of a new output are zero; ``num_sms``, ``fp8_rows`` and
    ``a_regions`` are ignored: it converts bf16 / fp8 / nvfp4 rows on the fly)."""
    M, D, O, L = _check_grouped_gemm(a, b_LDO, row_offsets_L1, num_tokens_L, a_row_ids, a_scales,
                                     out, num_sms, b_scales)
    if out is None:
        out = torch.zeros(M, O, dtype=torch.bfloat16, device=a.device)
    offsets, counts = row_offsets_L1.tolist(), num_tokens_L.tolist()
    for e in range(L):
        lo, n = offsets[e], counts[e]
        if n <= 0:
            continue
        rows = torch.arange(lo, lo + n, device=a.device)
        src = a_row_ids[lo:lo + n].long() if a_row_ids is not None else rows
        valid = src >= 0
        if b_LDO.dtype == torch.float8_e4m3fn:
            out[lo:lo + n] = _fp8_expert_torch(a, a_scales, src, b_LDO[e], b_scales[e]).to(torch.bfloat16)
            continue
        if a.dtype == torch.uint8:
            x = dequantize_nvfp4_torch(a[src.clamp(min=0)], a_scales[src.clamp(min=0)]).float()
        else:
            x = a[src.clamp(min=0)].float()
        if a.dtype == torch.float8_e4m3fn:
            g = x.reshape(n, D // FP8_GROUP, FP8_GROUP) * a_scales[src.clamp(min=0)][..., None]
            x = g.reshape(n, D).to(torch.bfloat16).float()
        x = torch.where(valid[:, None], x, 0.0)
        out[lo:lo + n] = (x @ b_LDO[e].float()).to(torch.bfloat16)
    return out


def _fp8_expert_torch(a: torch.Tensor, a_scales: torch.Tensor | None, src: torch.Tensor, b_DO: torch.Tensor,
                      b_scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``A @ b`` of one expert with fp8 weights, K block by K block as the kernel sums:
    ``acc += (qa @ qb) * (sa * sb)``. Rows with ``src < 0`` give zeros."""
    n, (D, O) = src.shape[0], b_DO.shape
    valid = src >= 0
    rows = src.clamp(min=0)
    if a.dtype == torch.float8_e4m3fn:
        qa, sa = a[rows].float(), a_scales[rows]
    else:
        x = dequantize_nvfp4_torch(a[rows], a_scales[rows]) if a.dtype == torch.uint8 else a[rows]
        q, sa = quantize_fp8_torch(x.to(torch.bfloat16))
        qa = q.float()
    qa = torch.where(valid[:, None], qa, 0.0)
    qb = b_DO.float()
    sb = b_scales.float().repeat_interleave(FP8_GROUP, dim=1)  # [D / 128, O]
    acc = torch.zeros(n, O, dtype=torch.float32, device=a.device)
    for g in range(D // FP8_GROUP):
        k = slice(g * FP8_GROUP, (g + 1) * FP8_GROUP)
        acc += (qa[:, k] @ qb[k]) * (sa[:, g:g + 1] * sb[g][None, :])
    return acc
