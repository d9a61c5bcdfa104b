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
from ._util import interpreted, launch


def block_tokens() -> int:
    """Tokens per layout block. 16 on a GPU: the assign kernel measured fastest there (22 us
    against 33 us at 32 for 4096 tokens, 256 experts), and a send that lays out its own tokens
    scans at most 15 earlier ones. In the interpreter, bigger blocks (numpy likes big arrays)."""
    return 64 if interpreted() else 16


@triton.jit
def _token_onehots(ids_ptr, stride_t, t0, T, K: tl.constexpr, L, E, R,
                   BT: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """One-hot of a block's experts [BT, E_PAD] and destination ranks [BT, R_PAD] (int32)."""
    toks = t0 + tl.arange(0, BT)
    e_idx = tl.arange(0, E_PAD)
    r_idx = tl.arange(0, R_PAD)
    exp1h = tl.zeros((BT, E_PAD), dtype=tl.int32)
    rank1h = tl.zeros((BT, R_PAD), dtype=tl.int32)
    for k in tl.static_range(K):
        ids = tl.load(ids_ptr + toks * stride_t + k, mask=toks < T, other=-1)
        # ids outside [0, E) are skipped (the driver rejects them before launching)
        valid = (ids >= 0) & (ids < E)
        exp1h += ((ids[:, None] == e_idx[None, :]) & valid[:, None]).to(tl.int32)
        dst = tl.where(valid, ids // L, -1)
        rank1h = tl.maximum(rank1h, (dst[:, None] == r_idx[None, :]).to(tl.int32))
    return exp1h, rank1h


# The kernels loop over their blocks with the grid's stride, so an SM budget caps the grid
# (launch) and any grid is correct. T and B unspecialised: no recompile per batch size.
@triton.jit(do_not_specialize=["T", "B"])
def _layout_count_kernel(ids_ptr, stride_t, T, B, block_counts_ptr, K: tl.constexpr, L, E, R,
                         BT: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr):
    # block_counts [B, E + R]: tokens of each block per expert, then per destination rank
    e_idx = tl.arange(0, E_PAD)
    r_idx = tl.arange(0, R_PAD)
    for blk in range(tl.program_id(0), B, tl.num_programs(0)):
        exp1h, rank1h = _token_onehots(ids_ptr, stride_t, blk * BT, T, K, L, E, R, BT, E_PAD, R_PAD)
        row = block_counts_ptr + blk * (E + R)
        tl.store(row + e_idx, tl.sum(exp1h, axis=0), mask=e_idx < E)
        tl.store(row + E + r_idx, tl.sum(rank1h, axis=0), mask=r_idx < R)


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


@triton.jit(do_not_specialize=["T", "B"])
def _layout_assign_kernel(ids_ptr, stride_t, T, B, bases_ptr, slots_ptr, ordinals_ptr, totals_ptr,
                          K: tl.constexpr, L, E, R, HAS_BASES: tl.constexpr,
                          BT: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr):
    for blk in range(tl.program_id(0), B, tl.num_programs(0)):
        _assign_block(ids_ptr, stride_t, T, blk, bases_ptr, slots_ptr, ordinals_ptr, totals_ptr, K, L, E, R,
                      HAS_BASES, BT, E_PAD, R_PAD)


@triton.jit
def _assign_block(ids_ptr, stride_t, T, blk, bases_ptr, slots_ptr, ordinals_ptr, totals_ptr,
                  K: tl.constexpr, L, E, R, HAS_BASES: tl.constexpr,
                  BT: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """Slots and ordinals of block blk's tokens from its base row (the totals when it is the
    only block)."""
    t0 = blk * BT
    toks = t0 + tl.arange(0, BT)
    e_idx = tl.arange(0, E_PAD)
    r_idx = tl.arange(0, R_PAD)
    if HAS_BASES:  # rows of the blocks before this one (block_bases)
        base_e = tl.load(bases_ptr + blk * (E + R) + e_idx, mask=e_idx < E, other=0)
        base_r = tl.load(bases_ptr + blk * (E + R) + E + r_idx, mask=r_idx < R, other=0)
    else:
        base_e = tl.zeros((E_PAD,), dtype=tl.int32)
        base_r = tl.zeros((R_PAD,), dtype=tl.int32)
    exp1h, rank1h = _token_onehots(ids_ptr, stride_t, t0, T, K, L, E, R, BT, E_PAD, R_PAD)
    # rows before token t in this block, per expert / rank (exclusive scan over tokens)
    before_e = tl.cumsum(exp1h, axis=0) - exp1h + base_e[None, :]
    before_r = tl.cumsum(rank1h, axis=0) - rank1h + base_r[None, :]
    slots = tl.where(rank1h > 0, before_r, -1)
    tl.store(slots_ptr + toks[:, None] * R + r_idx[None, :], slots,
             mask=(toks[:, None] < T) & (r_idx[None, :] < R))
    for k in tl.static_range(K):
        ids = tl.load(ids_ptr + toks * stride_t + k, mask=toks < T, other=-1)
        valid = (ids >= 0) & (ids < E)
        hit = (ids[:, None] == e_idx[None, :]) & valid[:, None]
        ordinal = tl.sum(tl.where(hit, before_e, 0), axis=1)
        tl.store(ordinals_ptr + toks * K + k, tl.where(valid, ordinal, -1), mask=toks < T)
    if not HAS_BASES:  # a single block: its sums are the totals
        tl.store(totals_ptr + e_idx, tl.sum(exp1h, axis=0), mask=e_idx < E)
        tl.store(totals_ptr + E + r_idx, tl.sum(rank1h, axis=0), mask=r_idx < R)


def _check_ids(topk_ids_TK: torch.Tensor, world_size: int, experts_per_rank: int) -> None:
    check_tensor("topk_ids_TK", topk_ids_TK, dims=2, dtypes=(torch.int32,), inner_contiguous=True)
    if world_size <= 0 or experts_per_rank <= 0:
        raise ValueError(f"world_size and experts_per_rank must be positive, got {world_size}, {experts_per_rank}")


def block_bases(*, topk_ids_TK: torch.Tensor, world_size: int, experts_per_rank: int, num_sms: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(bases [B, E + R], totals [E + R]) for blocks of :func:`block_tokens` tokens, int32.

    ``bases[b]``: rows of the tokens before block b, per expert then per destination rank;
    ``totals``: the same over all T tokens (expert_counts then rank_counts). Two launches
    (counts per block, then a scan over blocks, column groups in parallel), each on at most
    ``num_sms`` programs when given.
    """
    _check_ids(topk_ids_TK, world_size, experts_per_rank)
    T, K = topk_ids_TK.shape
    R, L = world_size, experts_per_rank
    E = R * L
    bt = block_tokens()
    B = max(1, triton.cdiv(T, bt))
    dev = topk_ids_TK.device
    bases = torch.empty(B, E + R, dtype=torch.int32, device=dev)
    totals = torch.empty(E + R, dtype=torch.int32, device=dev)
    launch(_layout_count_kernel, work=B, device=dev, budget=num_sms, resident=False,
           args=dict(ids_ptr=topk_ids_TK, stride_t=topk_ids_TK.stride(0), T=T, B=B, block_counts_ptr=bases,
                     L=L, E=E, R=R),
           meta=dict(K=K, BT=bt, E_PAD=triton.next_power_of_2(E), R_PAD=triton.next_power_of_2(R)))
    bc = 32
    launch(_scan_blocks_kernel, work=triton.cdiv(E + R, bc), device=dev, budget=num_sms, resident=False,
           args=dict(counts_ptr=bases, B=B, C=E + R, totals_ptr=totals), meta=dict(BR=64, BC=bc))
    return bases, totals


def compute_layout(*, topk_ids_TK: torch.Tensor, world_size: int, experts_per_rank: int,
                   num_sms: int | None = None) -> DispatchLayout:
    """Send-side layout of ``topk_ids_TK`` [T, K] int32 (see the module docstring).

    Three launches when T spans several blocks (:func:`block_bases`, then each block assigns
    its tokens from its base row), one when it fits a block; each on at most ``num_sms``
    programs when given (a dispatch under an SM budget). Ids outside [0, E) are treated
    as unused. (The dispatch itself lays out its tokens inside the send: this is for callers
    that want the layout alone, and the NCCL pipeline.)
    """
    _check_ids(topk_ids_TK, world_size, experts_per_rank)
    T, K = topk_ids_TK.shape
    R, L = world_size, experts_per_rank
    E = R * L
    dev = topk_ids_TK.device
    slots = torch.empty(T, R, dtype=torch.int32, device=dev)
    ordinals = torch.empty(T, K, dtype=torch.int32, device=dev)
    if T == 0:
        totals = torch.zeros(E + R, dtype=torch.int32, device=dev)
        return DispatchLayout(slots, ordinals, totals[:E], totals[E:])
    bt = block_tokens()
    B = triton.cdiv(T, bt)
    if B > 1:
        bases, totals = block_bases(topk_ids_TK=topk_ids_TK, world_size=R, experts_per_rank=L, num_sms=num_sms)
    else:
        totals = torch.empty(E + R, dtype=torch.int32, device=dev)  # the single block writes it
        bases = totals  # unused
    launch(_layout_assign_kernel, work=B, device=dev, budget=num_sms, resident=False,
           args=dict(ids_ptr=topk_ids_TK, stride_t=topk_ids_TK.stride(0), T=T, B=B, bases_ptr=bases, slots_ptr=slots,
                     ordinals_ptr=ordinals, totals_ptr=totals, L=L, E=E, R=R),
           meta=dict(K=K, HAS_BASES=B > 1, BT=bt, E_PAD=triton.next_power_of_2(E), R_PAD=triton.next_power_of_2(R)))
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
    B = max(1, -(-T // bt))
    blocks = torch.zeros(B * bt, E + world_size, dtype=torch.int64, device=ids.device)
    blocks[:T] = per_token
    sums = blocks.view(B, bt, -1).sum(1)
    bases = sums.cumsum(0) - sums
    return bases.int(), torch.cat([lay.expert_counts_E, lay.rank_counts_R])

