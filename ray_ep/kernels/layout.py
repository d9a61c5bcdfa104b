"""Send-side layout: where each token of this rank goes.

Legend: T tokens on this rank, K top-k, E experts, R ranks, L = E / R, B token blocks.

For topk ids [T, K] (global expert ids, -1 = unused slot) it computes

- ``token_slots_TR``: the row of token t in rank d's receive region for this source, or -1
  when none of t's experts lives on d (a token goes once to each rank, deduplicated);
- ``ordinals_TK``: how many earlier tokens of this rank chose the same expert (the row of
  (t, k) inside this source's part of that expert's segment on the receiver);
- ``expert_counts_E`` and ``rank_counts_R``: tokens per expert and per destination rank.

Example (R = 2, L = 2, so experts 0-1 on rank 0 and 2-3 on rank 1)::

    topk_ids = [[0, 3], [1, 0], [2, -1]]
    token_slots = [[0, 0], [1, -1], [-1, 1]]     # token 0 -> row 0 on both ranks, ...
    ordinals    = [[0, 0], [0, 1], [0, -1]]      # token 1 is expert 0's second token
    expert_counts = [2, 1, 1, 1]; rank_counts = [2, 2]

Ordering is deterministic (token order), so the receiver's expert-major layout matches
:func:`ray_ep.reference.dispatch_world` row for row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..types import DispatchLayout
from ..validation import check_tensor
from ._util import cdiv, interpreted, launch, next_power_of_2, num_sms as sm_count


def block_tokens() -> int:
    """Tokens per block of :func:`block_bases`. 16 on a GPU: a send that lays out its own tokens
    from those bases scans at most 15 earlier ones (the pairwise assign of v17 measured fastest
    at 16 too; compute_layout's sorted assign takes ASSIGN_TOKENS). In the interpreter, bigger
    blocks (numpy likes big arrays)."""
    return 64 if interpreted() else 16


# The kernels loop over their blocks or chunks with the grid's stride, so an SM budget caps
# the grid (launch) and any grid is correct. Sizes unspecialised: no recompile per batch size.
@triton.jit(do_not_specialize=["B"])
def _scan_blocks_kernel(counts_ptr, B, C, totals_ptr, BR: tl.constexpr, BC: tl.constexpr):
    """In place: block counts [B, C] -> rows of the blocks before each block (exclusive scan
    over blocks), BC columns at a time; the column totals go to totals [C]."""
    for g in range(tl.program_id(0), tl.cdiv(C, BC), tl.num_programs(0)):
        cols = g * BC + tl.arange(0, BC)
        cm = cols < C
        carry = tl.zeros((BC,), dtype=tl.int32)
        for r0 in range(0, B, BR):
            rows = r0 + tl.arange(0, BR)
            m = (rows[:, None] < B) & cm[None, :]
            ptr = counts_ptr + rows[:, None] * C + cols[None, :]
            c = tl.load(ptr, mask=m, other=0)
            tl.store(ptr, tl.cumsum(c, axis=0) - c + carry[None, :], mask=m)
            carry += tl.sum(c, axis=0)
        tl.store(totals_ptr + cols, carry, mask=cm)


# compute_layout: each program lays out a contiguous chunk of tokens, in two launches. The
# first counts every chunk's tokens per expert and rank (one atomic add per id, nothing waits
# on them); the second sums the counts of the chunks before its own (the chunk's base rows),
# then walks its chunk block by block in token order. A (token, k)'s ordinal is its expert's
# running row plus the earlier (token, k) of the block that chose the same expert; each
# expert's last (token, k) in the block moves the running row on. compute_layout finds the
# earlier ones by sorting a block's (expert, token, k) keys (assign_block_sorted: ~N log^2 N
# ops for N = 512 entries); a send's few rows by pairwise compares (assign_block: N^2). (4096
# tokens, 256 experts, count + assign from CUDA graphs on one H200: 24 SMs 147.5 us with three
# launches of one-hot tiles, 56.7 pairwise in v17, 47.6 pairwise / 20.2 sorted in v43; 16 SMs
# 207.3 -> 76.2 -> 67.1 / 25.0; docs/perf.md.)
# The count launch also gives block_bases its counts (one 16-token block per chunk), and a
# bf16 or fp8 send under a budget walks its chunks itself (chunk_start, assign_block).
@triton.jit(do_not_specialize=["T", "CT", "NC"])
def _chunk_count_kernel(ids_ptr, stride_t, T, CT, NC, counts_ptr, K: tl.constexpr, L, E, R,
                        TB: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """counts [NC, E + R]: tokens of chunk c (tokens [c * CT, (c + 1) * CT)) per expert, then
    per destination rank."""
    e_idx = tl.arange(0, E_PAD)
    r_idx = tl.arange(0, R_PAD)
    for c in range(tl.program_id(0), NC, tl.num_programs(0)):
        row = counts_ptr + c * (E + R)
        tl.store(row + e_idx, tl.zeros((E_PAD,), dtype=tl.int32), mask=e_idx < E)
        tl.debug_barrier()  # every thread's zeros before any thread's atomics
        end = tl.minimum(T, (c + 1) * CT)
        per_rank = tl.zeros((R_PAD,), dtype=tl.int32)
        for t0 in range(c * CT, end, TB):
            ids, valid, goes = _block_ids(ids_ptr, stride_t, t0, end, K, L, E, TB, K_PAD, R_PAD)
            tl.atomic_add(row + tl.where(valid, ids, 0), 1, mask=valid, sem="relaxed")
            per_rank += tl.sum(goes, axis=0)
        tl.store(row + E + r_idx, per_rank, mask=r_idx < R)


@triton.jit(do_not_specialize=["T", "CT", "NC"])
def _chunk_assign_kernel(ids_ptr, stride_t, T, CT, NC, counts_ptr, running_ptr, slots_ptr, ordinals_ptr,
                         totals_ptr, K: tl.constexpr, L, E, R, BT: tl.constexpr, CR: tl.constexpr,
                         K_PAD: tl.constexpr, C_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """Slots and ordinals of chunk c's tokens (running [NC, E + R]: the chunk's rows so far);
    the last chunk's program writes the totals."""
    for c in range(tl.program_id(0), NC, tl.num_programs(0)):
        run_r = chunk_start(counts_ptr, running_ptr, totals_ptr, c, NC, E, R, CR, C_PAD, R_PAD)
        end = tl.minimum(T, (c + 1) * CT)
        for t0 in range(c * CT, end, BT):
            run_r = assign_block_sorted(ids_ptr, stride_t, t0, end, running_ptr + c * (E + R), run_r, slots_ptr,
                                        ordinals_ptr, K, L, E, R, BT, K_PAD, R_PAD)


