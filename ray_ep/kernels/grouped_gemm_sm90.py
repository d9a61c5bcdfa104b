"""The grouped GEMM with fp8 weights on Hopper (sm_90), written in Gluon (Triton's lower-level
language, shipped with Triton 3.6): warp-specialised, so the tensor cores stop waiting while each
K block's partial product is scaled.

Same contract as :func:`ray_ep.kernels.grouped_gemm.grouped_gemm` with fp8 rows and fp8 weights
(``b`` [L, D, O] with 128 x 128 block scales), for the prefill shapes; its torch twin is
:func:`ray_ep.kernels.grouped_gemm.grouped_gemm_torch`. Per output row m of expert e::

    c[m] = bf16(sum_k dot(qa[m, k block], qb[k block, :]) * (sa[m, k] * sb[k, o block]))

summed in the same order as the Triton kernel (the same bits).

Why a kernel of its own: the Triton kernel multiplies a K block, waits for the tensor cores,
then scales the partial product into the accumulator, with all 8 warps in step (a barrier per K
block), so the tensor cores idle during every scaling. Here (per persistent program, one per SM):

- the tiles (expert-major; inside an expert m fastest, so the programs that share a weight slice
  run side by side) are taken in order from a counter of the launch: a program's producer takes
  its next tile by an atomic add and hands it to its consumers through shared memory. So the
  tiles in flight stay a window of consecutive ones whatever each took, and the programs that
  read a weight slice read it at about the same time, from L2. (A static round robin let
  programs drift apart by what their tiles took: the same kernel's L2 hit rate ranged over
  40-70% with the timing of its epilogues, ncu on one H200, and its time by up to 20%.);
- one producer partition fills a ring of ``STAGES`` shared-memory stages: the weight tile by
  bulk copies (TMA), the 128 rows by TMA when they lie in place, or gathered through the row
  ids with per-thread async copies (4 warps: Hopper's TMA has no gather);
- two consumer warpgroups own rows 0-63 and 64-127 of a 128 x 256 tile. Each multiplies a K
  block in two halves of 128 columns (one weight scale each), waits for its own wgmma, scales
  the half into its accumulator, and frees the stage with an mbarrier arrive. Nothing else
  synchronises them, so one warpgroup's scaling runs while the other's wgmma does;
- a warpgroup whose 64 rows are all real writes them to shared memory and leaves them to TMA
  bulk stores it does not wait for (only before it reuses that buffer, a tile later), so its
  next tile's K loop runs while they write; rows at an expert's end keep masked stores;
- for the gate_up GEMM the SwiGLU can run in the epilogue (``swiglu_scales``): a tile's two
  halves are then 128 gate columns and the same 128 up columns, and the warpgroup stores
  ``silu(gate) * up`` in fp8 with one scale per row and 128 channels, the bits of the bf16
  output followed by :func:`ray_ep.kernels.activation.swiglu` (one H200, gathered rows:
  gate_up + SwiGLU 2291 -> 2284 us at 64 experts x 512 rows, 2774 -> 2620 at 128 x 256);
- a tile with at most 64 real rows (an expert's last, for about half of the experts) is a half
  tile: both warpgroups take its 64 rows, each with one of the two 128-column halves, so it
  takes about half the time of a full tile whose other 64 rows are padding;
- each K block's scales (a per-row activation scale, two weight scales) are loaded a block
  ahead and the loop carries their products, formed at the end of the block before: carrying
  the loaded values themselves, ptxas copied each newly loaded one into the old one's register
  right after the load, and every K block's first wgmma waited for that L2 round trip (ncu on
  one H200: the consumers' largest stall besides the wgmma waits; ``tests/sm90_compile.py``
  now counts such reads, ``early_load_uses``).

With both (one H200, deepseek-v3's experts on 4 / 2 / 8 ranks, routed rows; docs/perf.md v32):
gate_up + SwiGLU 2442 -> 2063 / 2494 -> 2343 / 1893 -> 1957 us, down 1072 -> 981 / 1323 -> 1114 /
927 -> 906 us, the same bits. With the scale products (v33, one H200, 4 ranks' routed rows):
down 995 -> 925 us, the unfused gate_up 2103 -> 1853; the fused gate_up + SwiGLU within +-3%,
its K loop had no such wait.

One H200, 64 experts x ~512 fp8 rows in place (deepseek-v3 on 4 ranks), against the Triton
kernel in the same run: gate_up (D 7168, O 4096) 2389 -> 1946 us (775 -> 951 TFLOP/s), down
(D 2048, O 7168) 1414 -> 1123 us (655 -> 824). A 128 x 128 tile with the same two warpgroups ran
2374 / 1336 us. What bounds this one is the consumers' own work, not its loads (docs/perf.md
v29: without either operand's loads it ran 3-11% faster, without its epilogue stores 15-33%).
Hence the bulk stores (v30, same bits): down 1220 -> 1112 us at 64 x 512 rows, 1529 -> 1303 at
128 x 256; gate_up within its run-to-run noise (~5%), its 56 K blocks dwarf one epilogue.

Gluon kernels do not run in Triton's CPU interpreter: elsewhere the Triton kernel (or its twin)
runs. :func:`usable` says when this one applies.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..config import FP8_GROUP, FP8_MAX
from ._util import (cdiv, expert_tile, fast_sigmoid, next_power_of_2, num_sms as sm_count, prefill_rows, sm_major,
                    tma_addressable)

_tile = gluon.jit(expert_tile.fn)  # the Triton kernels' tile order, compiled as Gluon
_sigmoid = gluon.jit(fast_sigmoid.fn)  # the SwiGLU kernel's sigmoid: the same bits

STAGES = 4  # 4 x 48 KB of shared memory (3 ran within 1%)
# stages when the output leaves by bulk copies: 3 x 48 KB, plus 2 x 32 KB for the consumers' halves
TMA_STORE_STAGES = 3
# producer warps gathering rows (1 when TMA brings them); not swept: gathered ran within 3% of in place
GATHER_WARPS = 4
# the tile (constants of the kernels): 64 rows per consumer warpgroup, two weight-scale blocks
# of columns, one activation and one weight scale per K block
BLOCK_M = gl.constexpr(128)
BLOCK_O = gl.constexpr(256)
BLOCK_K = gl.constexpr(FP8_GROUP)
HALF_M = gl.constexpr(BLOCK_M.value // 2)  # a consumer's rows
HALF_O = gl.constexpr(BLOCK_O.value // 2)  # a wgmma's columns (one weight-scale block)
# registers per thread: a consumer holds 2 x 64 of accumulator and 64 of partial product
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
# the fewest 128 x 256 tiles per SM for which this kernel runs (fills_sms): over half a wave.
# One H200, fp8 GEMMs of deepseek-v3's shapes, us, this kernel / the Triton kernel (tiles): gate_up
# (O 4096) 73.5 / 53.1 (64 tiles), 66.9 / 81.1 (96); down (O 7168) 22.9 / 16.3 (56), 23.4 / 27.9
# (84); docs/perf.md v54
MIN_TILES_PER_SM = 0.6
_FP8_MAX = gl.constexpr(FP8_MAX)  # the SwiGLU epilogue's quantisation


def usable(*, a: torch.Tensor, b_LDO: torch.Tensor, rows_per_expert: int) -> bool:
    """Whether :func:`grouped_gemm_fp8_sm90` runs these operands: fp8 rows TMA can address and
    weights :func:`weights_usable` accepts."""
    return a.dtype == torch.float8_e4m3fn and tma_addressable(a) and weights_usable(b_LDO, rows_per_expert)


def weights_usable(b_LDO: torch.Tensor, rows_per_expert: int) -> bool:
    """fp8 K-major weights stored as [L, O, D] (D contiguous) on a Hopper GPU, O a multiple of
    256, more than 64 capacity rows per expert (decode's few rows per expert keep the Triton
    kernel's 64-row tiles, which read each weight once per 64 rows) and tiles enough to keep
    the SMs busy (:func:`fills_sms`)."""
    if sm_major(b_LDO.device) != 9:
        return False
    if b_LDO.dtype != torch.float8_e4m3fn or not prefill_rows(rows_per_expert):
        return False
    L, D, O = b_LDO.shape
    w = b_LDO.transpose(1, 2)
    return (O % BLOCK_O.value == 0 and D % BLOCK_K.value == 0 and w.is_contiguous() and tma_addressable(w)
            and fills_sms(L, rows_per_expert, O, sm_count(b_LDO.device)))


def fills_sms(L: int, rows_per_expert: int, O: int, sms: int) -> bool:
    """Whether L experts of ``rows_per_expert`` capacity rows give this kernel at least
    ``MIN_TILES_PER_SM`` of its 128 x 256 tiles per SM of ``sms``. With fewer (a shared expert
    over a decode batch: one expert, 128 rows) most SMs idle, and the Triton kernel's
    128-column tiles, twice as many, finish first."""
    return L * cdiv(rows_per_expert, BLOCK_M.value) * (O // BLOCK_O.value) >= MIN_TILES_PER_SM * sms


@gluon.jit
def _add(x, y):
    return x + y


@gluon.jit
def _tiles(num_tokens_ptr, L, O, BLOCK_L: gl.constexpr, BM: gl.constexpr, BO: gl.constexpr, NW: gl.constexpr):
    """Per-expert tile counts (m tiles x o tiles, expert-major), their inclusive ends and total.
    Every warp holds all BLOCK_L experts, so the sums stay inside a warp."""
    vec: gl.constexpr = gl.BlockedLayout([(BLOCK_L + 31) // 32], [32], [NW], [0])
    experts = gl.arange(0, BLOCK_L, layout=vec)
    tokens_L = gl.load(num_tokens_ptr + experts, mask=experts < L, other=0)
    m_tiles_L = (tokens_L + BM - 1) // BM
    tiles_L = m_tiles_L * (O // BO)
    tile_ends_L = gl.associative_scan(tiles_L, 0, _add)
    return experts, tokens_L, m_tiles_L, tiles_L, tile_ends_L, gl.sum(tiles_L, axis=0)


@gluon.jit
def _publish_next_tile(counter_ptr, sched, sched_full, sched_empty, n):
    """The producer's next tile, taken from the launch's counter (so the tiles in flight stay a
    window of consecutive ones, whatever each took: see the module docstring), handed to both
    consumers through ``sched`` slot n % 2. Returns it."""
    nxt = gl.atomic_add(counter_ptr, 1) + gl.num_programs(0)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    mbarrier.wait(sched_empty.index(n % 2), ((n // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
    sched.index(n % 2).store(gl.zeros([1], gl.int32, one) + nxt)
    mbarrier.arrive(sched_full.index(n % 2), count=1)
    return nxt


@gluon.jit
def _next_tile(sched, sched_full, sched_empty, n):
    """A consumer's next tile, as the producer published it in slot n % 2."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    mbarrier.wait(sched_full.index(n % 2), (n // 2) & 1)
    nxt = gl.max(sched.index(n % 2).load(one), axis=0)
    mbarrier.arrive(sched_empty.index(n % 2), count=1)
    return nxt


@gluon.jit
def _producer(a_desc, a_ptr, stride_am, row_ids_ptr, b_desc, row_offsets_ptr, num_tokens_ptr, L, O, full, empty,
              counter_ptr, sched, sched_full, sched_empty, a0_bufs, a1_bufs, b0_bufs, b1_bufs, meta: gl.constexpr):
    """Fills the stages tile after tile, K block after K block (the consumers' order). A half
    tile's rows 64-127 load too (as zeros when gathered): the consumers leave them."""
    D: gl.constexpr = meta[0]
    BLOCK_L: gl.constexpr = meta[1]
    NUM_STAGES: gl.constexpr = meta[2]
    GATHER: gl.constexpr = meta[3]
    NW: gl.constexpr = meta[4]
    SWIGLU: gl.constexpr = meta[7]
    experts, tokens_L, m_tiles_L, tiles_L, tile_ends_L, total = _tiles(num_tokens_ptr, L, O, BLOCK_L, BLOCK_M,
                                                                      BLOCK_O, NW)
    if GATHER:
        nbytes: gl.constexpr = 2 * b_desc.block_type.nbytes
        # 16 bytes (a cp.async) per thread: a warp covers 4 rows of 128 channels
        rows_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])
        rr = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, rows_l))
        cc = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, rows_l))
    else:
        nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
    i = 0
    n = 0  # tiles so far
    tile = gl.program_id(0)
    while tile < total:
        e, m_tile, o_tile, tokens = _tile(tile, experts, tokens_L, m_tiles_L, tiles_L, tile_ends_L)
        row0 = gl.load(row_offsets_ptr + e) + m_tile * BLOCK_M
        if SWIGLU:  # 128 gate columns, then the same columns of up (O / 2 further)
            brow0 = e * O + o_tile * HALF_O
            brow1 = brow0 + O // 2
        else:
            brow0 = e * O + o_tile * BLOCK_O
            brow1 = brow0 + HALF_O
        if GATHER:
            m0 = m_tile * BLOCK_M + rr
            src0 = gl.load(row_ids_ptr + row0 + rr, mask=m0 < tokens, other=-1).to(gl.int64)
            src1 = gl.load(row_ids_ptr + row0 + HALF_M + rr, mask=m0 + HALF_M < tokens, other=-1).to(gl.int64)
            ptr0 = a_ptr + src0[:, None] * stride_am + cc[None, :]
            ptr1 = a_ptr + src1[:, None] * stride_am + cc[None, :]
            ok0 = (src0 >= 0)[:, None]
            ok1 = (src1 >= 0)[:, None]
        for k in range(D // BLOCK_K):
            s = i % NUM_STAGES
            mbarrier.wait(empty.index(s), ((i // NUM_STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
            bar = full.index(s)
            if GATHER:  # rows a consumer does not store read as zeros
                async_copy.async_copy_global_to_shared(a0_bufs.index(s), ptr0 + k * BLOCK_K, mask=ok0)
                async_copy.async_copy_global_to_shared(a1_bufs.index(s), ptr1 + k * BLOCK_K, mask=ok1)
                async_copy.mbarrier_arrive(bar, increment_count=False)  # each thread, once its copies land
            else:
                tma.async_copy_global_to_shared(a_desc, [row0, k * BLOCK_K], bar, a0_bufs.index(s))
                tma.async_copy_global_to_shared(a_desc, [row0 + HALF_M, k * BLOCK_K], bar, a1_bufs.index(s))
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(b_desc, [brow0, k * BLOCK_K], bar, b0_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [brow1, k * BLOCK_K], bar, b1_bufs.index(s))
            i += 1
        tile = _publish_next_tile(counter_ptr, sched, sched_full, sched_empty, n)
        n += 1


@gluon.jit
def _swiglu_epilogue(acc0, acc1, e, o_tile, tokens, first_row, m_mask, rows, c_ptr, stride_cm, stride_co,
                     c_desc, cs_ptr, stride_csm, stride_csg, row_offsets_ptr, c_bufs, TMA_STORE: gl.constexpr,
                     rows_l: gl.constexpr, cols_l: gl.constexpr):
    """``silu(gate) * up`` of a consumer's 64 rows x 128 channels (acc0 gate, acc1 up), quantised
    to fp8 with one scale per row, with the bits the gate_up GEMM's bf16 output and then
    :func:`ray_ep.kernels.activation.swiglu` give: the same roundings in the same order."""
    gate = acc0.to(gl.bfloat16).to(gl.float32)
    up = acc1.to(gl.bfloat16).to(gl.float32)
    v = gate * _sigmoid(gate) * up
    # :func:`ray_ep.kernels.quant.group_scales`: 448 / amax and amax / 448 (1 and 1 for zeros)
    amax = gl.max(gl.abs(v), axis=1)
    nonzero = amax > 0
    safe = gl.where(nonzero, amax, 1.0)
    limit = gl.full([HALF_M], _FP8_MAX, gl.float32, rows_l)
    inv = gl.where(nonzero, gl.div_rn(limit, safe), 1.0)
    scale = gl.where(nonzero, gl.div_rn(safe, limit), 1.0)
    q = (v * inv[:, None]).to(gl.float8e4nv)
    gl.store(cs_ptr + rows * stride_csm + o_tile * stride_csg, scale, mask=m_mask)
    if TMA_STORE and first_row + HALF_M <= tokens:
        tma.store_wait(0)  # the previous tile's copy has read the buffer
        c_bufs.index(0).store(q)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [gl.load(row_offsets_ptr + e) + first_row, o_tile * HALF_O],
                                        c_bufs.index(0))
    else:
        offs_o = o_tile * HALF_O + gl.arange(0, HALF_O, layout=cols_l)
        gl.store(c_ptr + rows[:, None] * stride_cm + offs_o[None, :] * stride_co, q, mask=m_mask[:, None])


@gluon.jit
def _scaled_k_loop(i, a_bufs, b0_bufs, b1_bufs, full, empty, sa_ptrs, sa_mask, stride_sd, sb_ptr, sb_up,
                   stride_bsd, acc0, acc1, mma: gl.constexpr, D: gl.constexpr, NUM_STAGES: gl.constexpr,
                   GATHER: gl.constexpr, TWO: gl.constexpr):
    """A tile's K loop for one warpgroup: per K block the wgmma of its 64 rows (``a_bufs``) with
    128 columns (``b0_bufs``), waited for and scaled into ``acc0``, then (``TWO``) the same with
    ``b1_bufs`` into ``acc1`` (unread without ``TWO``); the stage freed after the last. Returns
    (i, acc0, acc1)."""
    # each wgmma overwrites the registers of the partial product scaled just before (use_acc
    # False): no zero tile per K block; set up per tile, so it is dead in the epilogue
    part = gl.zeros([HALF_M, HALF_O], gl.float32, mma)
    # the scales arrive a K block ahead, and the loop carries their products (formed at the end
    # of the block before, once the loads have landed) rather than the loaded values: carrying
    # those, ptxas moved each newly loaded one into the register of the old right after the load,
    # so every K block's wgmma waited for it (ncu, one H200: the consumers' largest stall besides
    # the wgmma waits)
    sa = gl.load(sa_ptrs, mask=sa_mask, other=0.0)
    sb0 = gl.load(sb_ptr)
    p0 = sa * sb0
    if TWO:
        p1 = sa * gl.load(sb_ptr + sb_up)
    else:
        p1 = p0  # unused
    for k in range(D // BLOCK_K):
        s = i % NUM_STAGES
        k_next = gl.minimum(k + 1, D // BLOCK_K - 1)  # the last block loads its own again
        sa_next = gl.load(sa_ptrs + k_next * stride_sd, mask=sa_mask, other=0.0)
        sb0_next = gl.load(sb_ptr + k_next * stride_bsd)
        if TWO:
            sb1_next = gl.load(sb_ptr + k_next * stride_bsd + sb_up)
        mbarrier.wait(full.index(s), (i // NUM_STAGES) & 1)
        if GATHER:
            fence_async_shared()  # rows written by cp.async (generic proxy), read by the wgmma
        tok = warpgroup_mma(a_bufs.index(s), b0_bufs.index(s).permute((1, 0)), part, use_acc=False, is_async=True)
        part = warpgroup_mma_wait(0, deps=(tok, ))
        if TWO:
            acc0 += part * p0[:, None]
            tok = warpgroup_mma(a_bufs.index(s), b1_bufs.index(s).permute((1, 0)), part, use_acc=False,
                                is_async=True)
            part = warpgroup_mma_wait(0, deps=(tok, ))
            mbarrier.arrive(empty.index(s), count=1)
            acc1 += part * p1[:, None]
            p1 = sa_next * sb1_next
        else:
            mbarrier.arrive(empty.index(s), count=1)
            acc0 += part * p0[:, None]
        p0 = sa_next * sb0_next
        i += 1
    return i, acc0, acc1


@gluon.jit
def _store_bf16(acc0, acc1, rows, m_mask, first_row, tokens, e, col, c_ptr, stride_cm, stride_co, c_desc,
                row_offsets_ptr, c_bufs, TMA_STORE: gl.constexpr, TWO: gl.constexpr, cols_l: gl.constexpr):
    """A warpgroup's 64 output rows in bf16: 128 columns from ``col`` (``acc0``) and, with
    ``TWO``, the next 128 (``acc1``). All 64 rows real: through shared memory by bulk copies
    it does not wait for (only before it reuses ``c_bufs``, a tile later), so its next tile's
    K loop runs while they write; else masked stores (the other rows of a partial block belong
    to padding or to the next expert)."""
    if TMA_STORE and first_row + HALF_M <= tokens:
        tma.store_wait(0)  # the previous tile's copies have read the buffers
        c_bufs.index(0).store(acc0.to(gl.bfloat16))
        if TWO:
            c_bufs.index(1).store(acc1.to(gl.bfloat16))
        fence_async_shared()
        row_c = gl.load(row_offsets_ptr + e) + first_row
        tma.async_copy_shared_to_global(c_desc, [row_c, col], c_bufs.index(0))
        if TWO:
            tma.async_copy_shared_to_global(c_desc, [row_c, col + HALF_O], c_bufs.index(1))
    else:
        offs_o = col + gl.arange(0, HALF_O, layout=cols_l)
        c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_o[None, :] * stride_co
        gl.store(c_ptrs, acc0.to(gl.bfloat16), mask=m_mask[:, None])
        if TWO:
            gl.store(c_ptrs + HALF_O * stride_co, acc1.to(gl.bfloat16), mask=m_mask[:, None])


@gluon.jit
def _consumer(a_scales_ptr, stride_sm, stride_sd, row_ids_ptr, b_scales_ptr, stride_bsl, stride_bsd, stride_bso,
              c_ptr, stride_cm, stride_co, c_desc, cs_ptr, stride_csm, stride_csg, row_offsets_ptr, num_tokens_ptr,
              L, O, full, empty, sched, sched_full, sched_empty, x_buf, x_full, x_empty, a0_bufs, a_bufs, b0_bufs,
              b1_bufs, c_bufs, meta: gl.constexpr):
    """Rows [64 PART, 64 PART + 64) of every tile: a K block's two wgmma halves, each waited for
    and scaled into its accumulator; the stage freed after the second. SWIGLU: the halves are
    128 gate and the same 128 up columns, stored as silu(gate) * up in fp8 with a scale per row
    (``c_ptr`` / ``cs_ptr``).

    A tile with at most 64 real rows (an expert's last, about half of them at ~512 rows per
    expert) is a half tile: both warpgroups take its rows 0-63 (``a0_bufs``), PART 0 the first
    128 columns and PART 1 the second, one wgmma each per K block, so the tile takes about half
    the time of a full one whose rows 64-127 are padding. The products are the same wgmmas on
    the same operands (the same bits). SWIGLU: PART 1 hands its up columns, rounded to bf16 as
    the epilogue rounds them, to PART 0 through ``x_buf`` (``x_full`` / ``x_empty``)."""
    D: gl.constexpr = meta[0]
    BLOCK_L: gl.constexpr = meta[1]
    NUM_STAGES: gl.constexpr = meta[2]
    GATHER: gl.constexpr = meta[3]
    PART: gl.constexpr = meta[5]
    TMA_STORE: gl.constexpr = meta[6]
    SWIGLU: gl.constexpr = meta[7]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_O, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    experts, tokens_L, m_tiles_L, tiles_L, tile_ends_L, total = _tiles(num_tokens_ptr, L, O, BLOCK_L, BLOCK_M,
                                                                      BLOCK_O, 4)
    i = 0
    n = 0  # tiles so far
    halves = 0  # half tiles so far: the SwiGLU hand-off's phase
    tile = gl.program_id(0)
    while tile < total:
        e, m_tile, o_tile, tokens = _tile(tile, experts, tokens_L, m_tiles_L, tiles_L, tile_ends_L)
        half = tokens - m_tile * BLOCK_M <= HALF_M
        part_rows = gl.where(half, 0, PART * HALF_M)  # a half tile: rows 0-63 in both warpgroups
        first_row = m_tile * BLOCK_M + part_rows
        offs_m = first_row + gl.arange(0, HALF_M, layout=rows_l)
        m_mask = offs_m < tokens
        rows = (gl.load(row_offsets_ptr + e) + offs_m).to(gl.int64)
        if GATHER:
            src = gl.load(row_ids_ptr + rows, mask=m_mask, other=-1).to(gl.int64)
        else:
            src = rows
        sa_ptrs = a_scales_ptr + src * stride_sm
        sa_mask = m_mask & (src >= 0)
        if SWIGLU:  # the gate block's weight scales, and the up block's F / 128 blocks further
            sb_ptr = b_scales_ptr + e.to(gl.int64) * stride_bsl + o_tile * stride_bso
            sb_up = (O // BLOCK_O) * stride_bso
        else:
            sb_ptr = b_scales_ptr + e.to(gl.int64) * stride_bsl + (o_tile * (BLOCK_O // BLOCK_K)) * stride_bso
            sb_up = stride_bso
        acc0 = gl.zeros([HALF_M, HALF_O], gl.float32, mma)
        acc1 = gl.zeros([HALF_M, HALF_O], gl.float32, mma)
        if half:
            # this warpgroup's 128 columns: PART 0 the first (gate), PART 1 the second (up)
            if PART == 0:
                b_half = b0_bufs
                sb_half = sb_ptr
            else:
                b_half = b1_bufs
                sb_half = sb_ptr + sb_up
            i, acc0, acc1 = _scaled_k_loop(i, a0_bufs, b_half, b_half, full, empty, sa_ptrs, sa_mask, stride_sd,
                                           sb_half, sb_up, stride_bsd, acc0, acc1, mma, D, NUM_STAGES, GATHER, False)
            if SWIGLU:
                if PART == 1:
                    mbarrier.wait(x_empty, (halves & 1) ^ 1)  # a fresh barrier passes parity 1
                    x_buf.store(acc0.to(gl.bfloat16))
                    mbarrier.arrive(x_full, count=1)
                else:
                    mbarrier.wait(x_full, halves & 1)
                    up = x_buf.load(mma)
                    mbarrier.arrive(x_empty, count=1)
                    _swiglu_epilogue(acc0, up, e, o_tile, tokens, first_row, m_mask, rows, c_ptr, stride_cm,
                                     stride_co, c_desc, cs_ptr, stride_csm, stride_csg, row_offsets_ptr, c_bufs,
                                     TMA_STORE, rows_l, cols_l)
            else:
                _store_bf16(acc0, acc1, rows, m_mask, first_row, tokens, e, o_tile * BLOCK_O + PART * HALF_O,
                            c_ptr, stride_cm, stride_co, c_desc, row_offsets_ptr, c_bufs, TMA_STORE, False, cols_l)
            halves += 1
        else:
            i, acc0, acc1 = _scaled_k_loop(i, a_bufs, b0_bufs, b1_bufs, full, empty, sa_ptrs, sa_mask, stride_sd,
                                           sb_ptr, sb_up, stride_bsd, acc0, acc1, mma, D, NUM_STAGES, GATHER, True)
            if SWIGLU:
                _swiglu_epilogue(acc0, acc1, e, o_tile, tokens, first_row, m_mask, rows, c_ptr, stride_cm,
                                 stride_co, c_desc, cs_ptr, stride_csm, stride_csg, row_offsets_ptr, c_bufs,
                                 TMA_STORE, rows_l, cols_l)
            else:
                _store_bf16(acc0, acc1, rows, m_mask, first_row, tokens, e, o_tile * BLOCK_O, c_ptr, stride_cm,
                            stride_co, c_desc, row_offsets_ptr, c_bufs, TMA_STORE, True, cols_l)
        tile = _next_tile(sched, sched_full, sched_empty, n)
        n += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _grouped_gemm_fp8_kernel(a_desc, a_ptr, stride_am, a_scales_ptr, stride_sm, stride_sd, row_ids_ptr, b_desc,
                             b_scales_ptr, stride_bsl, stride_bsd, stride_bso, c_ptr, stride_cm, stride_co, c_desc,
                             cs_ptr, stride_csm, stride_csg, row_offsets_ptr, num_tokens_ptr, counter_ptr, L, O,
                             D: gl.constexpr, BLOCK_L: gl.constexpr, NUM_STAGES: gl.constexpr,
                             GATHER: gl.constexpr, PRODUCER_WARPS: gl.constexpr, TMA_STORE: gl.constexpr,
                             SWIGLU: gl.constexpr):
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], gl.float8e4nv)
    b_layout: gl.constexpr = b_desc.layout
    a0_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, HALF_M, BLOCK_K], a_layout)
    a1_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, HALF_M, BLOCK_K], a_layout)
    b0_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, HALF_O, BLOCK_K], b_layout)
    b1_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, HALF_O, BLOCK_K], b_layout)
    if TMA_STORE and SWIGLU:  # each consumer's fp8 half
        c0_bufs = gl.allocate_shared_memory(gl.float8e4nv, [1, HALF_M, HALF_O], c_desc.layout)
        c1_bufs = gl.allocate_shared_memory(gl.float8e4nv, [1, HALF_M, HALF_O], c_desc.layout)
    elif TMA_STORE:  # each consumer's two output halves
        c_layout: gl.constexpr = c_desc.layout
        c0_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_M, HALF_O], c_layout)
        c1_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_M, HALF_O], c_layout)
    else:
        c0_bufs = a0_bufs  # unused
        c1_bufs = a1_bufs
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        # full: the producer's expect (plus, gathering, one cp.async arrive per producer thread)
        mbarrier.init(full.index(s), count=1 + (32 * PRODUCER_WARPS if GATHER else 0))
        mbarrier.init(empty.index(s), count=2)  # one arrive per consumer warpgroup
    # the next tile, from the producer to the consumers (two slots: it runs up to a tile ahead)
    sched = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    sched_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    sched_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(sched_full.index(s), count=1)  # the producer's arrive
        mbarrier.init(sched_empty.index(s), count=2)  # one arrive per consumer
    if SWIGLU:  # a half tile's up columns, from the second warpgroup to the first
        x_buf = gl.allocate_shared_memory(gl.bfloat16, [HALF_M, HALF_O],
                                          gl.NVMMASharedLayout.get_default_for([HALF_M, HALF_O], gl.bfloat16))
        x_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(x_bars.index(0), count=1)
        mbarrier.init(x_bars.index(1), count=1)
    else:  # unused
        x_buf = a0_bufs.index(0)
        x_bars = full
    consumer = (a_scales_ptr, stride_sm, stride_sd, row_ids_ptr, b_scales_ptr, stride_bsl, stride_bsd, stride_bso,
                c_ptr, stride_cm, stride_co, c_desc, cs_ptr, stride_csm, stride_csg, row_offsets_ptr, num_tokens_ptr,
                L, O, full, empty, sched, sched_full, sched_empty, x_buf, x_bars.index(0), x_bars.index(1), a0_bufs)
    meta0: gl.constexpr = (D, BLOCK_L, NUM_STAGES, GATHER, PRODUCER_WARPS, 0, TMA_STORE, SWIGLU)
    meta1: gl.constexpr = (D, BLOCK_L, NUM_STAGES, GATHER, PRODUCER_WARPS, 1, TMA_STORE, SWIGLU)
    gl.warp_specialize([
        (_consumer, consumer + (a0_bufs, b0_bufs, b1_bufs, c0_bufs, meta0)),
        (_consumer, consumer + (a1_bufs, b0_bufs, b1_bufs, c1_bufs, meta1)),
        (_producer, (a_desc, a_ptr, stride_am, row_ids_ptr, b_desc, row_offsets_ptr, num_tokens_ptr, L, O, full,
                     empty, counter_ptr, sched, sched_full, sched_empty, a0_bufs, a1_bufs, b0_bufs, b1_bufs, meta0)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, cols: int, dtype: str) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [rows, cols] TMA block of ``dtype`` ("fp8" or "bf16"), worked
    out once per shape: Gluon's ``get_default_for`` takes ~10 us of host time per call, three per
    launch."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], {"fp8": gl.float8e4nv, "bf16": gl.bfloat16}[dtype])


def grouped_gemm_fp8_sm90(*, a: torch.Tensor, a_scales: torch.Tensor, a_row_ids: torch.Tensor | None,
                          b_LDO: torch.Tensor, b_scales: torch.Tensor, row_offsets_L1: torch.Tensor,
                          num_tokens_L: torch.Tensor, out: torch.Tensor, num_sms: int | None,
                          swiglu_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel (arguments checked by the caller, :func:`usable` true): a persistent
    program per SM (or ``num_sms`` of them) over the tiles, found on the device and taken in
    order from a zeroed counter allocated on the current stream (so launches on two streams,
    e.g. the shared and the routed experts, never share one). With
    ``swiglu_scales`` [M, O / 256] fp32, ``out`` is float8_e4m3fn [M, O / 2] and receives the
    SwiGLU of the product (its O columns [gate | up]) quantised per 128 channels."""
    L, D, O = b_LDO.shape
    gather = a_row_ids is not None
    swiglu = swiglu_scales is not None
    a_block, b_block = [HALF_M.value, BLOCK_K.value], [HALF_O.value, BLOCK_K.value]
    a_desc = None if gather else TensorDescriptor.from_tensor(a, a_block, _smem_layout(*a_block, "fp8"))
    b_desc = TensorDescriptor.from_tensor(b_LDO.transpose(1, 2).reshape(L * O, D), b_block,
                                          _smem_layout(*b_block, "fp8"))
    c_block = [HALF_M.value, HALF_O.value]
    tma_store = tma_addressable(out)  # else every row leaves by masked register stores
    c_desc = TensorDescriptor.from_tensor(out, c_block, _smem_layout(*c_block, "fp8" if swiglu else "bf16")
                                          ) if tma_store else None
    # the fp8 halves (8 KB a consumer) leave room for every stage
    stages = TMA_STORE_STAGES if tma_store and not swiglu else STAGES
    cs = swiglu_scales if swiglu else out  # a dummy pointer when unused
    sms = sm_count(a.device)
    grid = (max(1, min(num_sms or sms, sms)),)
    row_ids = a_row_ids.contiguous() if gather else num_tokens_L  # a dummy pointer when unused
    _grouped_gemm_fp8_kernel[grid](
        a_desc, a, a.stride(0), a_scales, a_scales.stride(0), a_scales.stride(1), row_ids, b_desc,
        b_scales, b_scales.stride(0), b_scales.stride(1), b_scales.stride(2), out, out.stride(0), out.stride(1),
        c_desc, cs, cs.stride(0), cs.stride(1), row_offsets_L1.contiguous(), num_tokens_L.contiguous(),
        torch.zeros(1, dtype=torch.int32, device=a.device), L, O,  # the tile counter
        D=D, BLOCK_L=max(2, next_power_of_2(L)), NUM_STAGES=stages, GATHER=gather,
        PRODUCER_WARPS=GATHER_WARPS if gather else 1, TMA_STORE=tma_store, SWIGLU=swiglu, num_warps=4)
    return out
