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
:func:`ray_ep.reference.dispatch` row for row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._util import check_tensor, interpreted


@dataclass(frozen=True)
class DispatchLayout:
    """Send-side layout of one dispatch (all int32, on the tokens' device)."""

    token_slots_TR: torch.Tensor
    ordinals_TK: torch.Tensor
    expert_counts_E: torch.Tensor
    rank_counts_R: torch.Tensor


def _block_tokens(E: int, R: int) -> int:
    """Tokens per program: keep the [tokens, experts] one-hot tile near 8K elements on a GPU."""
    if interpreted():
        return 64
    return max(1, min(128, 8192 // triton.next_power_of_2(max(E, R))))


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


@triton.jit(do_not_specialize=["T"])
def _layout_count_kernel(ids_ptr, stride_t, T, block_counts_ptr, K: tl.constexpr, L, E, R,
                         BT: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr):
    # block_counts [B, E + R]: tokens of this block per expert, then per destination rank
    pid = tl.program_id(0)
    exp1h, rank1h = _token_onehots(ids_ptr, stride_t, pid * BT, T, K, L, E, R, BT, E_PAD, R_PAD)
    row = block_counts_ptr + pid * (E + R)
    e_idx = tl.arange(0, E_PAD)
    r_idx = tl.arange(0, R_PAD)
    tl.store(row + e_idx, tl.sum(exp1h, axis=0), mask=e_idx < E)
    tl.store(row + E + r_idx, tl.sum(rank1h, axis=0), mask=r_idx < R)


@triton.jit(do_not_specialize=["T"])
def _layout_assign_kernel(ids_ptr, stride_t, T, base_ptr, slots_ptr, ordinals_ptr, totals_ptr,
                          K: tl.constexpr, L, E, R, HAS_BASE: tl.constexpr,
                          BT: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr, BB: tl.constexpr):
    pid = tl.program_id(0)
    t0 = pid * BT
    toks = t0 + tl.arange(0, BT)
    e_idx = tl.arange(0, E_PAD)
    r_idx = tl.arange(0, R_PAD)
    base_e = tl.zeros((E_PAD,), dtype=tl.int32)
    base_r = tl.zeros((R_PAD,), dtype=tl.int32)
    if HAS_BASE:
        # rows of the earlier blocks, summed here from their counts (base_ptr [B, E + R]):
        # a few L2 reads instead of a scan launch between the two kernels
        for b0 in range(0, pid, BB):
            rows = b0 + tl.arange(0, BB)
            m = rows[:, None] < pid
            row = base_ptr + rows[:, None] * (E + R)
            base_e += tl.sum(tl.load(row + e_idx[None, :], mask=m & (e_idx[None, :] < E), other=0), axis=0)
            base_r += tl.sum(tl.load(row + E + r_idx[None, :], mask=m & (r_idx[None, :] < R), other=0), axis=0)
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
    if pid == tl.num_programs(0) - 1:  # the last block knows the totals
        tl.store(totals_ptr + e_idx, base_e + tl.sum(exp1h, axis=0), mask=e_idx < E)
        tl.store(totals_ptr + E + r_idx, base_r + tl.sum(rank1h, axis=0), mask=r_idx < R)


def _check_ids(topk_ids_TK: torch.Tensor, world_size: int, experts_per_rank: int) -> None:
    check_tensor("topk_ids_TK", topk_ids_TK, dims=2, dtypes=(torch.int32,), inner_contiguous=True)
    if world_size <= 0 or experts_per_rank <= 0:
        raise ValueError(f"world_size and experts_per_rank must be positive, got {world_size}, {experts_per_rank}")


def compute_layout(*, topk_ids_TK: torch.Tensor, world_size: int, experts_per_rank: int) -> DispatchLayout:
    """Send-side layout of ``topk_ids_TK`` [T, K] int32 (see the module docstring).

    Two launches when T spans several blocks (block counts, then the assignment, each block
    summing the counts of the blocks before it), one when it fits a block. Ids outside [0, E)
    are treated as unused. (Small batches skip this: the send lays them out itself.)
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
    totals = torch.empty(E + R, dtype=torch.int32, device=dev)  # the last block writes all of it
    bt = _block_tokens(E, R)
    B = triton.cdiv(T, bt)
    e_pad, r_pad = triton.next_power_of_2(E), triton.next_power_of_2(R)
    stride_t = topk_ids_TK.stride(0)
    counts = totals  # unused placeholder when there is a single block
    if B > 1:
        counts = torch.empty(B, E + R, dtype=torch.int32, device=dev)
        _layout_count_kernel[(B,)](topk_ids_TK, stride_t, T, counts, K=K, L=L, E=E, R=R,
                                   BT=bt, E_PAD=e_pad, R_PAD=r_pad)
    _layout_assign_kernel[(B,)](topk_ids_TK, stride_t, T, counts, slots, ordinals, totals,
                                K=K, L=L, E=E, R=R, HAS_BASE=B > 1, BT=bt, E_PAD=e_pad, R_PAD=r_pad,
                                BB=16 if E + R > 256 else 64)
    return DispatchLayout(slots, ordinals, totals[:E], totals[E:])


def compute_layout_ref(*, topk_ids_TK: torch.Tensor, world_size: int, experts_per_rank: int) -> DispatchLayout:
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