@triton.jit
def chunk_start(counts_ptr, running_ptr, totals_ptr, c, NC, E, R, CR: tl.constexpr, C_PAD: tl.constexpr,
                R_PAD: tl.constexpr):
    """Start chunk c: its base rows (the counts [NC, E + R] of the chunks before it) go to
    running[c]; the last chunk also writes the totals. Returns the rows so far per destination
    rank [R_PAD]."""
    cols = tl.arange(0, C_PAD)
    cm = cols < E + R
    base = tl.zeros((C_PAD,), dtype=tl.int32)
    for r0 in range(0, c, CR):
        rows = r0 + tl.arange(0, CR)
        m = (rows[:, None] < c) & cm[None, :]
        base += tl.sum(tl.load(counts_ptr + rows[:, None] * (E + R) + cols[None, :], mask=m, other=0), axis=0)
    if c == NC - 1:
        own = tl.load(counts_ptr + c * (E + R) + cols, mask=cm, other=0)
        tl.store(totals_ptr + cols, base + own, mask=cm)
    run = running_ptr + c * (E + R)
    tl.store(run + cols, base, mask=cm)
    tl.debug_barrier()
    r_idx = tl.arange(0, R_PAD)
    return tl.load(run + E + r_idx, mask=r_idx < R, other=0, volatile=True)


