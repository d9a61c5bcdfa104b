"""Combine: return expert outputs to their source tokens and form the router-weighted sum.

Legend: T tokens on this rank, K top-k, R ranks, L local experts, H hidden, N = N_max,
M expert-major rows.

Send (on the rank that ran the experts): for each received row (s, i) it sums, in fp32, the
outputs of the row's local experts weighted by their router weights, and stores that one
partial row (combine dtype) at row ``me * N + i`` of source s's ``combine.recv`` buffer; so
combine moves one row per (token, rank), the same bytes as dispatch. The last program
releases ``signal[me] = epoch + 1`` on every source (the fused form within one node with
every SM: each program flags its blocks of rows instead, see :func:`_flag_blocks`). On a Hopper
GPU under an SM budget of at most half its SMs, the push send within one node is the Gluon
kernel of :mod:`ray_ep.kernels.combine_sm90` (the same bits, a bulk copy per live slot); in the
fused form from ``OVERLAP_MIN_SMS`` SMs on it flags each block of rows it stores, and the
receive runs beside it on part of the budget (:func:`_overlapped_combine`; on every rank or
none, see :func:`overlaps`).

Receive (on the source): wait for every rank's signal (or the blocks a block of tokens sums), then
``out[t] = sum_d recv[d * N + token_slots[t, d]] (+ add[t])`` in fp32, cast to the output
dtype. ``add_TH`` is the elementwise epilogue: shared-expert output or a residual.

Example (R = 2, token 0 with experts on both ranks, weights 0.25 / 0.75, rank 1 holding two
of its experts with outputs y1, y2 and weights 0.5, 0.25): rank 1 sends
0.5 * y1 + 0.25 * y2, rank 0 sends 0.25 * y0, and token 0's output is their sum.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from ..config import PULL_BLOCK_ROWS, EPConfig
from ..errors import EPInputError
from ..types import DispatchHandle
from ..validation import check_tensor
from ._shmem import other_node, put_bytes, quiet, signal, staged
from ._sync import (at_offset, last_program_done, peer_bases, peer_ptr, release_signals, timed_out, wait_blocks,
                    wait_signals)
from ._util import (cdiv, comm_tile, fused_as_two_launches, interpreted, launch, next_power_of_2, num_sms as sm_count,
                    remote_meta, side_stream, timeouts, tma_addressable)
from . import combine_sm90 as sm90
from .buffers import (COUNTER_COMBINE_RECV, COUNTER_COMBINE_SEND, EPOCH_COMBINE, STATUS_TIMEOUT,
                      SymmetricBuffers, Workspace, check_status)
from .pairs import join_pairs, pair_ptr, unpack_pairs


# ---- device code ---------------------------------------------------------------------------
@triton.jit
def _combine_rows(y_ptr, stride_y, meta_ptr, src_offsets_ptr, recv_counts_ptr, peer_bases_ptr, off_x, off_sx,
                  off_ready, epoch, rank, R, L, N, H, ranks_per_node, K: tl.constexpr, R_PAD: tl.constexpr,
                  BJ: tl.constexpr,
                  BLOCK_H: tl.constexpr, OUT_DTYPE: tl.constexpr, XB: tl.constexpr, REMOTE: tl.constexpr,
                  EMULATE: tl.constexpr, PULL: tl.constexpr, PB: tl.constexpr, Y_PAIRS: tl.constexpr,
                  FLAGS: tl.constexpr = False):
    """Weighted partial sum of each received row's local experts, stored back at its source
    (on this node), or staged in this rank's ``combine.send`` rows and put to it (other nodes);
    PULL: kept in this rank's own ``combine.recv`` rows, where the sources load it, each block
    announced to its source (flag ``epoch + 1``) once stored (BJ == PB rows). FLAGS (a push
    within one node): once all its rows are stored, the program flags each of its blocks on
    its source, so a source's tokens wait for the blocks they sum, not for whole ranks."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # consecutive blocks belong to different sources, so every wave of programs writes to
    # every peer at once (one peer at a time measured 540 us against 503 us for prefill), and
    # rank r starts with source r + 1 so the ranks do not all begin on one peer
    p_idx = tl.arange(0, R_PAD)
    rows = tl.load(recv_counts_ptr + (p_idx + rank + 1) % R, mask=p_idx < R, other=0)
    counts = ()  # the same as scalars, by source
    for d in tl.static_range(R_PAD):
        counts = counts + (tl.load(recv_counts_ptr + d, mask=d < R, other=0),)
    blocks = tl.max((rows + BJ - 1) // BJ, axis=0) * R
    for b in range(pid, blocks, nprog):
        pos_b = b % R
        src = (pos_b + rank + 1) % R
        first = (b // R) * BJ
        if BJ > 1:  # whole-SM programs: selects, not a reduction through shared memory (barriers)
            n_src = counts[0]
            for d in tl.static_range(1, R_PAD):
                n_src = tl.where(src == d, counts[d], n_src)
        else:  # selects measured slower here (decode combine, 4x H200: 32.5 -> 34.4 us)
            n_src = tl.sum(tl.where(p_idx == pos_b, rows, 0), axis=0)
        if first < n_src:  # sources with fewer blocks leave gaps
            _combine_block(y_ptr, stride_y, meta_ptr, src_offsets_ptr, peer_bases_ptr, off_x, off_sx, src, first,
                           n_src, rank, L, N, H, ranks_per_node, K, BJ, BLOCK_H, OUT_DTYPE, XB, REMOTE, EMULATE,
                           PULL, Y_PAIRS)
            if PULL:  # every thread's rows are stored: tell the source this block is ready
                tl.debug_barrier()
                flag = peer_ptr(peer_bases_ptr, src, off_ready, tl.int64) + rank * ((N + PB - 1) // PB) + first // PB
                tl.atomic_xchg(flag, epoch + 1, sem="release", scope="sys")
    if REMOTE:
        quiet(EMULATE)  # delivered before this program counts itself done (the signals follow)
    if FLAGS:
        _flag_blocks(recv_counts_ptr, peer_bases_ptr, off_ready, epoch, rank, R, N, blocks, BJ)


@triton.jit
def _flag_blocks(recv_counts_ptr, peer_bases_ptr, off_ready, epoch, rank, R, N, total, BJ: tl.constexpr):
    """Flag ``epoch + 1`` for each block of rows this program stored (the blocks of
    :func:`_combine_rows`' loop): at ``ready[rank, first // BJ]`` of the block's source, 32
    blocks per release (one after a CTA barrier covers every thread's stores before it)."""
    tl.debug_barrier()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for b0 in range(pid, total, nprog * 32):
        b = b0 + nprog * tl.arange(0, 32)
        src = (b % R + rank + 1) % R
        first = (b // R) * BJ
        ok = (b < total) & (first < tl.load(recv_counts_ptr + src, mask=b < total, other=0))
        base = tl.load(peer_bases_ptr + src, mask=ok, other=0)
        flag = (base + off_ready).to(tl.pointer_type(tl.int64)) + rank * N + first // BJ
        tl.atomic_xchg(flag, tl.zeros((32,), dtype=tl.int64) + epoch + 1, mask=ok, sem="release", scope="sys")


@triton.jit
def _combine_block(y_ptr, stride_y, meta_ptr, src_offsets_ptr, peer_bases_ptr, off_x, off_sx, src, first, n_src,
                   rank, L, N, H, ranks_per_node, K: tl.constexpr, BJ: tl.constexpr,
                   BLOCK_H: tl.constexpr,
                   OUT_DTYPE: tl.constexpr, XB: tl.constexpr, REMOTE: tl.constexpr, EMULATE: tl.constexpr,
                   PULL: tl.constexpr, Y_PAIRS: tl.constexpr):
    """Rows first .. first + BJ - 1 (below n_src) of those received from ``src``."""
    i = first + tl.arange(0, BJ)
    live = i < n_src
    j = (src * N + i).to(tl.int64)
    meta = meta_ptr + j * (3 * K)
    # each slot's expert row and weight as a [BJ] vector, once per block, not reduced out of a
    # [BJ, K] tile: those reductions went through shared memory, 16 barriers of all the
    # program's warps per block (sm_90, 8 rows, 32 warps: an SM budget)
    rows_k = ()
    has_k = ()
    w_k = ()
    for k in tl.static_range(K):
        ids = tl.load(meta + k, mask=live, other=-1)
        e = ids - rank * L
        here = live & (ids >= 0) & (e >= 0) & (e < L)
        pos = tl.load(src_offsets_ptr + src * L + e, mask=here, other=0) + tl.load(meta + K + k, mask=here, other=0)
        rows_k = rows_k + (y_ptr + pos.to(tl.int64) * stride_y,)
        has_k = has_k + (here,)
        w_k = w_k + (tl.load(meta + 2 * K + k, mask=here, other=0).to(tl.float32, bitcast=True),)
    if PULL:  # this rank's own row src * N + i: the source loads it
        dst = peer_ptr(peer_bases_ptr, rank, off_x, OUT_DTYPE) + j[:, None] * H
    elif other_node(rank, src, ranks_per_node):  # the staging row that mirrors the destination row
        dst = peer_ptr(peer_bases_ptr, rank, off_sx, OUT_DTYPE) + j[:, None] * H
    else:
        dst = peer_ptr(peer_bases_ptr, src, off_x, OUT_DTYPE) + (rank * N + i)[:, None].to(tl.int64) * H
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cm = cols < H
        # unrolled over the K slots: the loads of all local experts are in flight at once
        if Y_PAIRS:
            pairs = h0 // 2 + tl.arange(0, BLOCK_H // 2)
            pm = pairs < H // 2
            even = tl.zeros((BJ, BLOCK_H // 2), dtype=tl.float32)
            odd = tl.zeros((BJ, BLOCK_H // 2), dtype=tl.float32)
            for k in tl.static_range(K):
                y_even, y_odd = unpack_pairs(tl.load(pair_ptr(rows_k[k])[:, None] + pairs[None, :],
                                                     mask=has_k[k][:, None] & pm[None, :], other=0))
                even += w_k[k][:, None] * y_even
                odd += w_k[k][:, None] * y_odd
            acc = join_pairs(even, odd)
        else:
            acc = tl.zeros((BJ, BLOCK_H), dtype=tl.float32)
            for k in tl.static_range(K):
                yk = tl.load(rows_k[k][:, None] + cols[None, :], mask=has_k[k][:, None] & cm[None, :], other=0.0)
                acc += w_k[k][:, None] * yk.to(tl.float32)
        tl.store(dst + cols[None, :], acc.to(OUT_DTYPE), mask=live[:, None] & cm[None, :])
    if REMOTE:
        if other_node(rank, src, ranks_per_node):
            staged(EMULATE)
            n = tl.minimum(n_src - first, BJ)
            put_bytes(peer_bases_ptr, rank, src, off_x + (rank * N + first).to(tl.int64) * H * XB,
                      off_sx + (src * N + first).to(tl.int64) * H * XB, n * H * XB, EMULATE)


@triton.jit
def _signal_all(peer_bases_ptr, off_signal, rank, R, ranks_per_node, value, R_PAD: tl.constexpr, REMOTE: tl.constexpr,
                EMULATE: tl.constexpr):
    tl.debug_barrier()
    release_signals(peer_bases_ptr, R, ranks_per_node, off_signal, rank, value, R_PAD)
    if REMOTE:
        for s in range(R):
            if other_node(rank, s, ranks_per_node):
                signal(peer_bases_ptr, rank, s, off_signal + rank * 8, value, EMULATE)


@triton.jit
def _block_slots(slots_ptr, blk, T, R, R_PAD: tl.constexpr, BT: tl.constexpr):
    """[BT, R_PAD] slots of block ``blk``'s tokens on each rank (-1: none, or past T)."""
    toks = blk * BT + tl.arange(0, BT)
    dd = tl.arange(0, R_PAD)
    return tl.load(slots_ptr + toks[:, None] * R + dd[None, :], mask=(toks[:, None] < T) & (dd[None, :] < R),
                   other=-1)


@triton.jit
def _row_sources(recv_ptr, slots_ptr, toks, tm, R, N, H, bases, off_x, rank, R_PAD: tl.constexpr,
                 PULL: tl.constexpr):
    """(address, present) of each rank's row of every token in ``toks``, once per block of
    tokens: in the channel loop, the slot and (pulling) block address loads would come again
    before each row load that needs them."""
    srcs = ()
    oks = ()
    for d in tl.static_range(R_PAD):
        slot = tl.load(slots_ptr + toks * R + d, mask=tm & (d < R), other=-1)
        if PULL:
            src = at_offset(bases[d], off_x, recv_ptr.dtype.element_ty) + (rank * N + slot).to(tl.int64) * H
        else:
            src = recv_ptr + (d * N + slot).to(tl.int64) * H
        srcs = srcs + (src,)
        oks = oks + (slot >= 0,)
    return srcs, oks


@triton.jit
def _sum_rows(recv_ptr, slots_ptr, add_ptr, stride_add, out_ptr, stride_out, T, N, H, R, peer_bases_ptr, off_x, rank,
              ready_ptr, target, status_ptr, timeout_ns, max_spins,
              R_PAD: tl.constexpr, HAS_ADD: tl.constexpr, BT: tl.constexpr, BLOCK_H: tl.constexpr,
              PULL: tl.constexpr, PB: tl.constexpr, USE_TIMER: tl.constexpr, FLAGS: tl.constexpr = False):
    """out[t] = sum over ranks d of recv[d * N + slot[t, d]] (+ add[t]), fp32 accumulation;
    PULL: of rank d's own row ``rank * N + slot[t, d]``, loaded from its block over NVLink once
    d has flagged the blocks of rows this block of tokens needs (BT <= PB: a token block's
    slots on d are consecutive, so they span at most two of d's blocks). FLAGS (push): the
    same wait, on the flags of d's blocks of PB rows (``ready[d, block]``, N of them per rank)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    bases = peer_bases(peer_bases_ptr, R, R_PAD)  # pulling: where each rank's rows are (a push never reads them)
    dd = tl.arange(0, R_PAD)
    if PULL or FLAGS:  # the wait's bounds: this block's slots, loaded while the previous block is added
        sl_next = _block_slots(slots_ptr, pid, T, R, R_PAD, BT)
    for blk in range(pid, tl.cdiv(T, BT), nprog):
        toks = blk * BT + tl.arange(0, BT)
        tm = toks < T
        # a token per program (decode): its rows' addresses before the wait, whose acquire
        # empties L1 (after it, they are one more round trip before the first row load: 4x
        # H200 decode combine -0.3 to -0.7 us); a block of tokens holds them after it (held
        # across the wait they cost its sum 3% under an SM budget)
        if BT == 1:
            srcs, oks = _row_sources(recv_ptr, slots_ptr, toks, tm, R, N, H, bases, off_x, rank, R_PAD, PULL)
        h_end = H
        if PULL or FLAGS:
            sl = sl_next
            sl_next = _block_slots(slots_ptr, blk + nprog, T, R, R_PAD, BT)
            hi = tl.max(sl, axis=0)
            lo = tl.min(tl.where(sl >= 0, sl, N), axis=0)
            flags = ready_ptr + dd * (N if FLAGS else (N + PB - 1) // PB)
            ready = wait_blocks(flags + lo // PB, flags + hi // PB, hi >= 0, lo // PB != hi // PB, target,
                                status_ptr, timeout_ns, max_spins, R_PAD, USE_TIMER)
            h_end = tl.where(ready, H, 0)  # a peer timed out: no loads (the launcher raises)
        if BT > 1:
            srcs, oks = _row_sources(recv_ptr, slots_ptr, toks, tm, R, N, H, bases, off_x, rank, R_PAD, PULL)
        for h0 in range(0, h_end, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            cm = cols < H
            acc = tl.zeros((BT, BLOCK_H), dtype=tl.float32)
            for d in tl.static_range(R_PAD):  # unrolled: every rank's row in flight at once
                v = tl.load(srcs[d][:, None] + cols[None, :], mask=oks[d][:, None] & cm[None, :], other=0.0)
                acc += v.to(tl.float32)
            if HAS_ADD:
                acc += tl.load(add_ptr + toks[:, None].to(tl.int64) * stride_add + cols[None, :],
                               mask=tm[:, None] & cm[None, :], other=0.0).to(tl.float32)
            tl.store(out_ptr + toks[:, None].to(tl.int64) * stride_out + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=tm[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["rank"])
def _combine_send_kernel(y_ptr, stride_y, meta_ptr, src_offsets_ptr, recv_counts_ptr, peer_bases_ptr,
                         epochs_ptr, send_counter_ptr, off_x, off_signal, off_sx, off_ready, rank, R, L, N, H,
                         ranks_per_node,
                         K: tl.constexpr, R_PAD: tl.constexpr, BJ: tl.constexpr,
                         BLOCK_H: tl.constexpr, OUT_DTYPE: tl.constexpr, XB: tl.constexpr, REMOTE: tl.constexpr,
                         EMULATE: tl.constexpr, PULL: tl.constexpr, PB: tl.constexpr, Y_PAIRS: tl.constexpr):
    epoch = tl.load(epochs_ptr)
    _combine_rows(y_ptr, stride_y, meta_ptr, src_offsets_ptr, recv_counts_ptr, peer_bases_ptr, off_x, off_sx,
                  off_ready, epoch, rank, R, L, N, H, ranks_per_node, K, R_PAD, BJ, BLOCK_H, OUT_DTYPE, XB,
                  REMOTE, EMULATE, PULL, PB, Y_PAIRS)
    if last_program_done(send_counter_ptr, True):
        if not PULL:  # pull: the blocks' flags are the signals
            _signal_all(peer_bases_ptr, off_signal, rank, R, ranks_per_node, epoch + 1, R_PAD, REMOTE, EMULATE)


@triton.jit(do_not_specialize=["T", "rank"])
def _combine_recv_kernel(signal_ptr, recv_ptr, slots_ptr, add_ptr, stride_add, out_ptr, stride_out,
                         epochs_ptr, recv_counter_ptr, status_ptr, peer_bases_ptr, off_x, ready_ptr, rank, T, N, H, R,
                         timeout_ns, max_spins, R_PAD: tl.constexpr, HAS_ADD: tl.constexpr, BT: tl.constexpr,
                         BLOCK_HS: tl.constexpr, USE_TIMER: tl.constexpr, PULL: tl.constexpr, PB: tl.constexpr,
                         FLAGS: tl.constexpr):
    epoch = tl.load(epochs_ptr)
    # pull, or a push whose send flags its blocks (FLAGS): each block of tokens waits for the
    # blocks of partial rows it loads, not for whole ranks
    if PULL or FLAGS or wait_signals(signal_ptr, R, epoch + 1, status_ptr, timeout_ns, max_spins, R_PAD, USE_TIMER):
        _sum_rows(recv_ptr, slots_ptr, add_ptr, stride_add, out_ptr, stride_out, T, N, H, R, peer_bases_ptr, off_x,
                  rank, ready_ptr, epoch + 1, status_ptr, timeout_ns, max_spins, R_PAD, HAS_ADD, BT, BLOCK_HS, PULL,
                  PB, USE_TIMER, FLAGS)
    if last_program_done(recv_counter_ptr, False):
        if FLAGS:
            # the send beside this sum reads the same epoch when its programs start, and one
            # that starts late (its SMs busy with other streams' work, as in the pipelined
            # layer) must not read the next one: the epoch moves on once every rank's send is
            # done (its last program's signal), which its flags have mostly made true by now;
            # after a timeout the launcher raises at once (no second wait)
            if not timed_out(status_ptr):
                wait_signals(signal_ptr, R, epoch + 1, status_ptr, timeout_ns, max_spins, R_PAD, USE_TIMER)
        tl.store(epochs_ptr, epoch + 1)


@triton.jit(do_not_specialize=["T", "rank"])
def _combine_fused_kernel(y_ptr, stride_y, meta_ptr, src_offsets_ptr, recv_counts_ptr, peer_bases_ptr,
                          signal_ptr, recv_ptr, slots_ptr, add_ptr, stride_add, out_ptr, stride_out,
                          epochs_ptr, send_counter_ptr, recv_counter_ptr, status_ptr, ready_ptr,
                          off_x, off_signal, off_sx, off_ready, rank, R, L, N, H, ranks_per_node, T, timeout_ns,
                          max_spins,
                          K: tl.constexpr, R_PAD: tl.constexpr, HAS_ADD: tl.constexpr,
                          BJ: tl.constexpr, BT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HS: tl.constexpr,
                          OUT_DTYPE: tl.constexpr,
                          XB: tl.constexpr, USE_TIMER: tl.constexpr, REMOTE: tl.constexpr, EMULATE: tl.constexpr,
                          Y_PAIRS: tl.constexpr, FLAGS: tl.constexpr):
    epoch = tl.load(epochs_ptr)
    _combine_rows(y_ptr, stride_y, meta_ptr, src_offsets_ptr, recv_counts_ptr, peer_bases_ptr, off_x, off_sx,
                  off_ready, epoch, rank, R, L, N, H, ranks_per_node, K, R_PAD, BJ, BLOCK_H, OUT_DTYPE, XB, REMOTE,
                  EMULATE, False, 1, Y_PAIRS, FLAGS)
    if FLAGS:  # the sum waits per block of tokens for the blocks it adds
        ready = True
    else:
        if last_program_done(send_counter_ptr, True):
            _signal_all(peer_bases_ptr, off_signal, rank, R, ranks_per_node, epoch + 1, R_PAD, REMOTE, EMULATE)
            # every program has counted itself, so has read the epoch: it moves on here, and the
            # sum below needs no second count at its end
            tl.store(epochs_ptr, epoch + 1)
        ready = wait_signals(signal_ptr, R, epoch + 1, status_ptr, timeout_ns, max_spins, R_PAD, USE_TIMER)
    if ready:
        _sum_rows(recv_ptr, slots_ptr, add_ptr, stride_add, out_ptr, stride_out, T, N, H, R, peer_bases_ptr, off_x,
                  rank, ready_ptr, epoch + 1, status_ptr, timeout_ns, max_spins, R_PAD, HAS_ADD, BT, BLOCK_HS, False,
                  BJ, USE_TIMER, FLAGS)
    if FLAGS:  # no program-wide count before the sum: the epoch moves on once every program is done
        if last_program_done(recv_counter_ptr, False):
            tl.store(epochs_ptr, epoch + 1)


# ---- launchers -----------------------------------------------------------------------------
_TL_DTYPES = {"bf16": tl.bfloat16, "fp32": tl.float32}
# under an SM budget, the per-token sum's step (channels of each of the R_PAD rows it loads at
# once), per R_PAD: 4096 on 2 and 4 ranks, where R_PAD rows of it fit 1024 threads at 64
# registers without spills on sm_90 (8192 on 4 ranks spills 304 bytes), 1024 on 8 (2048 spills
# 60 bytes; 8 ranks not measured on GPUs); any other R_PAD (one rank, 16+) 8192 channels in all.
# Prefill bf16 combine at 24 / 16 SMs: 2x H200 4096 channels against 1024, 779 -> 610 / 1115 ->
# 881 us; 4x H200 4096 against 2048, 1170 -> 1069 / 1694 -> 1564 us
SUM_CHANNELS = {2: 4096, 4: 4096, 8: 1024}
# a pulling sum (combine_mode "pull") waits on loads over NVLink, not HBM: 1024 channels per
# step. 4x H200, prefill (4 x 4096 tokens), one-process microbenchmark of the pull at 24 / 16
# programs: 8 rows x 1024 channels 569 / 712 us, x 2048 645 / 807, x 4096 929 / 1279
PULL_SUM_CHANNELS = 1024
# The per-token sum beside the Gluon send (see _overlapped_combine): from OVERLAP_MIN_SMS on,
# on this share of the budget. 4x H200, prefill bf16 combine (docs/perf.md v35), serial against
# beside (send / sum SMs): 24 SMs 797.5 against 793.3 (15 / 9), 734.1 (14 / 10), 799.3 (12 / 12);
# 16 SMs 816.8 against 1052.0-1139.8: the sum, on few SMs, is then the bound
OVERLAP_SUM_SHARE = 5 / 12
OVERLAP_MIN_SMS = 24
_WIRE_BYTES = {"bf16": 2, "fp32": 4}


def _check_y(cfg: EPConfig, y_MH: torch.Tensor, device: torch.device) -> None:
    check_tensor("y_MH", y_MH, dims=2, dtypes=(torch.bfloat16, torch.float32), device=device, inner_contiguous=True)
    if y_MH.shape[1] != cfg.hidden_size or y_MH.shape[0] < cfg.max_recv_rows:
        raise EPInputError(f"y_MH must be [>= {cfg.max_recv_rows}, {cfg.hidden_size}] (expert-major rows), "
                           f"got {tuple(y_MH.shape)}")


def _out(handle: DispatchHandle, cfg: EPConfig, out_dtype: torch.dtype, add_TH: torch.Tensor | None,
         device: torch.device) -> torch.Tensor:
    T = handle.num_tokens
    if add_TH is not None:
        check_tensor("add_TH", add_TH, shape=(T, cfg.hidden_size), device=device, inner_contiguous=True,
                     dtypes=(torch.bfloat16, torch.float16, torch.float32))
    return torch.empty(T, cfg.hidden_size, dtype=out_dtype, device=device)


def _send_named(cfg: EPConfig, y_MH: torch.Tensor, handle: DispatchHandle, bufs: SymmetricBuffers, ws: Workspace,
                rows: int, budget: int | None) -> tuple[dict, dict]:
    """Arguments and constexprs of the send half (``rows`` received rows per program, whole-SM
    programs if ``budget``)."""
    args = dict(y_ptr=y_MH, stride_y=y_MH.stride(0), meta_ptr=handle.meta_rows,
                src_offsets_ptr=handle.recv.src_offsets_RL, recv_counts_ptr=handle.recv.recv_counts_R,
                send_counter_ptr=ws.counters[COUNTER_COMBINE_SEND:], rank=bufs.rank, L=cfg.experts_per_rank,
                ranks_per_node=cfg.gpus_per_node, **bufs.combine.send_args(), **_common_args(cfg, bufs, ws))
    # bf16 expert rows read in pairs (kernels/pairs.py; every row must start 4-byte aligned)
    # by whole-SM programs, which their instructions bound (4x H200, prefill combine at 24 /
    # 16 SMs with the block's source picked by selects: 996 / 1457 -> 928 / 1344 us). With
    # every SM it measured within noise (557.6 -> 562.6 and 559.4 -> 553.0 us): not there
    pairs = (bool(budget) and y_MH.dtype == torch.bfloat16 and y_MH.stride(0) % 2 == 0
             and y_MH.data_ptr() % 4 == 0)
    meta = dict(K=cfg.top_k, BJ=rows, Y_PAIRS=pairs,
                OUT_DTYPE=_TL_DTYPES[cfg.combine_dtype], XB=_WIRE_BYTES[cfg.combine_dtype], **remote_meta(cfg))
    return args, meta


def _recv_named(cfg: EPConfig, handle: DispatchHandle, bufs: SymmetricBuffers, ws: Workspace, out: torch.Tensor,
                add_TH: torch.Tensor | None, rows: int) -> tuple[dict, dict]:
    """Arguments and constexprs of the receive half (``rows`` tokens per program)."""
    timeout_ns, max_spins = timeouts(cfg)
    args = dict(slots_ptr=handle.layout.token_slots_TR, add_ptr=add_TH if add_TH is not None else out,
                stride_add=add_TH.stride(0) if add_TH is not None else 0, out_ptr=out, stride_out=out.stride(0),
                recv_counter_ptr=ws.counters[COUNTER_COMBINE_RECV:], status_ptr=ws.status, T=handle.num_tokens,
                timeout_ns=timeout_ns, max_spins=max_spins, **bufs.combine.recv_args(), **_common_args(cfg, bufs, ws))
    meta = dict(HAS_ADD=add_TH is not None, BT=rows, USE_TIMER=not interpreted())
    return args, meta


def _common_args(cfg: EPConfig, bufs: SymmetricBuffers, ws: Workspace) -> dict:
    return dict(epochs_ptr=ws.epochs[EPOCH_COMBINE:], R=cfg.world_size, N=cfg.max_tokens_per_rank, H=cfg.hidden_size)


def _tile(cfg: EPConfig, bufs: SymmetricBuffers, budget: int | None, tokens: int) -> tuple[int, dict, dict, int]:
    """(rows per program, the send's and the sum's channel constexprs, warps) of a combine
    of ``tokens`` tokens under ``budget`` (the sum's step may be wider: it holds R rows per
    token in flight, not K)."""
    r_pad = next_power_of_2(cfg.world_size)
    rows, channels, warps = comm_tile(cfg.hidden_size, bufs.device, budget, "combine", tokens=tokens)
    # the sum holds R_PAD rows' steps in flight per token
    step = PULL_SUM_CHANNELS if cfg.combine_mode == "pull" else SUM_CHANNELS.get(r_pad, 8192 // r_pad)
    _, sum_channels, _ = comm_tile(cfg.hidden_size, bufs.device, budget, "combine", channels=step, tokens=tokens)
    return rows, dict(BLOCK_H=channels, R_PAD=r_pad), dict(BLOCK_HS=sum_channels, R_PAD=r_pad), warps


def combine_send(*, cfg: EPConfig, y_MH: torch.Tensor, handle: DispatchHandle, bufs: SymmetricBuffers,
                 ws: Workspace, num_sms: int | None = None) -> None:
    """Return expert outputs to their sources (split form; :func:`combine_recv` completes).

    y_MH [>= M_cap, H] bf16: expert outputs in the handle's expert-major order.
    combine_mode "pull": form the partial rows in this rank's own buffer (a pass over the
    expert outputs: expert-side work, on the SMs the budget leaves to the experts, every SM
    without a budget) and flag each block of them to its source.
    """
    _check_y(cfg, y_MH, bufs.device)
    budget = num_sms or cfg.num_sms
    pull = cfg.combine_mode == "pull"
    if pull:  # whole-SM programs on every SM the budget leaves (all of them without one)
        sms = sm_count(bufs.device)
        budget = sms - budget if budget and budget < sms else sms
    if not pull and sm90.usable(cfg, y_MH, budget):  # Hopper: expert rows by bulk copies (combine_sm90)
        _send_sm90(cfg, y_MH, handle, bufs, ws, budget, flags=False)
        return
    rows, tile, _, warps = _tile(cfg, bufs, budget, handle.num_tokens)
    if pull:
        rows = PULL_BLOCK_ROWS  # one readiness flag per block
    args, meta = _send_named(cfg, y_MH, handle, bufs, ws, rows, budget)
    args["off_ready"] = bufs.combine.off_ready  # the send kernel's pull arguments (the fused one has none)
    meta.update(PULL=pull, PB=PULL_BLOCK_ROWS)
    # the host does not know how many rows arrived: a grid the SMs hold at once, looping over the live blocks
    launch(_combine_send_kernel, work=cdiv(cfg.world_size * cfg.max_tokens_per_rank, rows), device=bufs.device,
           budget=budget, resident=True, args=args, meta={**meta, **tile}, warps=warps)


def _send_sm90(cfg: EPConfig, y_MH: torch.Tensor, handle: DispatchHandle, bufs: SymmetricBuffers, ws: Workspace,
               budget: int, flags: bool) -> None:
    """The Gluon send of :mod:`ray_ep.kernels.combine_sm90` on ``budget`` SMs (``flags``: each
    block of rows flagged to its source once stored, for a sum beside it)."""
    desc, meta = sm90.send_args(cfg, y_MH, flags=flags)
    args = dict(meta_ptr=handle.meta_rows, src_offsets_ptr=handle.recv.src_offsets_RL,
                recv_counts_ptr=handle.recv.recv_counts_R, peer_bases_ptr=bufs.combine.peer_bases_ptr,
                send_counter_ptr=ws.counters[COUNTER_COMBINE_SEND:], off_x=bufs.combine.off_x,
                off_signal=bufs.combine.off_signal, off_ready=bufs.combine.off_ready, rank=bufs.rank,
                L=cfg.experts_per_rank, **desc, **_common_args(cfg, bufs, ws))
    launch(sm90._combine_send_sm90_kernel, work=cdiv(cfg.world_size * cfg.max_tokens_per_rank, meta["BJ"]),
           device=bufs.device, budget=budget, resident=True, args=args, meta=meta, warps=sm90.CONSUMER_WARPS)


def combine_recv(*, cfg: EPConfig, handle: DispatchHandle, bufs: SymmetricBuffers, ws: Workspace,
                 out_dtype: torch.dtype = torch.bfloat16, add_TH: torch.Tensor | None = None,
                 num_sms: int | None = None, check: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """Wait for every rank's partial rows and sum them per token. Returns out_TH [T, H]
    (``out``: that tensor, allocated by the caller, e.g. on another stream).

    combine_mode "pull": each block of tokens waits only for the blocks of rows it loads, so a
    silent rank fails the ranks that need rows from it."""
    if out is None:
        out = _out(handle, cfg, out_dtype, add_TH, bufs.device)
    _launch_recv(cfg, handle, bufs, ws, out, add_TH, num_sms or cfg.num_sms, flags=False)
    if check:
        check_status(ws, bufs.rank, "combine")
    return out


def _launch_recv(cfg: EPConfig, handle: DispatchHandle, bufs: SymmetricBuffers, ws: Workspace, out: torch.Tensor,
                 add_TH: torch.Tensor | None, budget: int | None, flags: bool) -> None:
    """The receive half into ``out`` on ``budget`` SMs; ``flags`` (push): each block of tokens
    waits for the Gluon send's flags on the rows it adds (``sm90.FLAG_ROWS`` rows per flag),
    not for every rank's signal."""
    rows, _, tile, warps = _tile(cfg, bufs, budget, handle.num_tokens)
    pull = cfg.combine_mode == "pull"
    block = PULL_BLOCK_ROWS if pull else sm90.FLAG_ROWS
    if pull or flags:
        rows = min(rows, block)  # a block of tokens loads from at most two flagged blocks per rank
    args, meta = _recv_named(cfg, handle, bufs, ws, out, add_TH, rows)
    args.update(bufs.combine.pull_args(), rank=bufs.rank)
    meta.update(PULL=pull, PB=block, FLAGS=flags and not pull)
    launch(_combine_recv_kernel, work=cdiv(handle.num_tokens, rows), device=bufs.device,
           budget=budget, resident=True, args=args, meta={**meta, **tile}, warps=warps)


def combine_fused(*, cfg: EPConfig, y_MH: torch.Tensor, handle: DispatchHandle, bufs: SymmetricBuffers,
                  ws: Workspace, out_dtype: torch.dtype = torch.bfloat16, add_TH: torch.Tensor | None = None,
                  num_sms: int | None = None, check: bool = True) -> torch.Tensor:
    """Send partial rows and sum the arrivals in one launch (GPU; all ranks at once).
    Arguments as :func:`combine_send` and :func:`combine_recv`. combine_mode "pull" runs the
    two halves, see :func:`_pull_combine`; so does a batch of more tokens than SMs under an SM
    budget (faster there, see :func:`ray_ep.kernels.dispatch.dispatch_fused`), the receive
    beside the send on Hopper from ``OVERLAP_MIN_SMS`` SMs on (:func:`_overlapped_combine`)."""
    if cfg.combine_mode == "pull":
        return _pull_combine(cfg=cfg, y_MH=y_MH, handle=handle, bufs=bufs, ws=ws, out_dtype=out_dtype,
                             add_TH=add_TH, num_sms=num_sms, check=check)
    budget = num_sms or cfg.num_sms
    if overlaps(cfg, budget, bufs.device, y_MH.dtype):  # Hopper: the sum beside the Gluon send
        return _overlapped_combine(cfg=cfg, y_MH=y_MH, handle=handle, bufs=bufs, ws=ws, out_dtype=out_dtype,
                                   add_TH=add_TH, budget=budget, check=check)
    if fused_as_two_launches(budget, handle.num_tokens, bufs.device):
        combine_send(cfg=cfg, y_MH=y_MH, handle=handle, bufs=bufs, ws=ws, num_sms=budget)
        return combine_recv(cfg=cfg, handle=handle, bufs=bufs, ws=ws, out_dtype=out_dtype, add_TH=add_TH,
                            num_sms=budget, check=check)
    _check_y(cfg, y_MH, bufs.device)
    out = _out(handle, cfg, out_dtype, add_TH, bufs.device)
    rows, send_tile, sum_tile, warps = _tile(cfg, bufs, budget, handle.num_tokens)
    send_args, send_meta = _send_named(cfg, y_MH, handle, bufs, ws, rows, budget)
    recv_args, recv_meta = _recv_named(cfg, handle, bufs, ws, out, add_TH, rows)
    work = max(cdiv(cfg.world_size * cfg.max_tokens_per_rank, rows), cdiv(handle.num_tokens, rows))
    # Within one node and with every SM, each block of rows is flagged to its source, and a
    # block of tokens waits for the blocks it adds instead of every rank's last program and its
    # signals (4x H200: prefill 558.8 -> 540.1 us, decode from graphs 32.4 -> 31.1). Under an
    # SM budget a few programs wait once per block of tokens in turn: 949 -> 960 us at 24 SMs.
    flags = not send_meta["REMOTE"] and not budget
    args = {**send_args, **recv_args, "off_ready": bufs.combine.off_ready, "ready_ptr": bufs.combine.ready_ptr}
    meta = {**send_meta, **recv_meta, **send_tile, **sum_tile, "FLAGS": flags}
    launch(_combine_fused_kernel, work=work, device=bufs.device, budget=budget, resident=True, args=args, meta=meta,
           warps=warps)
    if check:
        check_status(ws, bufs.rank, "combine")
    return out


def overlaps(cfg: EPConfig, budget: int | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a fused combine runs its sum beside the Gluon send (:func:`_overlapped_combine`).
    Decided from the configuration and the device alone, never from this rank's tokens: each
    rank's sum waits for the blocks flagged by every rank's send, and the other forms flag none
    (a rank with few tokens taking the one-launch form would leave its peers waiting). ``dtype``:
    the expert rows', the same on every rank."""
    return (bool(budget) and budget >= OVERLAP_MIN_SMS
            and fused_as_two_launches(budget, cfg.max_tokens_per_rank, device)
            and sm90.usable_for(cfg, budget, device, dtype))


def _tma_rows(y_MH: torch.Tensor) -> torch.Tensor:
    """``y_MH``, or an aligned copy where bulk copies cannot address it (a view): every rank
    sends by the Gluon send once :func:`overlaps` holds."""
    if tma_addressable(y_MH):
        return y_MH
    return torch.empty(y_MH.shape, dtype=y_MH.dtype, device=y_MH.device).copy_(y_MH)


def overlap_sum_sms(budget: int) -> int:
    """SMs of an SM budget that the per-token sum takes beside the Gluon send (the rest send)."""
    return min(budget - 1, max(1, round(budget * OVERLAP_SUM_SHARE)))


def _overlapped_combine(*, cfg: EPConfig, y_MH: torch.Tensor, handle: DispatchHandle, bufs: SymmetricBuffers,
                        ws: Workspace, out_dtype: torch.dtype, add_TH: torch.Tensor | None, budget: int,
                        check: bool) -> torch.Tensor:
    """A push combine on Hopper under an SM budget: the Gluon send on ``budget -
    overlap_sum_sms(budget)`` SMs flags each block of rows it stores, and the per-token sum,
    on a side stream on the other SMs, adds each block of tokens once the rows it needs are
    flagged: the sum runs while the rows arrive instead of after the last one. (The send is
    launched first and never waits, so the sum's spinning programs cannot keep it off the SMs.)"""
    _check_y(cfg, y_MH, bufs.device)
    y_MH = _tma_rows(y_MH)
    out = _out(handle, cfg, out_dtype, add_TH, bufs.device)  # on the caller's stream, which joins below
    sum_sms = overlap_sum_sms(budget)
    _beside(bufs.device, lambda: _send_sm90(cfg, y_MH, handle, bufs, ws, budget - sum_sms, flags=True),
            lambda: _launch_recv(cfg, handle, bufs, ws, out, add_TH, sum_sms, flags=True))
    if check:
        check_status(ws, bufs.rank, "combine")
    return out


def _beside(device: torch.device, send: Callable[[], None], receive: Callable[[], None]) -> None:
    """Launch ``send`` on the caller's stream and ``receive`` beside it on a side stream, both
    after the caller's work so far; the caller's stream then waits for the receive. The side
    stream is never the caller's (the pipelined layer combines on side stream 0): on one stream
    the receive would follow the send, each on part of the budget."""
    main = torch.cuda.current_stream(device)
    side = side_stream(device, 1 if main == side_stream(device) else 0)
    side.wait_stream(main)  # the inputs are ready
    send()
    with torch.cuda.stream(side):
        receive()
    main.wait_stream(side)


def _pull_combine(*, cfg: EPConfig, y_MH: torch.Tensor, handle: DispatchHandle, bufs: SymmetricBuffers,
                  ws: Workspace, out_dtype: torch.dtype, add_TH: torch.Tensor | None, num_sms: int | None,
                  check: bool) -> torch.Tensor:
    """combine_mode "pull": form the partial rows, then load and sum them (the budget).

    Under an SM budget on a GPU the two overlap: the pass forming the rows takes the SMs the
    budget leaves, and the receive, on a side stream, loads each block as soon as it is flagged.
    (The pass is launched first, so no module loads while a receive spins; and its programs
    never wait, so the receive's programs find SMs however the two are scheduled.)"""
    budget = num_sms or cfg.num_sms
    common = dict(cfg=cfg, handle=handle, bufs=bufs, ws=ws)
    if not budget or budget >= sm_count(bufs.device) or bufs.device.type != "cuda" or interpreted():
        combine_send(y_MH=y_MH, num_sms=num_sms, **common)
        return combine_recv(out_dtype=out_dtype, add_TH=add_TH, num_sms=num_sms, check=check, **common)
    out = _out(handle, cfg, out_dtype, add_TH, bufs.device)  # on the caller's stream, which joins below
    _beside(bufs.device, lambda: combine_send(y_MH=y_MH, num_sms=num_sms, **common),
            lambda: combine_recv(out_dtype=out_dtype, add_TH=add_TH, num_sms=num_sms, check=False, out=out,
                                 **common))
    if check:
        check_status(ws, bufs.rank, "combine")
    return out


# ---- torch implementations (the twins) -------------------------------------------------------
def combine_partials_torch(*, cfg: EPConfig, rank: int, y_MH: torch.Tensor, src_offsets_RL: torch.Tensor,
                         counts_R: torch.Tensor, meta_rows: torch.Tensor, row_base_R: torch.Tensor,
                         weights_rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per source s, the fp32 partial rows [counts[s], H] that go back to it: for received row
    i, the sum over its local experts of weight * expert output. ``weights_rows`` [rows, K]
    fp64 replaces the weights of the meta rows (fp64 rows: the sums then run in fp64)."""
    K, L = cfg.top_k, cfg.experts_per_rank
    acc = torch.promote_types(y_MH.dtype, torch.float32)
    out = []
    for s in range(cfg.world_size):
        n = int(counts_R[s])
        j = row_base_R[s].long() + torch.arange(n, device=y_MH.device)
        meta = meta_rows[j]
        ids, ords = meta[:, :K].long(), meta[:, K:2 * K].long()
        w = meta[:, 2 * K:].contiguous().view(torch.float32) if weights_rows is None else weights_rows[j]
        e = ids - rank * L
        here = (ids >= 0) & (e >= 0) & (e < L)
        pos = torch.where(here, src_offsets_RL[s].long()[e.clamp(0, L - 1)] + ords, 0)
        contrib = y_MH[pos].to(acc) * torch.where(here, w.to(acc), 0.0)[..., None]
        out.append(contrib.sum(dim=1))
    return out


def combine_sum_torch(*, rows_MH: torch.Tensor, row_base_R: torch.Tensor, token_slots_TR: torch.Tensor,
                    out_dtype: torch.dtype, add_TH: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_d rows[row_base[d] + slot[t, d]] (+ add[t]) in fp32 (fp64 for fp64 rows)."""
    T, R = token_slots_TR.shape
    acc = torch.zeros(T, rows_MH.shape[1], dtype=torch.promote_types(rows_MH.dtype, torch.float32),
                      device=rows_MH.device)
    for d in range(R):
        slots = token_slots_TR[:, d].long()
        ok = slots >= 0
        acc[ok] += rows_MH[row_base_R[d].long() + slots[ok]].to(acc.dtype)
    if add_TH is not None:
        acc += add_TH.to(acc.dtype)
    return acc.to(out_dtype)


def combine_send_torch(*, cfg: EPConfig, y_MH: torch.Tensor, handle: DispatchHandle, bufs: SymmetricBuffers,
                     ws: Workspace, num_sms: int | None = None) -> None:
    """Torch twin of :func:`combine_send`."""
    _check_y(cfg, y_MH, bufs.device)
    me, N = bufs.rank, cfg.max_tokens_per_rank
    row_base = torch.arange(cfg.world_size, device=bufs.device) * N
    partials = combine_partials_torch(cfg=cfg, rank=me, y_MH=y_MH, src_offsets_RL=handle.recv.src_offsets_RL,
                                    counts_R=handle.recv.recv_counts_R, meta_rows=handle.meta_rows,
                                    row_base_R=row_base)
    epoch = int(ws.epochs[EPOCH_COMBINE])
    pull = cfg.combine_mode == "pull"
    for s, peer in enumerate(bufs.peers):
        n = partials[s].shape[0]
        # pull: row me * N + i of source s's buffer becomes row s * N + i of this rank's own
        rows = bufs.local["combine.recv.x"][s] if pull else peer["combine.recv.x"][me]
        rows[:n] = partials[s].to(rows.dtype)
        if pull:  # each block of rows it formed is flagged, not the rank as a whole
            peer["combine.ready.signal"][me, :cdiv(n, PULL_BLOCK_ROWS)] = epoch + 1
        else:
            peer["combine.recv_count.signal"][me] = epoch + 1


def combine_recv_torch(*, cfg: EPConfig, handle: DispatchHandle, bufs: SymmetricBuffers, ws: Workspace,
                     out_dtype: torch.dtype = torch.bfloat16, add_TH: torch.Tensor | None = None,
                     num_sms: int | None = None, check: bool = True) -> torch.Tensor:
    """Torch twin of :func:`combine_recv`."""
    out = _out(handle, cfg, out_dtype, add_TH, bufs.device)
    v = bufs.local
    epoch = int(ws.epochs[EPOCH_COMBINE])
    if cfg.combine_mode == "pull":  # a rank is silent if a block this rank loads from it is not flagged
        slots = handle.layout.token_slots_TR.long()
        flags = v["combine.ready.signal"].gather(1, (slots.clamp(min=0) // PULL_BLOCK_ROWS).T)
        silent = ((flags < epoch + 1) & (slots.T >= 0)).any(dim=1)
    else:
        silent = v["combine.recv_count.signal"] < epoch + 1
    if bool(silent.any()):
        ws.status[0] |= STATUS_TIMEOUT
        ws.status[1:][silent] = 1
    else:
        N = cfg.max_tokens_per_rank
        row_base = torch.arange(cfg.world_size, device=bufs.device) * N
        rows = v["combine.recv.x"]
        if cfg.combine_mode == "pull":  # rank d's rows for this rank, in its own buffer
            rows = torch.stack([peer["combine.recv.x"][bufs.rank] for peer in bufs.peers])
        out = combine_sum_torch(rows_MH=rows.view(-1, cfg.hidden_size), row_base_R=row_base,
                              token_slots_TR=handle.layout.token_slots_TR, out_dtype=out_dtype, add_TH=add_TH)
    ws.epochs[EPOCH_COMBINE] += 1  # as the kernel: the round is over, failed or not
    if check:
        check_status(ws, bufs.rank, "combine")
    return out
