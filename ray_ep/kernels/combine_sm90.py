"""The combine's send under an SM budget on Hopper (sm_90), in Gluon: each live slot's expert row
arrives by one TMA bulk copy into a ring of shared memory, and empty slots cost nothing.

Same contract as the push send of :func:`ray_ep.kernels.combine.combine_send` within one node,
bf16 expert rows and bf16 on the wire; its twin is :func:`ray_ep.kernels.combine.combine_send_torch`.
For each received row (s, i) it sums, in fp32 and in slot order, its local experts' output rows
weighted by their router weights, and stores the row (bf16) at row ``me * N + i`` of source s's
``combine.recv`` buffer; the last program then releases ``signal[me] = epoch + 1`` on every rank.
The sums are those of the Triton send (the same products added in the same order: the same bits).

Why a kernel of its own: under a budget (one program per SM) the Triton send is bound by its
instructions (ncu, one H200, 24 SMs: 2.7 instructions issued per cycle, 53 M in all for 470 MB
of expert rows), most of them spent on the K slots of every row whether the row has an expert
there or not (on 2 ranks ~4 of 8 are empty, on 4 ranks ~6). Here each live slot costs one bulk
copy and nothing else. Per program (one per SM), in two halves, each with its own ring of
``STAGES`` entries in shared memory:

- a producer warp walks every other block of the program's blocks (the Triton send's blocks,
  sources interleaved; half 0 the program's first, third, ... block, half 1 the others) and, for
  each row, chunk of up to ``BOX_ROWS x BOX_W`` channels and live slot, copies that chunk of the
  expert row into the next ring entry by one TMA bulk copy, with the slot's weight and whether
  it ends the row's chunk beside it (empty slots cost no copy and no entry);
- a consumer warpgroup takes its ring's entries in the same order, adds ``w * row`` into an fp32
  chunk and stores the chunk to the source once its last slot is in; with ``FLAGS`` it then
  flags its blocks on their sources (``ready[me, row // FLAG_ROWS] = epoch + 1``, one fence per
  ``FLAG_EVERY`` blocks), so the source's per-token sum can run beside the sends
  (:func:`ray_ep.kernels.combine.combine_fused`).

Each producer keeps the next block's metadata (slots' experts, ordinals, weights) in flight
while it copies this block's rows, so no copy waits for a metadata round trip. Steps, one H200,
the send of a 2-rank LocalWorld at 24 SMs (deepseek-v3 prefill rows; docs/perf.md v34): one
producer and one consumer with 8 KB entries ran 688-743 us against the Triton send's 586-712 (ncu:
the producer warp, one dependent instruction after another, issued ~68 instructions per entry
and was the bound; the consumers waited for data); 16 KB entries (a whole 7168-channel row per
copy) and a producer per consumer half, this form: 452 against 632 us (2 ranks), 543 against 870
(4 ranks). With every SM the Triton send's many resident programs stay faster (308 against 287
us), so :func:`usable` leaves budgets above half the SMs to it. Gluon kernels do not run in
Triton's CPU interpreter: elsewhere the Triton send runs.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._sync import last_program_done, peer_bases
from ._util import BUDGET_ROWS, cdiv, interpreted, next_power_of_2, num_sms as sm_count, sm_major, tma_addressable

# the Triton sends' helpers, compiled as Gluon: the peer table's addresses, and the count of
# finished programs whose last one releases the signals
_peer_bases = gluon.jit(peer_bases.fn)
_last_program_done = gluon.jit(last_program_done.fn)

BLOCK_ROWS = BUDGET_ROWS["combine"]  # received rows per block: the Triton send's blocks under a budget
PARTS = 2  # halves of a program (a producer warp and a consumer warpgroup each): one producer was the bound
STAGES = 6  # ring entries per consumer, a chunk each: 12 x 16 KB of shared memory in flight per SM
BOX_ROWS = 32  # a chunk is BOX_ROWS x BOX_W channels: 8192 bf16 channels, 16 KB (deepseek-v3's 7168 in one)
# rows per readiness flag with ``flags``: a block's, flagged once its consumer has stored them
FLAG_ROWS = BLOCK_ROWS
FLAG_EVERY = 8  # blocks a consumer stores between two releases of their flags (one fence each)
CONSUMER_WARPS = 4  # per consumer partition
CONSUMER_REGS = 160
PRODUCER_REGS = 192  # the block's slots and weights, replicated in every lane of the warp


def box_width(H: int) -> int:
    """Channels per row of a TMA box: the widest of 256 / 128 / 64 that divides H (0: none)."""
    return next((w for w in (256, 128, 64) if H % w == 0), 0)


def usable(cfg, y_MH: torch.Tensor, budget: int | None) -> bool:
    """Whether this send runs: a push combine within one node, bf16 expert rows TMA can address
    and bf16 on the wire, on a Hopper GPU under an SM budget of at most half its SMs (with more,
    the Triton send's many resident programs are faster: one H200, 2 ranks' rows, every SM
    287 us against this send's 308)."""
    return usable_for(cfg, budget, y_MH.device, y_MH.dtype) and tma_addressable(y_MH)


def usable_for(cfg, budget: int | None, device: torch.device, dtype: torch.dtype) -> bool:
    """:func:`usable` for any expert rows of ``dtype`` on ``device`` that TMA can address."""
    if not budget or interpreted() or torch.device(device).type != "cuda":
        return False
    if sm_major(device) != 9 or 2 * budget > sm_count(device):
        return False
    return (cfg.combine_mode == "push" and cfg.n_nodes == 1 and cfg.combine_dtype == "bf16"
            and dtype == torch.bfloat16 and box_width(cfg.hidden_size) > 0)


@gluon.jit
def _pick(v, idx, n: gl.constexpr):
    """Element n of ``v`` (replicated in every lane: a register, once the compare folds)."""
    return gl.sum(gl.where(idx == n, v, 0), axis=0)


@gluon.jit
def _sources(recv_counts_ptr, rank, R, R_PAD: gl.constexpr, BJ: gl.constexpr):
    """(rows received from each source as a tuple of R_PAD scalars, blocks of the schedule):
    blocks b, b + 1, ... belong to sources rank + 1, rank + 2, ... in turn, as in the Triton send."""
    counts = ()
    for d in gl.static_range(R_PAD):
        counts = counts + (gl.load(recv_counts_ptr + d, mask=d < R, other=0),)
    most = counts[0]
    for d in gl.static_range(1, R_PAD):
        most = gl.where(counts[d] > most, counts[d], most)
    return counts, (most + BJ - 1) // BJ * R


@gluon.jit
def _block(b, counts, rank, R, R_PAD: gl.constexpr, BJ: gl.constexpr):
    """(source, first row, rows from that source) of block b."""
    src = (b % R + rank + 1) % R
    n_src = counts[0]
    for d in gl.static_range(1, R_PAD):
        n_src = gl.where(src == d, counts[d], n_src)
    return src, (b // R) * BJ, n_src


@gluon.jit
def _block_meta(meta_ptr, b, blocks, counts, rank, R, N, idx, K: gl.constexpr, R_PAD: gl.constexpr,
                BJ: gl.constexpr):
    """(source, expert ids, ordinals, weight bits) of block b's rows x slots (``idx`` = row * K +
    slot; ids -1 past the block's rows or past the last block)."""
    src, first, n_src = _block(b, counts, rank, R, R_PAD, BJ)
    i = first + idx // K
    live = (i < n_src) & (b < blocks)
    meta = meta_ptr + (src * N + i).to(gl.int64) * (3 * K) + idx % K
    ids = gl.load(meta, mask=live, other=-1)
    ords = gl.load(meta + K, mask=live, other=0)
    w = gl.load(meta + 2 * K, mask=live, other=0)
    return src, ids, ords, w


@gluon.jit
def _producer(y_desc, meta_ptr, src_offsets_ptr, recv_counts_ptr, rank, R, L, N, bufs, full, empty, info_w,
              info_last, meta: gl.constexpr):
    """Fills consumer PART's ring of STAGES entries: per block of its part (the program's blocks
    PART, PART + PARTS, ...), each row, chunk and live slot one bulk copy (in that consumer's order)."""
    K: gl.constexpr = meta[0]
    R_PAD: gl.constexpr = meta[1]
    BJ: gl.constexpr = meta[2]
    STAGES: gl.constexpr = meta[3]
    CHUNKS: gl.constexpr = meta[4]
    BOX_ROWS: gl.constexpr = meta[5]
    PARTS: gl.constexpr = meta[7]
    PART: gl.constexpr = meta[8]
    pid = gl.program_id(0)
    first_b = pid + PART * gl.num_programs(0)  # this part's first block, then every PARTS-th of the program's
    step = PARTS * gl.num_programs(0)
    # the next blocks' metadata, two lanes' worth per lane; the block being copied, in every lane
    spread: gl.constexpr = gl.BlockedLayout([(BJ * K + 31) // 32], [32], [1], [0])
    rep: gl.constexpr = gl.BlockedLayout([BJ * K], [32], [1], [0])
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    idx = gl.arange(0, BJ * K, layout=spread)
    idx_rep = gl.arange(0, BJ * K, layout=rep)
    i = 0  # entries handed to the consumer so far
    nbytes: gl.constexpr = y_desc.block_type.nbytes
    counts, blocks = _sources(recv_counts_ptr, rank, R, R_PAD, BJ)
    # prologue: the first block's positions, the next one's metadata in flight
    src, ids, ords, w = _block_meta(meta_ptr, first_b, blocks, counts, rank, R, N, idx, K, R_PAD, BJ)
    e = ids - rank * L
    here = (ids >= 0) & (e >= 0) & (e < L)
    pos = gl.where(here, gl.load(src_offsets_ptr + src * L + e, mask=here, other=0) + ords, -1)  # -1: no copy
    src_n, ids_n, ords_n, w_n = _block_meta(meta_ptr, first_b + step, blocks, counts, rank, R, N, idx, K, R_PAD, BJ)
    for b in range(first_b, blocks, step):
        src, first, n_src = _block(b, counts, rank, R, R_PAD, BJ)
        # the next block's positions and the one after's metadata, read while this block copies
        e_n = ids_n - rank * L
        here_n = (ids_n >= 0) & (e_n >= 0) & (e_n < L)
        offs_n = gl.load(src_offsets_ptr + src_n * L + e_n, mask=here_n, other=0)
        src_nn, ids_nn, ords_nn, w_nn = _block_meta(meta_ptr, b + 2 * step, blocks, counts, rank, R, N, idx, K,
                                                    R_PAD, BJ)
        pos_r = gl.convert_layout(pos, rep)
        w_r = gl.convert_layout(w, rep)
        for r in gl.static_range(BJ):
            if first + r < n_src:
                n_live = gl.sum(gl.where((idx_rep // K == r) & (pos_r >= 0), 1, 0), axis=0)
                for c in range(CHUNKS):
                    seen = 0
                    for k in gl.static_range(K):
                        p = _pick(pos_r, idx_rep, r * K + k)
                        if p >= 0:
                            seen += 1
                            s = PART * STAGES + i % STAGES
                            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
                            info_w.index(s).store(gl.zeros([1], gl.int32, one) + _pick(w_r, idx_rep, r * K + k))
                            info_last.index(s).store(gl.zeros([1], gl.int32, one) + (seen == n_live).to(gl.int32))
                            mbarrier.expect(full.index(s), nbytes)
                            tma.async_copy_global_to_shared(y_desc, [p, c * BOX_ROWS, 0], full.index(s), bufs.index(s))
                            i += 1
                    if n_live == 0:  # no local expert (a dispatch never sends such a row): a zero chunk
                        s = PART * STAGES + i % STAGES
                        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                        info_last.index(s).store(gl.zeros([1], gl.int32, one) + 2)
                        mbarrier.arrive(full.index(s), count=1)
                        i += 1
        pos = gl.where(here_n, offs_n + ords_n, -1)
        w = w_n
        src_n = src_nn
        ids_n = ids_nn
        ords_n = ords_nn
        w_n = w_nn


@gluon.jit
def _flag_stored_blocks(peer_bases_ptr, off_ready, epoch, b, n, counts, rank, R, N, meta: gl.constexpr):
    """Flags the last ``n`` blocks this consumer stored (b, b - PARTS * nprog, ...) on their
    sources: one fence for all of them (a fence waits until the stores before it are done, ~3 us
    over NVLink: one per 4 rows made the send 1.4-1.6x slower, docs/perf.md v35)."""
    R_PAD: gl.constexpr = meta[1]
    BJ: gl.constexpr = meta[2]
    PARTS: gl.constexpr = meta[7]
    FLAG_EVERY: gl.constexpr = meta[10]
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    k = gl.arange(0, FLAG_EVERY, layout=vec)
    bk = b - k * PARTS * gl.num_programs(0)
    src, first, n_src = _block(bk, counts, rank, R, R_PAD, BJ)
    ok = (k < n) & (first < n_src)
    base = gl.load(peer_bases_ptr + src, mask=ok, other=0)
    flag = (base + off_ready).to(gl.pointer_type(gl.int64)) + rank * N + first // BJ
    gl.thread_barrier()  # every warp's stores precede the release
    gl.atomic_xchg(flag, gl.zeros([FLAG_EVERY], gl.int64, vec) + epoch + 1, mask=ok, sem="release", scope="sys")


@gluon.jit
def _consumer(peer_bases_ptr, recv_counts_ptr, off_x, off_ready, epoch, rank, R, N, H, bufs, full, empty, info_w,
              info_last, meta: gl.constexpr):
    """Sums the chunks of the rows of its part's blocks from its ring and stores them to the
    row's source; FLAGS: then flags each block there (``ready[rank, row // BJ] = epoch + 1``)."""
    R_PAD: gl.constexpr = meta[1]
    BJ: gl.constexpr = meta[2]
    STAGES: gl.constexpr = meta[3]
    CHUNKS: gl.constexpr = meta[4]
    BOX_ROWS: gl.constexpr = meta[5]
    BOX_W: gl.constexpr = meta[6]
    PARTS: gl.constexpr = meta[7]
    PART: gl.constexpr = meta[8]
    FLAGS: gl.constexpr = meta[9]
    FLAG_EVERY: gl.constexpr = meta[10]
    NW: gl.constexpr = gl.num_warps()
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])  # 16 bytes a thread, rows of the box
    one: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    first_b = gl.program_id(0) + PART * gl.num_programs(0)
    step = PARTS * gl.num_programs(0)
    counts, blocks = _sources(recv_counts_ptr, rank, R, R_PAD, BJ)
    bases = _peer_bases(peer_bases_ptr, R, R_PAD)
    cols = (gl.arange(0, BOX_ROWS, layout=gl.SliceLayout(1, tile))[:, None] * BOX_W
            + gl.arange(0, BOX_W, layout=gl.SliceLayout(0, tile))[None, :])
    i = 0
    done = 0  # blocks this program has stored
    for b in range(first_b, blocks, step):
        src, first, n_src = _block(b, counts, rank, R, R_PAD, BJ)
        base = bases[0]
        for d in gl.static_range(1, R_PAD):
            base = gl.where(src == d, bases[d], base)
        # blocks and their sub-buffers are 128 B aligned, H a multiple of 64: 16-byte stores
        rows = gl.multiple_of((base + off_x).to(gl.pointer_type(gl.bfloat16)), 16) + (rank * N + first).to(gl.int64) * H
        n_rows = gl.where(n_src - first < BJ, n_src - first, BJ)
        for r in range(n_rows):
            for c in range(CHUNKS):
                acc = gl.zeros([BOX_ROWS, BOX_W], gl.float32, tile)
                last = 0
                while last == 0:
                    s = PART * STAGES + i % STAGES
                    mbarrier.wait(full.index(s), (i // STAGES) & 1)
                    last = gl.max(info_last.index(s).load(one), axis=0)
                    if last < 2:
                        w = gl.max(info_w.index(s).load(one), axis=0).to(gl.float32, bitcast=True)
                        x = bufs.index(s).reshape([BOX_ROWS, BOX_W]).load(tile)
                        acc += w * x.to(gl.float32)
                    gl.thread_barrier()  # every warp has read the entry before it is handed back
                    mbarrier.arrive(empty.index(s), count=1)
                    i += 1
                ch = c * (BOX_ROWS * BOX_W) + cols
                gl.store(rows + r * H + ch, acc.to(gl.bfloat16), mask=ch < H)
        done += 1
        if FLAGS:
            if (done % FLAG_EVERY == 0) | (b + step >= blocks):
                n_new = (done - 1) % FLAG_EVERY + 1  # blocks stored since the last release
                _flag_stored_blocks(peer_bases_ptr, off_ready, epoch, b, n_new, counts, rank, R, N, meta)


@gluon.jit
def _combine_send_sm90_kernel(y_desc, meta_ptr, src_offsets_ptr, recv_counts_ptr, peer_bases_ptr, epochs_ptr,
                              send_counter_ptr, off_x, off_signal, off_ready, rank, R, L, N, H, K: gl.constexpr,
                              R_PAD: gl.constexpr, BJ: gl.constexpr, STAGES: gl.constexpr, CHUNKS: gl.constexpr,
                              BOX_ROWS: gl.constexpr, BOX_W: gl.constexpr, PARTS: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, FLAGS: gl.constexpr,
                              FLAG_EVERY: gl.constexpr):
    epoch = gl.load(epochs_ptr)
    # a ring of STAGES entries per consumer
    bufs = gl.allocate_shared_memory(gl.bfloat16, [PARTS * STAGES, 1, BOX_ROWS, BOX_W], y_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [PARTS * STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [PARTS * STAGES, 1], mbarrier.MBarrierLayout())
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    info_w = gl.allocate_shared_memory(gl.int32, [PARTS * STAGES, 1], plain)  # the slot's weight (fp32 bits)
    info_last = gl.allocate_shared_memory(gl.int32, [PARTS * STAGES, 1], plain)  # 1: ends its chunk, 2: a zero chunk
    for s in gl.static_range(PARTS * STAGES):
        mbarrier.init(full.index(s), count=1)  # the producer's expect (or arrive)
        mbarrier.init(empty.index(s), count=1)  # the consumers' arrive
    meta0: gl.constexpr = (K, R_PAD, BJ, STAGES, CHUNKS, BOX_ROWS, BOX_W, PARTS, 0, FLAGS, FLAG_EVERY)
    meta1: gl.constexpr = (K, R_PAD, BJ, STAGES, CHUNKS, BOX_ROWS, BOX_W, PARTS, 1, FLAGS, FLAG_EVERY)
    consumer = (peer_bases_ptr, recv_counts_ptr, off_x, off_ready, epoch, rank, R, N, H, bufs, full, empty, info_w,
                info_last)
    producer = (y_desc, meta_ptr, src_offsets_ptr, recv_counts_ptr, rank, R, L, N, bufs, full, empty, info_w, info_last)
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(PARTS == 2)  # a producer warp per consumer: one warp issues the copies of one consumer's rows
    gl.warp_specialize([(_consumer, consumer + (meta0, )), (_consumer, consumer + (meta1, )),
                        (_producer, producer + (meta0, )), (_producer, producer + (meta1, ))], [NW, 1, 1],
                       [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    # as the Triton send: the last program out releases every rank's signal (one node)
    if _last_program_done(send_counter_ptr, True):
        vec: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        d = gl.arange(0, R_PAD, layout=vec)
        base = gl.load(peer_bases_ptr + d, mask=d < R, other=0)
        sig = (base + off_signal).to(gl.pointer_type(gl.int64)) + rank
        gl.atomic_xchg(sig, gl.zeros([R_PAD], gl.int64, vec) + epoch + 1, mask=d < R, sem="release", scope="sys")


def send_args(cfg, y_MH: torch.Tensor, flags: bool = False) -> tuple[dict, dict]:
    """The kernel's descriptor and constexprs for ``y_MH`` (:func:`usable` true; ``flags``: each
    block of rows flagged once stored, see :data:`FLAG_ROWS`): the caller adds the
    handle's and buffers' arguments."""
    H = cfg.hidden_size
    box_w = box_width(H)
    box_rows = min(BOX_ROWS, next_power_of_2(H // box_w))
    # rows as [M, H / box_w, box_w]: one bulk copy moves box_rows x box_w channels of a row
    # (past H, the last chunk's box reads as zeros and is not stored)
    y3 = y_MH.as_strided((y_MH.shape[0], H // box_w, box_w), (y_MH.stride(0), box_w, 1))
    block = [1, box_rows, box_w]
    desc = TensorDescriptor.from_tensor(y3, block, gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16,
                                                                        rank=3))
    meta = dict(K=cfg.top_k, R_PAD=next_power_of_2(cfg.world_size), BJ=BLOCK_ROWS, STAGES=STAGES,
                CHUNKS=cdiv(H, box_rows * box_w), BOX_ROWS=box_rows, BOX_W=box_w, PARTS=PARTS,
                CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, FLAGS=flags,
                FLAG_EVERY=FLAG_EVERY)
    return dict(y_desc=desc), meta