@triton.jit
def assign_block(ids_ptr, stride_t, t0, end, run, run_r, slots_ptr, ordinals_ptr, K: tl.constexpr, L, E, R,
                 BT: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """Slots and ordinals of tokens [t0, t0 + BT) below end, from their chunk's running rows
    (run [E + R]: per expert, moved on here) and rows so far per rank run_r [R_PAD]. Returns
    run_r moved on; the stores are visible to the whole program when it returns."""
    tok = tl.reshape(tl.arange(0, BT)[:, None] + tl.zeros((K_PAD,), dtype=tl.int32)[None, :], (BT * K_PAD,))
    ids, valid, goes = _block_ids(ids_ptr, stride_t, t0, end, K, L, E, BT, K_PAD, R_PAD)
    f = tl.reshape(ids, (BT * K_PAD,))
    # one sum counts the same expert in earlier tokens (low field), in its own token (middle:
    # itself, more only if a token lists an expert twice) and in later ones (high): 10-bit
    # fields of an int32 where BT * K < 1024 (a GPU's blocks), else 21-bit ones of an int64
    FIELD: tl.constexpr = 10 if BT * K < 1024 else 21
    order = tl.where(tok[None, :] < tok[:, None], 1,
                     tl.where(tok[None, :] > tok[:, None], 1 << (2 * FIELD), 1 << FIELD))
    counts = tl.reshape(tl.sum(tl.where(f[:, None] == f[None, :], order, 0), axis=1), (BT, K_PAD))
    earlier = (counts & ((1 << FIELD) - 1)).to(tl.int32)
    upto = earlier + ((counts >> FIELD) & ((1 << FIELD) - 1)).to(tl.int32)
    later = counts >> (2 * FIELD)
    at = run + tl.where(valid, ids, 0)
    rows_e = tl.load(at, mask=valid, other=0, volatile=True)
    toks = t0 + tl.arange(0, BT)
    kk = tl.arange(0, K_PAD)
    tl.store(ordinals_ptr + toks[:, None] * K + kk[None, :], tl.where(valid, rows_e + earlier, -1),
             mask=(toks[:, None] < end) & (kk[None, :] < K))
    last = valid & (later == 0)  # the block's last (token, k) of its expert moves its row on
    # every warp has loaded the running rows before any warp moves one on: warps run apart, and
    # one loading after another's store would number its entries past this block's (wrong
    # ordinals now and then on a GPU, never in the interpreter, which runs a block as one)
    tl.debug_barrier()
    tl.store(at, rows_e + upto, mask=last)
    return _store_slots(goes, run_r, toks, end, slots_ptr, R, R_PAD)


@triton.jit
def _store_slots(goes, run_r, toks, end, slots_ptr, R, R_PAD: tl.constexpr):
    """A block's slots (goes [BT, R_PAD]: whether each token goes to each rank) from the rows
    so far per rank run_r, then a barrier (the block's stores before the next block's, or the
    send's, loads). Returns run_r moved on."""
    r_idx = tl.arange(0, R_PAD)
    before_r = tl.cumsum(goes, axis=0) - goes + run_r[None, :]
    tl.store(slots_ptr + toks[:, None] * R + r_idx[None, :], tl.where(goes > 0, before_r, -1),
             mask=(toks[:, None] < end) & (r_idx[None, :] < R))
    tl.debug_barrier()
    return run_r + tl.sum(goes, axis=0)


@triton.jit
def _same_key_count(k1, c1, k2, c2):
    """Combine of a segmented count over sorted keys: runs of one key count up from 1."""
    return k2, c2 + tl.where(k1 == k2, c1, 0)


@triton.jit
def assign_block_sorted(ids_ptr, stride_t, t0, end, run, run_r, slots_ptr, ordinals_ptr, K: tl.constexpr, L, E, R,
                        BT: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """:func:`assign_block` by a sort of the block's (expert, token, k) keys: each (token, k)'s
    ordinal is its expert's running row plus the entries of that expert in earlier tokens, which
    segmented counts over the sorted keys give (runs of the expert, less runs of the expert and
    token: a token that lists an expert twice gives both the same row, as assign_block does).
    The keys are int32: (E + 1) x BT x K_PAD must stay below 2^31 (compute_layout checks)."""
    N: tl.constexpr = BT * K_PAD
    ids, valid, goes = _block_ids(ids_ptr, stride_t, t0, end, K, L, E, BT, K_PAD, R_PAD)
    pos = tl.arange(0, N)
    # unused entries sort last, under a key no expert has
    key = tl.reshape(tl.where(valid, ids, E), (N,)) * N + pos
    s = tl.sort(key)
    one = tl.full((N,), 1, tl.int32)
    expert = s // N
    _, upto = tl.associative_scan((expert, one), 0, _same_key_count)
    _, own = tl.associative_scan((s // K_PAD, one), 0, _same_key_count)
    _, to_end = tl.associative_scan((expert, one), 0, _same_key_count, reverse=True)
    used = expert < E
    p = s % N
    tok = t0 + p // K_PAD
    at = run + tl.where(used, expert, 0)
    rows_e = tl.load(at, mask=used, other=0, volatile=True)
    tl.store(ordinals_ptr + tok * K + p % K_PAD, rows_e + upto - own, mask=used)
    tl.debug_barrier()  # every warp has loaded the running rows before any warp moves one on (see assign_block)
    tl.store(at, rows_e + upto, mask=used & (to_end == 1))  # the expert's last entry moves its row on
    # unused (token, k) of the block: -1
    toks = t0 + tl.arange(0, BT)
    kk = tl.arange(0, K_PAD)
    tl.store(ordinals_ptr + toks[:, None] * K + kk[None, :], -1,
             mask=(toks[:, None] < end) & (kk[None, :] < K) & ~valid)
    return _store_slots(goes, run_r, toks, end, slots_ptr, R, R_PAD)


@triton.jit
def _block_ids(ids_ptr, stride_t, t0, end, K: tl.constexpr, L, E, BT: tl.constexpr, K_PAD: tl.constexpr,
               R_PAD: tl.constexpr):
    """ids [BT, K_PAD] of tokens [t0, t0 + BT) below end (-1 where unused: masked, padding or
    outside [0, E), which the driver rejects before launching), which are used, and whether
    each token goes to each rank [BT, R_PAD] (int32)."""
    toks = t0 + tl.arange(0, BT)
    kk = tl.arange(0, K_PAD)
    mk = (toks[:, None] < end) & (kk[None, :] < K)
    ids = tl.load(ids_ptr + toks[:, None] * stride_t + kk[None, :], mask=mk, other=-1)
    valid = mk & (ids >= 0) & (ids < E)
    ids = tl.where(valid, ids, -1)
    dst = tl.where(valid, ids // L, -1)
    r_idx = tl.arange(0, R_PAD)
    goes = tl.max((dst[:, :, None] == r_idx[None, None, :]).to(tl.int32), axis=1)
    return ids, valid, goes


def _check_ids(topk_ids_TK: torch.Tensor, world_size: int, experts_per_rank: int) -> None:
    check_tensor("topk_ids_TK", topk_ids_TK, dims=2, dtypes=(torch.int32,), inner_contiguous=True)
    if world_size <= 0 or experts_per_rank <= 0:
        raise ValueError(f"world_size and experts_per_rank must be positive, got {world_size}, {experts_per_rank}")


def block_bases(*, topk_ids_TK: torch.Tensor, world_size: int, experts_per_rank: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(bases [B, E + R], totals [E + R]) for blocks of :func:`block_tokens` tokens, int32.

    ``bases[b]``: rows of the tokens before block b, per expert then per destination rank;
    ``totals``: the same over all T tokens (expert_counts then rank_counts). Two launches on
    every SM (the dispatch without a budget): counts per block, then a scan over blocks,
    column groups in parallel.
    """
    _check_ids(topk_ids_TK, world_size, experts_per_rank)
    T, K = topk_ids_TK.shape
    R, L = world_size, experts_per_rank
    E = R * L
    bt = block_tokens()
    B = max(1, cdiv(T, bt))
    dev = topk_ids_TK.device
    bases = torch.empty(B, E + R, dtype=torch.int32, device=dev)
    totals = torch.empty(E + R, dtype=torch.int32, device=dev)
    # the counts per block are chunk counts with one block per chunk
    launch(_chunk_count_kernel, work=B, device=dev, budget=None, resident=False,
           args=dict(ids_ptr=topk_ids_TK, stride_t=topk_ids_TK.stride(0), T=T, CT=bt, NC=B, counts_ptr=bases,
                     L=L, E=E, R=R),
           meta=dict(K=K, K_PAD=next_power_of_2(K), R_PAD=next_power_of_2(R), TB=bt,
                     E_PAD=next_power_of_2(E)))
    bc, br, warps = _scan_tile(B)
    launch(_scan_blocks_kernel, work=cdiv(E + R, bc), device=dev, budget=None, resident=False,
           args=dict(counts_ptr=bases, B=B, C=E + R, totals_ptr=totals), meta=dict(BR=br, BC=bc), warps=warps)
    return bases, totals


def _scan_tile(B: int) -> tuple[int, int, int]:
    """(columns, rows, warps) of a scan program over B blocks. On a GPU the scan is a chain of
    dependent loads, so few columns (more programs) and rows in tiles of up to 512: one H200,
    count + scan from CUDA graphs, 4096 tokens (B 256) over 4 ranks x 64 experts, 6.91 us at
    32 columns x 64 rows and 4 warps, 4.32 at 4 x 256 and 8; 8192 tokens (B 512) over 8 x 32,
    11.77 -> 6.26 at 4 x 512 and 8 (the count alone 2.0 / 3.6; docs/perf.md v44). The
    interpreter pays per program, so there wide columns."""
    if interpreted():
        return 32, 64, 4
    br = min(512, max(64, next_power_of_2(B)))
    return 4, br, 8 if br >= 256 else 4


# rows of earlier chunks' counts that chunk_start sums at once
CHUNK_ROWS = 8
# compute_layout's assign: tokens per sorted block, and warps (one H200, 4096 tokens x top-8 over
# 256 experts, count + assign from CUDA graphs, 24 / 16 SMs: 47.6 / 67.1 us with the pairwise
# assign_block at 16 tokens and 4 warps, its best of 8-64 tokens and 1-16 warps; sorted 30.4 /
# 41.7 at 16 tokens and 4 warps, 24.4 / 30.7 at 32 and 8, 20.2 / 25.0 at 64 and 8; docs/perf.md v43)
ASSIGN_TOKENS = 64
ASSIGN_WARPS = 8


def count_chunks(*, topk_ids_TK: torch.Tensor, world_size: int, experts_per_rank: int, programs: int,
                 multiple: int) -> tuple[torch.Tensor, int, int]:
    """First launch of a chunked layout: (counts_running [2, chunks, E + R] int32, chunk,
    chunks). ``programs`` chunks at most, each ``chunk`` tokens (a multiple of ``multiple``;
    the last may hold fewer); ``counts_running[0][c]`` holds chunk c's tokens per expert, then
    per destination rank. ``counts_running[1]`` is room for each chunk's running rows, filled
    by :func:`chunk_start` (``compute_layout``'s second launch, or a send that assigns its
    own chunks). The launch takes at most ``programs`` programs."""
    T, K = topk_ids_TK.shape
    R, L = world_size, experts_per_rank
    E = R * L
    chunk = cdiv(cdiv(max(T, 1), programs), multiple) * multiple
    chunks = cdiv(max(T, 1), chunk)
    counts_running = torch.empty(2, chunks, E + R, dtype=torch.int32, device=topk_ids_TK.device)
    launch(_chunk_count_kernel, work=chunks, device=topk_ids_TK.device, budget=programs, resident=False,
           args=dict(ids_ptr=topk_ids_TK, stride_t=topk_ids_TK.stride(0), T=T, CT=chunk, NC=chunks,
                     counts_ptr=counts_running[0], L=L, E=E, R=R),
           meta=dict(K=K, K_PAD=next_power_of_2(K), R_PAD=next_power_of_2(R), TB=4 * block_tokens(),
                     E_PAD=next_power_of_2(E)))
    return counts_running, chunk, chunks


def compute_layout(*, topk_ids_TK: torch.Tensor, world_size: int, experts_per_rank: int,
                   num_sms: int | None = None) -> DispatchLayout:
    """Send-side layout of ``topk_ids_TK`` [T, K] int32 (see the module docstring).

    Two launches of at most ``num_sms`` programs (a dispatch under an SM budget; every SM
    when None), each program a contiguous chunk of tokens: counts per chunk, then each chunk
    assigns its tokens from the counts of the chunks before it. Ids outside [0, E) are
    treated as unused. (A bf16 or fp8 dispatch lays out its tokens inside its send: this is
    for an nvfp4 dispatch under a budget, callers that want the layout alone, and the NCCL
    pipeline.)
    """
    _check_ids(topk_ids_TK, world_size, experts_per_rank)
    T, K = topk_ids_TK.shape
    R, L = world_size, experts_per_rank
    E = R * L
    dev = topk_ids_TK.device
    slots = torch.empty(T, R, dtype=torch.int32, device=dev)
    ordinals = torch.empty(T, K, dtype=torch.int32, device=dev)
    totals = torch.empty(E + R, dtype=torch.int32, device=dev)
    if T == 0:
        totals.zero_()
        return DispatchLayout(slots, ordinals, totals[:E], totals[E:])
    bt = ASSIGN_TOKENS
    most = (2**31 - 1) // (bt * next_power_of_2(K)) - 1  # the sorted assign's int32 keys
    if E > most:
        raise ValueError(f"compute_layout supports up to {most} experts at top-{K}, got {E}")
    counts_running, chunk, chunks = count_chunks(topk_ids_TK=topk_ids_TK, world_size=R, experts_per_rank=L,
                                                 programs=num_sms or sm_count(dev), multiple=bt)
    launch(_chunk_assign_kernel, work=chunks, device=dev, budget=num_sms, resident=False,
           args=dict(ids_ptr=topk_ids_TK, stride_t=topk_ids_TK.stride(0), T=T, CT=chunk, NC=chunks,
                     counts_ptr=counts_running[0], running_ptr=counts_running[1], slots_ptr=slots,
                     ordinals_ptr=ordinals, totals_ptr=totals, L=L, E=E, R=R),
           meta=dict(K=K, K_PAD=next_power_of_2(K), R_PAD=next_power_of_2(R), BT=bt, CR=CHUNK_ROWS,
                     C_PAD=next_power_of_2(E + R)), warps=ASSIGN_WARPS)
    return DispatchLayout(slots, ordinals, totals[:E], totals[E:])


def compute_layout_torch(*, topk_ids_TK: torch.Tensor, world_size: int, experts_per_rank: int) -> DispatchLayout:
    """Torch twin of :func:`compute_layout`."""
    _check_ids(topk_ids_TK, world_size, experts_per_rank)
    T, K = topk_ids_TK.shape
    R, L = world_size, experts_per_rank
    E = R * L
    ids = topk_ids_TK.long()
    valid = (ids >= 0) & (ids < E)
    safe = torch.where(valid, ids, 0)
    exp1h = torch.zeros(T, E, dtype=torch.int64, device=ids.device)
    exp1h.scatter_add_(1, safe, valid.long())
    rank1h = torch.zeros(T, R, dtype=torch.int64, device=ids.device)
    rank1h.scatter_add_(1, safe // L, valid.long())
    rank1h = (rank1h > 0).long()
    before_e = exp1h.cumsum(0) - exp1h
    before_r = rank1h.cumsum(0) - rank1h
    slots = torch.where(rank1h > 0, before_r, -1)
    ordinals = torch.where(valid, before_e.gather(1, safe), -1)
    return DispatchLayout(slots.int(), ordinals.int(), exp1h.sum(0).int(), rank1h.sum(0).int())


def block_bases_torch(*, topk_ids_TK: torch.Tensor, world_size: int, experts_per_rank: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`block_bases`."""
    _check_ids(topk_ids_TK, world_size, experts_per_rank)
    T = topk_ids_TK.shape[0]
    lay = compute_layout_torch(topk_ids_TK=topk_ids_TK, world_size=world_size, experts_per_rank=experts_per_rank)
    E = world_size * experts_per_rank
    ids = topk_ids_TK.long()
    valid = (ids >= 0) & (ids < E)
    per_token = torch.zeros(T, E + world_size, dtype=torch.int64, device=ids.device)
    per_token.scatter_add_(1, torch.where(valid, ids, 0), valid.long())
    per_token[:, E:] = (lay.token_slots_TR >= 0).long()
    bt = block_tokens()
    B = max(1, cdiv(T, bt))
    blocks = torch.zeros(B * bt, E + world_size, dtype=torch.int64, device=ids.device)
    blocks[:T] = per_token
    sums = blocks.view(B, bt, -1).sum(1)
    bases = sums.cumsum(0) - sums
    return bases.int(), torch.cat([lay.expert_counts_E, lay.rank_counts_R])

