"""Dispatch: send each token once to every rank that holds one of its experts, then lay the
received rows out expert-major for the grouped GEMM.

Legend: T tokens on this rank, K top-k, E experts, R ranks, L = E / R local experts,
H hidden, N = N_max, M = expert-major rows (capacity: EPConfig.max_recv_rows).

Send (per source rank ``me``): for every token t and destination d with
``token_slots[t, d] = i >= 0``, store its row (bf16; fp8 quantised once in registers plus
scales; or an nvfp4 wire row: packed codes and block scales in one row of bytes) and its
meta row (K expert ids, K ordinals, K weights) at row ``me * N + i`` of d's ``dispatch.recv``
buffers, through d's base address. The last program then writes d's
``counts[me] = [rows for d, rows for each of d's experts]`` and releases d's
``signal[me] = epoch + 1`` (see ``_sync``).

Receive (per rank): wait for every source's signal, then from the counts compute each
local expert's segment (``row_offsets``) and where source s's rows of expert e start
(``src_offsets[s, e]``); row (s, i) for its k-th expert e lands at expert-major row
``src_offsets[s, e] + ordinal[k]``. Rows are not copied again: ``row_ids[m]`` names the
receive row ``s * N + i`` that expert-major row m reads (-1 for padding), and the grouped
GEMM gathers through it. Inside a segment rows are ordered by (source, token), exactly as
:func:`ray_ep.reference.dispatch_world`.

Example (R = 2, L = 1, N = 4, rank 1 receiving, alignment 1): source 0 sent 2 rows for
expert 1, source 1 sent 1 row: counts = [[2, 2], [1, 1]], row_offsets = [0, 3],
src_offsets = [[0], [2]], row_ids = [0, 1, 4] (rows 0, 1 of region 0, row 0 of region 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import FP8_GROUP, NVFP4_BLOCK, NVFP4_GLOBAL_SCALE, EPConfig, nvfp4_row_bytes
from ..fp8 import quantize_fp8_torch
from ..nvfp4 import quantize_nvfp4_torch, wire_views
from ..types import DispatchHandle, DispatchLayout, RecvLayout
from ..validation import check_send_inputs
from ._shmem import other_node, put_bytes, put_signal, quiet, staged
from ._sync import at_offset, last_program_done, live_blocks, locate_block, peer_bases, release_signals, wait_signals
from ._util import (COMM_WARPS, cdiv, comm_tile, fused_as_two_launches, interpreted, launch, next_power_of_2,
                    remote_meta, small_batch, timeouts)
from .buffers import (COUNTER_DISPATCH_RECV, COUNTER_DISPATCH_SEND, EPOCH_DISPATCH, STATUS_OVERFLOW, STATUS_TIMEOUT,
                      SymmetricBuffers, Workspace, check_status)
from .layout import (CHUNK_ROWS, assign_block, block_bases, block_tokens, chunk_start, compute_layout,
                     compute_layout_torch, count_chunks)
from .nvfp4 import (block_warps, load_block_pair_words, load_block_pairs, quantize_nvfp4_blocks,
                    quantize_nvfp4_words, wire_row_bytes)
from .quant import quantize_group, quantize_group_words, reads_words, store_scales

_STATUS_OVERFLOW = tl.constexpr(STATUS_OVERFLOW)
_FP8_GROUP = tl.constexpr(FP8_GROUP)
_NVFP4_G = tl.constexpr(NVFP4_GLOBAL_SCALE)
_NVFP4_BLOCK = tl.constexpr(NVFP4_BLOCK)
# The send's FP8 and NVFP4 constexprs: 0 another wire format; READ_ELEMENTS quantises rows
# loaded as they are; READ_WORDS reads bf16 rows as int32 words of two channels, where a shift
# or a mask makes each an fp32 (a bf16 conversion takes two instructions; 2x H200, prefill at
# 24 / 16 SMs: nvfp4 220.3 / 307.4 -> 195.4 / 271.5 us with the ops of kernels.nvfp4.block_scales,
# fp8 176.2 / 237.2 -> 171.3 / 230.8; unchanged with every SM and for decode): for rows that
# start 4-byte aligned (kernels.quant.reads_words), else the word loads would fault; fp8's
# under a budget only where _bound_by_its_sms (on 4x H200 they lost at 24 SMs)
READ_ELEMENTS, READ_WORDS = tl.constexpr(1), tl.constexpr(2)
# where the send's slots and ordinals come from (see _own_layout)
LAYOUT_GIVEN = tl.constexpr(0)  # the caller's DispatchLayout
LAYOUT_SCANNED = tl.constexpr(1)  # the send scans every earlier token (small batches)
LAYOUT_FROM_BASES = tl.constexpr(2)  # the send scans its layout block, plus block_bases
LAYOUT_CHUNKED = tl.constexpr(3)  # the send assigns its own chunks' tokens, from count_chunks
_CHUNK_ROWS = tl.constexpr(CHUNK_ROWS)


# ---- device code ---------------------------------------------------------------------------
# The kernels take ``rank`` (and ``T``) unspecialised: Triton would compile a separate variant
# for rank 1 (ints equal to 1 become constants), and in a process hosting several ranks (the
# single-GPU tests) that compile and module load would happen while other ranks' kernels spin.
@triton.jit
def _on_rank(ids, ok, L, rr):
    """[n, R_PAD] int32: 1 where expert ids[i] (if ok[i]) lives on rank rr[r] (L experts each)."""
    return ((ids[:, None] // L == rr[None, :]) & ok[:, None]).to(tl.int32)


@triton.jit
def _own_layout(ids_ptr, stride_ids, slots_ptr, ordinals_ptr, totals_ptr, bases_ptr, toks, T, R, L,
                K: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr, BT: tl.constexpr, CH: tl.constexpr,
                BASES: tl.constexpr, SB: tl.constexpr):
    """What :func:`compute_layout` gives this block's tokens, worked out by the send itself,
    so no layout launch sits between the caller and the first row on the wire.

    Without BASES (small batches) a token scans the ids of every earlier token (at most
    SELF_LAYOUT_MAX_T) and the block's rows are added to the per-expert and per-rank totals
    (read by the send's last program). With BASES (:func:`block_bases`, layout blocks of SB
    tokens) it scans only the earlier tokens of its layout block and adds that block's base
    row; the totals are already known. Stores slots [BT, R] and ordinals [BT, K] for the
    combine, and returns them ([BT, R_PAD], [BT, K_PAD]) for the rest of the send: reloaded,
    they were a store, a CTA barrier and a load on the way to the first row (with the row's first
    step loaded before the layout, :func:`_first_step`; one H100, a world of one, deepseek-v3 fp8,
    us eager / from CUDA graphs: decode 128 tokens 15.65 / 14.02-14.18 -> 15.01-15.07 / 13.86-13.89,
    one token 12.26-12.32 / 11.18-11.26 -> 11.60-11.84 / 10.85-11.04; prefill every SM 77.8 / 77.0
    -> 75.7 / 74.0; nvfp4 decode 14.54-14.59 / 13.54-13.63 -> 14.27-14.37 / 13.60-13.74)."""
    E = R * L
    kk = tl.arange(0, K_PAD)
    rr = tl.arange(0, R_PAD)
    tm = toks < T
    mk = tm[:, None] & (kk[None, :] < K)
    ids = tl.load(ids_ptr + toks[:, None] * stride_ids + kk[None, :], mask=mk, other=-1)
    valid = mk & (ids >= 0) & (ids < E)
    goes = tl.zeros((BT, R_PAD), dtype=tl.int32)  # 1 where the token has an expert on rank r
    for k in tl.static_range(K):
        id_k = tl.sum(tl.where(kk[None, :] == k, ids, 0), axis=1)
        goes = tl.maximum(goes, _on_rank(id_k, tm & (id_k >= 0) & (id_k < E), L, rr))
    if BASES:
        lo = toks // SB * SB  # first token of each token's layout block
        base = bases_ptr + (toks // SB)[:, None] * (E + R)
        before_e = tl.load(base + tl.where(valid, ids, 0), mask=valid, other=0)
        before_r = tl.load(base + E + rr[None, :], mask=tm[:, None] & (rr[None, :] < R), other=0)
    else:
        lo = toks * 0
        before_e = tl.zeros((BT, K_PAD), dtype=tl.int32)  # earlier (token, k) with the same expert
        before_r = tl.zeros((BT, R_PAD), dtype=tl.int32)  # earlier tokens sent to rank r
    # hits per lane of a chunk, summed once after the loop: a sum across the chunk's lanes
    # crosses warps (shared memory and barriers), ~40 barriers a chunk when taken per k
    hits_e = tl.zeros((BT, K_PAD, CH), dtype=tl.int32)
    hits_r = tl.zeros((BT, CH, R_PAD), dtype=tl.int32)
    last = tl.max(tl.where(tm, toks, 0), axis=0)
    for j0 in range(tl.min(tl.where(tm, lo, last), axis=0), last, CH):
        jj = j0 + tl.arange(0, CH)
        earlier = (jj[None, :] < toks[:, None]) & (jj[None, :] >= lo[:, None])
        goes_j = tl.zeros((CH, R_PAD), dtype=tl.int32)
        for k in tl.static_range(K):
            idj = tl.load(ids_ptr + jj * stride_ids + k, mask=jj < T, other=-1)
            okj = (idj >= 0) & (idj < E)
            hits_e += ((idj[None, None, :] == ids[:, :, None]) & (okj[None, :] & earlier)[:, None, :]).to(tl.int32)
            goes_j = tl.maximum(goes_j, _on_rank(idj, okj, L, rr))
        hits_r += (earlier[:, :, None] & (goes_j[None, :, :] > 0)).to(tl.int32)
    before_e += tl.sum(hits_e, axis=2)
    before_r += tl.sum(hits_r, axis=1)
    slots = tl.where(goes > 0, before_r, -1)
    ords = tl.where(valid, before_e, -1)
    tl.store(slots_ptr + toks[:, None] * R + rr[None, :], slots, mask=tm[:, None] & (rr[None, :] < R))
    tl.store(ordinals_ptr + toks[:, None] * K + kk[None, :], ords, mask=mk)
    if not BASES:
        tl.atomic_add(totals_ptr + tl.where(valid, ids, 0), 1, mask=valid, sem="relaxed")
        tl.atomic_add(totals_ptr + E + rr[None, :] + toks[:, None] * 0, 1, mask=goes > 0, sem="relaxed")
    return slots, ords


@triton.jit
def _send_rows(x_ptr, stride_x, ids_ptr, stride_ids, w_ptr, stride_w, slots_ptr, ordinals_ptr, totals_ptr,
               bases_ptr, peer_bases_ptr, off_x, off_scales, off_meta, off_sx, off_ss, off_sm, T, H, N, rank, R, L,
               ranks_per_node, CT, NC,
               K: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr, FP8: tl.constexpr,
               BT: tl.constexpr, BLOCK_H: tl.constexpr, REMOTE: tl.constexpr, EMULATE: tl.constexpr,
               OWN_LAYOUT: tl.constexpr, CH: tl.constexpr, SB: tl.constexpr, NVFP4: tl.constexpr,
               BRANCHLESS: tl.constexpr, PREFETCH: tl.constexpr, C_PAD: tl.constexpr):
    """Store this program's share of token rows and meta rows into every destination on this
    node; with REMOTE, stage them once in this rank's ``dispatch.send`` rows and put them to
    the destinations on other nodes (nodes of ranks_per_node ranks).

    Blocks of BT tokens, the grid's stride apart; with LAYOUT_CHUNKED a program takes whole
    chunks of CT tokens instead (bases_ptr: :func:`count_chunks`' counts and running rows) and
    assigns each block's slots and ordinals just before it sends the block."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if OWN_LAYOUT == LAYOUT_CHUNKED:
        E = R * L
        running_ptr = bases_ptr + NC * (E + R)
        for c in range(pid, NC, nprog):
            run_r = chunk_start(bases_ptr, running_ptr, totals_ptr, c, NC, E, R, _CHUNK_ROWS, C_PAD, R_PAD)
            end = tl.minimum(T, (c + 1) * CT)
            for t0 in range(c * CT, end, BT):
                # pairwise, not compute_layout's sorted assign: a block is the send's few rows (one
                # H200, a world of one, prefill at 24 / 16 SMs: fp8 147.7 / 204.9 us against 178.2
                # / 248.7 sorted, bf16 142.4 / 195.3 against 162.4 / 225.5; docs/perf.md v43)
                run_r = assign_block(ids_ptr, stride_ids, t0, end, running_ptr + c * (E + R), run_r, slots_ptr,
                                     ordinals_ptr, K, L, E, R, BT, K_PAD, R_PAD)
                _send_block(t0, x_ptr, stride_x, ids_ptr, stride_ids, w_ptr, stride_w, slots_ptr,
                            ordinals_ptr, peer_bases_ptr, off_x, off_scales, off_meta, off_sx, off_ss, off_sm, T, H,
                            N, rank, R, ranks_per_node, K, K_PAD, R_PAD, FP8, BT, BLOCK_H, REMOTE, EMULATE, NVFP4,
                            BRANCHLESS, PREFETCH, 0, 0, 0, False)
    else:
        for blk in range(pid, tl.cdiv(T, BT), nprog):
            toks = blk * BT + tl.arange(0, BT)
            # the row's first step is in flight while the layout works (a small batch's chain)
            x_first = _first_step(x_ptr, stride_x, toks, T, H, FP8, BLOCK_H,
                                  PREFETCH and not NVFP4 and OWN_LAYOUT != LAYOUT_GIVEN)
            if OWN_LAYOUT != LAYOUT_GIVEN:
                slots, ords = _own_layout(ids_ptr, stride_ids, slots_ptr, ordinals_ptr, totals_ptr, bases_ptr,
                                          toks, T, R, L, K, K_PAD, R_PAD, BT, CH, OWN_LAYOUT == LAYOUT_FROM_BASES, SB)
                if REMOTE:
                    tl.debug_barrier()  # every thread's slots before the puts of the staged rows reload them
            else:
                slots, ords = 0, 0  # the caller's layout: the send loads them
            _send_block(blk * BT, x_ptr, stride_x, ids_ptr, stride_ids, w_ptr, stride_w, slots_ptr, ordinals_ptr,
                        peer_bases_ptr, off_x, off_scales, off_meta, off_sx, off_ss, off_sm, T, H, N, rank, R,
                        ranks_per_node, K, K_PAD, R_PAD, FP8, BT, BLOCK_H, REMOTE, EMULATE, NVFP4, BRANCHLESS,
                        PREFETCH, slots, ords, x_first, OWN_LAYOUT != LAYOUT_GIVEN)
    if REMOTE:
        quiet(EMULATE)  # delivered before this program counts itself done (the signals follow)


@triton.jit
def _dest_table(slots_ptr, slots, toks, tm, N, rank, R, ranks_per_node, R_PAD: tl.constexpr,
                BRANCHLESS: tl.constexpr, HELD: tl.constexpr):
    """Where a block of tokens goes, per destination d, as three tuples indexed by d: its rows
    at d ([BT] int64), which tokens go to d, and whether to store to d at all. Only d's on this
    node (stores; the others are put from the staged rows). Worked out once per block, for its
    meta rows and every step of its channels. The block's slots come from ``slots_ptr``, or
    from ``slots`` in registers ([BT, R_PAD], -1 where none) if HELD.

    BRANCHLESS: masked stores instead of a block-wide "any row for d?" test (one row per
    program: the test is cheap and skips the row's dead destinations)."""
    rows = ()
    oks = ()
    anys = ()
    for d in tl.static_range(R_PAD):
        near = (d // ranks_per_node) == (rank // ranks_per_node)
        if HELD:
            slot = tl.sum(tl.where(tl.arange(0, R_PAD)[None, :] == d, slots, 0), axis=1)
            ok = (slot >= 0) & tm & (d < R) & near
        else:
            slot = tl.load(slots_ptr + toks * R + d, mask=tm & (d < R) & near, other=-1)
            ok = slot >= 0
        rows = rows + ((rank * N + slot).to(tl.int64),)
        oks = oks + (ok,)
        anys = anys + (True if BRANCHLESS else tl.max(ok.to(tl.int32), axis=0) > 0,)
    return rows, oks, anys


@triton.jit
def _first_step(x_ptr, stride_x, toks, T, H, FP8: tl.constexpr, BLOCK_H: tl.constexpr, EARLY: tl.constexpr):
    """The first step of a block's rows as the prefetching send loads it (EARLY), else 0."""
    if EARLY:
        PER: tl.constexpr = 1 + (FP8 == READ_WORDS)
        x_row = x_ptr + toks[:, None].to(tl.int64) * stride_x
        if PER == 2:
            x_row = x_row.to(tl.pointer_type(tl.int32))
        c0 = tl.arange(0, BLOCK_H // PER)
        return tl.load(x_row + c0[None, :], mask=(toks < T)[:, None] & (c0[None, :] < H // PER), other=0)
    else:
        return 0


@triton.jit
def _load_nvfp4_step(x_row4, h0, H, tm4, NP: tl.constexpr, WORDS: tl.constexpr):
    """A step's block pairs (:func:`ray_ep.kernels.nvfp4.load_block_pairs`, or its words)."""
    if WORDS:
        lo, hi = load_block_pair_words(x_row4, h0, H, tm4, NP)
    else:
        lo, hi = load_block_pairs(x_row4, h0, H, tm4, NP)
    return lo, hi


@triton.jit
def _send_nvfp4_rows(x_row3, toks, tm, rows, oks, anys, bases, mine, off_x, off_sx, H, R_PAD: tl.constexpr,
                     BLOCK_H: tl.constexpr, REMOTE: tl.constexpr, PREFETCH: tl.constexpr, WORDS: tl.constexpr):
    """Quantise rows (x_row3 [1, BT, 1]: their first channels) to nvfp4 wire rows in steps of
    BLOCK_H channels and store them at every destination (REMOTE: and in this rank's staged
    rows). A wire row holds H / 2 packed bytes, then H / 16 block scales (see
    :func:`ray_ep.config.nvfp4_row_bytes`); a step's tile is [block pairs, rows, 2], two
    neighbouring blocks per thread (:func:`ray_ep.kernels.nvfp4.load_block_pairs`), so each
    warp's stores are NVLink writes of 512 and 64 bytes where a block per thread wrote 256 and
    32 (4x H200, prefill nvfp4 dispatch 171.2 -> 165.4 us with every SM, 258.3 -> 241.4 at 24
    SMs). rows, oks, anys: the block's :func:`_dest_table`; bases, mine: every rank's block
    address and this rank's."""
    NP: tl.constexpr = BLOCK_H // (2 * _NVFP4_BLOCK)  # pairs of neighbouring blocks, a pair per thread
    # EPConfig keeps H a multiple of 32: wire rows and their scales start 16-byte aligned, so a
    # thread's pair leaves in one 16-byte store of packed bytes and one 2-byte store of scales
    at_scales = tl.multiple_of(H // 2, 16)
    n_blocks = tl.multiple_of(H // _NVFP4_BLOCK, 2)  # even: a pair's two stores share their masks
    # wire_row_bytes(H) written out: hinting that call's result (tl.multiple_of(..., 16)) left
    # the scales' stores going through shared memory, two barriers a step (sm_90)
    W = at_scales + (n_blocks + 15) // 16 * 16
    tm3 = tm[None, :, None]
    tm4 = tm[None, :, None, None]
    if WORDS:  # bf16 rows read as int32 words of two channels (see READ_WORDS)
        x_row4 = x_row3.to(tl.pointer_type(tl.int32))[:, :, :, None]
    else:
        x_row4 = x_row3[:, :, :, None]
    if PREFETCH:  # as the fp8 send: the next step's channels load while this one quantises
        lo_next, hi_next = _load_nvfp4_step(x_row4, 0, H, tm4, NP, WORDS)
    for h0 in range(0, H, BLOCK_H):
        if PREFETCH:
            lo, hi = lo_next, hi_next
            lo_next, hi_next = _load_nvfp4_step(x_row4, h0 + BLOCK_H, H, tm4, NP, WORDS)
        else:
            lo, hi = _load_nvfp4_step(x_row4, h0, H, tm4, NP, WORDS)
        if WORDS:
            packed, s = quantize_nvfp4_words(lo, hi, _NVFP4_G, True)  # [NP, BT, 2]
        else:
            packed, s = quantize_nvfp4_blocks(lo.to(tl.float32), hi.to(tl.float32), _NVFP4_G, True)
        # block b of the row: its 8 packed bytes at byte 8b (one int64), its scale at H / 2 + b
        b = h0 // _NVFP4_BLOCK + 2 * tl.arange(0, NP)[:, None, None] + tl.arange(0, 2)[None, None, :]
        bm = b < n_blocks
        if REMOTE:
            base = (at_offset(mine, off_sx, tl.uint8) + toks.to(tl.int64) * W)[None, :, None]
            tl.store(base.to(tl.pointer_type(tl.int64)) + b, packed, mask=tm3 & bm)
            tl.store(base + at_scales + b, s, mask=tm3 & bm)
        for d in tl.static_range(R_PAD):
            if anys[d]:
                base = (at_offset(bases[d], off_x, tl.uint8) + rows[d] * W)[None, :, None]
                tl.store(base.to(tl.pointer_type(tl.int64)) + b, packed, mask=oks[d][None, :, None] & bm)
                tl.store(base + at_scales + b, s, mask=oks[d][None, :, None] & bm)


@triton.jit
def _store_fp8_step(base, off_q, off_s, row, ok, q, qc, qm, s, g, gm, H, ALONE: tl.constexpr):
    """A step's fp8 codes and group scales into rows ``row`` [BT, 1] (where ``ok``) of the
    symmetric block at ``base``: q [BT, C] at columns qc (where qm) of rows of codes, e4m3 or
    int16 pairs of them (READ_WORDS); s [BT, SG] at scale groups g (where gm)."""
    PER: tl.constexpr = q.dtype.primitive_bitwidth // 8  # codes per element of q
    tl.store(at_offset(base, off_q, q.dtype) + row * (H // PER) + qc[None, :], q, mask=ok & qm[None, :])
    store_scales(at_offset(base, off_s, tl.float32) + row * (H // _FP8_GROUP) + g[None, :], s, ok & gm, ALONE)


@triton.jit
def _send_block(t0, x_ptr, stride_x, ids_ptr, stride_ids, w_ptr, stride_w, slots_ptr, ordinals_ptr,
                peer_bases_ptr, off_x, off_scales, off_meta, off_sx, off_ss, off_sm, T, H, N, rank, R, ranks_per_node,
                K: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr, FP8: tl.constexpr, BT: tl.constexpr,
                BLOCK_H: tl.constexpr, REMOTE: tl.constexpr, EMULATE: tl.constexpr, NVFP4: tl.constexpr,
                BRANCHLESS: tl.constexpr, PREFETCH: tl.constexpr, slots, ords_in, x_first, HELD: tl.constexpr):
    """Rows and meta rows of tokens [t0, t0 + BT) to their destinations. HELD: the block's
    slots and ordinals are given in registers (the send's own layout), and so is the first step
    of its rows (``x_first``, see :func:`_first_step`) where the send prefetches (not nvfp4)."""
    toks = t0 + tl.arange(0, BT)
    kk = tl.arange(0, K_PAD)
    km = kk < K
    SG: tl.constexpr = BLOCK_H // _FP8_GROUP if FP8 else 1
    ALONE: tl.constexpr = BT > 1  # several rows per program on a GPU: an SM budget's one program per SM
    tm = toks < T
    mk = tm[:, None] & km[None, :]
    ids = tl.load(ids_ptr + toks[:, None] * stride_ids + kk[None, :], mask=mk, other=-1)
    wts = tl.load(w_ptr + toks[:, None] * stride_w + kk[None, :], mask=mk, other=0.0)
    wbits = wts.to(tl.float32).to(tl.int32, bitcast=True)
    if HELD:
        ords = ords_in
    else:
        ords = tl.load(ordinals_ptr + toks[:, None] * K + kk[None, :], mask=mk, other=-1)
    rows, oks, anys = _dest_table(slots_ptr, slots, toks, tm, N, rank, R, ranks_per_node, R_PAD, BRANCHLESS, HELD)
    bases = peer_bases(peer_bases_ptr, R, R_PAD)
    mine = tl.load(peer_bases_ptr + rank)
    if REMOTE:
        meta = at_offset(mine, off_sm, tl.int32) + toks[:, None].to(tl.int64) * (3 * K) + kk[None, :]
        tl.store(meta, ids, mask=mk)
        tl.store(meta + K, ords, mask=mk)
        tl.store(meta + 2 * K, wbits, mask=mk)
    for d in tl.static_range(R_PAD):
        if anys[d]:
            meta = at_offset(bases[d], off_meta, tl.int32) + rows[d][:, None] * (3 * K) + kk[None, :]
            mm = oks[d][:, None] & km[None, :]
            tl.store(meta, ids, mask=mm)
            tl.store(meta + K, ords, mask=mm)
            tl.store(meta + 2 * K, wbits, mask=mm)
    if NVFP4:
        _send_nvfp4_rows(x_ptr + toks[None, :, None].to(tl.int64) * stride_x, toks, tm, rows, oks, anys, bases, mine,
                         off_x, off_sx, H, R_PAD, BLOCK_H, REMOTE, PREFETCH, NVFP4 == READ_WORDS)
    else:
        # bf16 or fp8 rows in steps of BLOCK_H channels. fp8 from READ_WORDS rows loads them as
        # int32 words (PER = 2 channels an element) and stores each word's two codes as one int16
        WORDS: tl.constexpr = FP8 == READ_WORDS
        PER: tl.constexpr = 1 + WORDS
        x_row = x_ptr + toks[:, None].to(tl.int64) * stride_x
        if WORDS:
            x_row = x_row.to(tl.pointer_type(tl.int32))
        if PREFETCH:
            # the next step's channels load while this step quantises and stores: under an SM
            # budget each program waits on its loads' latency, not on bandwidth
            x_next = x_first if HELD else _first_step(x_ptr, stride_x, toks, T, H, FP8, BLOCK_H, True)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 // PER + tl.arange(0, BLOCK_H // PER)  # of x_row's elements
            cm = cols < H // PER
            if PREFETCH:
                x = x_next
                x_next = tl.load(x_row + BLOCK_H // PER + cols[None, :],
                                 mask=tm[:, None] & (cols[None, :] + BLOCK_H // PER < H // PER), other=0)
            else:
                x = tl.load(x_row + cols[None, :], mask=tm[:, None] & cm[None, :], other=0)
            if FP8:
                if WORDS:
                    q, s = quantize_group_words(x, SG)
                else:
                    q, s = quantize_group(x.to(tl.float32), SG)
                g = h0 // _FP8_GROUP + tl.arange(0, SG)
                gm = g[None, :] < H // _FP8_GROUP
            if REMOTE:
                if FP8:
                    _store_fp8_step(mine, off_sx, off_ss, toks[:, None].to(tl.int64), tm[:, None], q, cols, cm, s, g,
                                    gm, H, ALONE)
                else:
                    px = at_offset(mine, off_sx, tl.bfloat16)
                    tl.store(px + toks[:, None].to(tl.int64) * H + cols[None, :], x, mask=tm[:, None] & cm[None, :])
            for d in tl.static_range(R_PAD):
                to = rows[d][:, None]
                to_ok = oks[d][:, None]
                if anys[d]:
                    if FP8:
                        _store_fp8_step(bases[d], off_x, off_scales, to, to_ok, q, cols, cm, s, g, gm, H, ALONE)
                    else:
                        px = at_offset(bases[d], off_x, tl.bfloat16)
                        tl.store(px + to * H + cols[None, :], x, mask=to_ok & cm[None, :])
    if REMOTE:
        _put_staged_rows(slots_ptr, peer_bases_ptr, off_x, off_scales, off_meta, off_sx, off_ss, off_sm,
                         t0, T, H, N, rank, R, ranks_per_node, K, FP8, BT, EMULATE, NVFP4)


@triton.jit
def _put_staged_rows(slots_ptr, peer_bases_ptr, off_x, off_scales, off_meta, off_sx, off_ss, off_sm,
                     t0, T, H, N, rank, R, ranks_per_node, K: tl.constexpr, FP8: tl.constexpr, BT: tl.constexpr,
                     EMULATE: tl.constexpr, NVFP4: tl.constexpr):
    """Put the staged rows of tokens t0 .. t0 + BT - 1 to their destinations on other nodes:
    row, scales and meta land exactly where a store from this node would have put them
    (an nvfp4 wire row carries its scales: one put)."""
    staged(EMULATE)
    XB: tl.constexpr = 1 if FP8 else 2
    if NVFP4:
        RB = wire_row_bytes(H)
    else:
        RB = H * XB
    for r in tl.static_range(BT):
        t = t0 + r
        if t < T:
            for d in range(R):
                if other_node(rank, d, ranks_per_node):
                    slot = tl.load(slots_ptr + t * R + d)
                    if slot >= 0:
                        row = (rank * N + slot).to(tl.int64)
                        tt = t.to(tl.int64)
                        put_bytes(peer_bases_ptr, rank, d, off_x + row * RB, off_sx + tt * RB, RB, EMULATE)
                        if FP8:
                            put_bytes(peer_bases_ptr, rank, d, off_scales + row * (H // _FP8_GROUP) * 4,
                                      off_ss + tt * (H // _FP8_GROUP) * 4, (H // _FP8_GROUP) * 4, EMULATE)
                        put_bytes(peer_bases_ptr, rank, d, off_meta + row * (3 * K * 4), off_sm + tt * (3 * K * 4),
                                  3 * K * 4, EMULATE)


@triton.jit
def _publish(peer_bases_ptr, off_counts, off_signal, off_scounts, expert_counts_ptr, rank_counts_ptr, totals_ptr,
             rank, R, L, ranks_per_node, value, L_PAD: tl.constexpr, R_PAD: tl.constexpr, TAKE: tl.constexpr,
             REMOTE: tl.constexpr, EMULATE: tl.constexpr):
    """Last program of a send: counts then one signal per destination (stores and a release
    on this node, a put-with-signal of the staged counts to other nodes). Every destination's
    counts in one tile: a loop over destinations would wait on each one's loads in turn.
    TAKE (LAYOUT_SCANNED): the counts are the send's running totals, taken (zeros left for the
    next launch) and kept as the layout's counts."""
    d = tl.arange(0, R_PAD)
    e = tl.arange(0, L_PAD)
    dm = d < R
    m2 = dm[:, None] & (e[None, :] < L)
    if TAKE:
        per_expert = tl.atomic_xchg(totals_ptr + d[:, None] * L + e[None, :], 0, mask=m2, sem="relaxed")
        n_rows = tl.atomic_xchg(totals_ptr + R * L + d, 0, mask=dm, sem="relaxed")
        tl.store(expert_counts_ptr + d[:, None] * L + e[None, :], per_expert, mask=m2)
        tl.store(rank_counts_ptr + d, n_rows, mask=dm)
    else:
        per_expert = tl.load(expert_counts_ptr + d[:, None] * L + e[None, :], mask=m2, other=0)
        n_rows = tl.load(rank_counts_ptr + d, mask=dm, other=0)
    # on this node: row ``rank`` of d's counts of this round's parity (value % 2, see
    # plan_buffers); on another node: row d of this rank's staging counts
    row = (value % 2) * R + rank
    far = other_node(rank, d, ranks_per_node)
    base = tl.load(peer_bases_ptr + tl.where(far, rank, d), mask=dm, other=0)
    cnt = tl.where(far, base + off_scounts + d * (L + 1) * 4, base + off_counts + row * (L + 1) * 4)
    cnt = cnt.to(tl.pointer_type(tl.int32))
    tl.store(cnt, n_rows, mask=dm)
    tl.store(cnt[:, None] + 1 + e[None, :], per_expert, mask=m2)
    if REMOTE:
        staged(EMULATE)  # every thread's staged counts before the puts read them
        for r in range(R):
            if other_node(rank, r, ranks_per_node):
                put_signal(peer_bases_ptr, rank, r, off_counts + row * (L + 1) * 4, off_scounts + r * (L + 1) * 4,
                           (L + 1) * 4, off_signal + rank * 8, value, EMULATE)
    tl.debug_barrier()  # the counts of all threads before the release
    release_signals(peer_bases_ptr, R, ranks_per_node, off_signal, rank, value, R_PAD)


@triton.jit
def _recv_layout(signal_ptr, counts_ptr, meta_ptr, target, status_ptr, scratch_ptr,
                 row_ids_ptr, row_offsets_ptr, num_tokens_ptr, src_offsets_ptr, recv_counts_ptr,
                 rank, R, L, N, CAP, ALIGN, timeout_ns, max_spins,
                 K: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr, L_PAD: tl.constexpr,
                 A_PAD: tl.constexpr, BJ: tl.constexpr, USE_TIMER: tl.constexpr):
    """Wait for all sources, then write the expert-major description of what arrived."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    counts_ptr += (target % 2) * R * (L + 1)  # this round's set (see _publish)
    arrived = wait_signals(signal_ptr, R, target, status_ptr, timeout_ns, max_spins, R_PAD, USE_TIMER)
    if arrived:
        s_idx = tl.arange(0, R_PAD)
        e_idx = tl.arange(0, L_PAD)
        sm = s_idx < R
        em = e_idx < L
        c = tl.load(counts_ptr + s_idx[:, None] * (L + 1) + 1 + e_idx[None, :],
                    mask=sm[:, None] & em[None, :], other=0)
        rows_from = tl.load(counts_ptr + s_idx * (L + 1), mask=sm, other=0)
        tokens = tl.sum(c, axis=0)
        padded = (tokens + ALIGN - 1) // ALIGN * ALIGN
        seg_end = tl.cumsum(padded, axis=0)
        seg_start = seg_end - padded
        src_off = seg_start[None, :] + tl.cumsum(c, axis=0) - c
        bad = (tl.max(rows_from, axis=0) > N) | (tl.sum(padded, axis=0) > CAP) | (tl.min(c) < 0)
        if bad:
            tl.atomic_or(status_ptr, _STATUS_OVERFLOW)
        else:
            # a private copy of src_off per program: gathers below read it after a CTA barrier
            mine = scratch_ptr + pid * (R * L)
            tl.store(mine + s_idx[:, None] * L + e_idx[None, :], src_off, mask=sm[:, None] & em[None, :])
            if pid == 0:
                tl.store(row_offsets_ptr, 0)
                tl.store(row_offsets_ptr + 1 + e_idx, seg_end, mask=em)
                tl.store(num_tokens_ptr + e_idx, tokens, mask=em)
                tl.store(src_offsets_ptr + s_idx[:, None] * L + e_idx[None, :], src_off,
                         mask=sm[:, None] & em[None, :])
                tl.store(recv_counts_ptr + s_idx, rows_from, mask=sm)
                a_idx = tl.arange(0, A_PAD)
                pad_rows = (seg_start + tokens)[:, None] + a_idx[None, :]
                tl.store(row_ids_ptr + pad_rows, -1,
                         mask=em[:, None] & (a_idx[None, :] < (padded - tokens)[:, None]))
            tl.debug_barrier()
            kk = tl.arange(0, K_PAD)
            rows, starts, nblk = live_blocks(counts_ptr, L + 1, R, BJ, R_PAD)
            for b in range(pid, nblk, nprog):
                src, first, n_src = locate_block(b, rows, starts, R_PAD, BJ)
                i = first + tl.arange(0, BJ)
                j = src * N + i
                mk = (i < n_src)[:, None] & (kk[None, :] < K)
                ids = tl.load(meta_ptr + j[:, None].to(tl.int64) * (3 * K) + kk[None, :], mask=mk, other=-1)
                ords = tl.load(meta_ptr + j[:, None].to(tl.int64) * (3 * K) + K + kk[None, :], mask=mk, other=0)
                e = ids - rank * L
                here = mk & (ids >= 0) & (e >= 0) & (e < L)
                pos = tl.load(mine + src * L + e, mask=here, other=0) + ords
                tl.store(row_ids_ptr + pos, j[:, None] + kk[None, :] * 0, mask=here)


@triton.jit(do_not_specialize=["T", "rank", "CT", "NC"])
def _dispatch_send_kernel(x_ptr, stride_x, ids_ptr, stride_ids, w_ptr, stride_w, slots_ptr, ordinals_ptr,
                          expert_counts_ptr, rank_counts_ptr, totals_ptr, bases_ptr, peer_bases_ptr, epochs_ptr,
                          send_counter_ptr,
                          off_x, off_scales, off_meta, off_counts, off_signal, off_sx, off_ss, off_sm, off_scounts,
                          T, H, N, rank, R, L, ranks_per_node, CT, NC,
                          K: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr, L_PAD: tl.constexpr,
                          FP8: tl.constexpr, BT: tl.constexpr, BLOCK_H: tl.constexpr, REMOTE: tl.constexpr,
                          EMULATE: tl.constexpr, OWN_LAYOUT: tl.constexpr, CH: tl.constexpr,
                          SB: tl.constexpr, NVFP4: tl.constexpr, BRANCHLESS: tl.constexpr,
                          PREFETCH: tl.constexpr, C_PAD: tl.constexpr):
    epoch = tl.load(epochs_ptr)
    _send_rows(x_ptr, stride_x, ids_ptr, stride_ids, w_ptr, stride_w, slots_ptr, ordinals_ptr, totals_ptr,
               bases_ptr, peer_bases_ptr, off_x, off_scales, off_meta, off_sx, off_ss, off_sm, T, H, N, rank, R, L,
               ranks_per_node, CT, NC, K, K_PAD, R_PAD, FP8, BT, BLOCK_H, REMOTE, EMULATE, OWN_LAYOUT, CH, SB,
               NVFP4, BRANCHLESS, PREFETCH, C_PAD)
    if last_program_done(send_counter_ptr, True):
        _publish(peer_bases_ptr, off_counts, off_signal, off_scounts, expert_counts_ptr, rank_counts_ptr, totals_ptr,
                 rank, R, L, ranks_per_node, epoch + 1, L_PAD, R_PAD, OWN_LAYOUT == LAYOUT_SCANNED, REMOTE, EMULATE)


@triton.jit(do_not_specialize=["rank"])
def _dispatch_recv_kernel(signal_ptr, counts_ptr, meta_ptr, epochs_ptr, recv_counter_ptr, status_ptr, scratch_ptr,
                          row_ids_ptr, row_offsets_ptr, num_tokens_ptr, src_offsets_ptr, recv_counts_ptr,
                          rank, R, L, N, CAP, ALIGN, timeout_ns, max_spins,
                          K: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr, L_PAD: tl.constexpr,
                          A_PAD: tl.constexpr, BJ: tl.constexpr, USE_TIMER: tl.constexpr):
    epoch = tl.load(epochs_ptr)
    _recv_layout(signal_ptr, counts_ptr, meta_ptr, epoch + 1, status_ptr, scratch_ptr,
                 row_ids_ptr, row_offsets_ptr, num_tokens_ptr, src_offsets_ptr, recv_counts_ptr,
                 rank, R, L, N, CAP, ALIGN, timeout_ns, max_spins, K, K_PAD, R_PAD, L_PAD, A_PAD, BJ, USE_TIMER)
    if last_program_done(recv_counter_ptr, False):
        tl.store(epochs_ptr, epoch + 1)


@triton.jit(do_not_specialize=["T", "rank", "CT", "NC"])
def _dispatch_fused_kernel(x_ptr, stride_x, ids_ptr, stride_ids, w_ptr, stride_w, slots_ptr, ordinals_ptr,
                           expert_counts_ptr, rank_counts_ptr, totals_ptr, bases_ptr, peer_bases_ptr, epochs_ptr,
                           send_counter_ptr, status_ptr, scratch_ptr,
                           row_ids_ptr, row_offsets_ptr, num_tokens_ptr, src_offsets_ptr, recv_counts_ptr,
                           signal_ptr, counts_ptr, meta_ptr,
                           off_x, off_scales, off_meta, off_counts, off_signal, off_sx, off_ss, off_sm, off_scounts,
                           T, H, N, rank, R, L, ranks_per_node, CT, NC, CAP, ALIGN, timeout_ns, max_spins,
                           K: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr, L_PAD: tl.constexpr,
                           A_PAD: tl.constexpr, FP8: tl.constexpr, BT: tl.constexpr, BLOCK_H: tl.constexpr,
                           BJ: tl.constexpr, USE_TIMER: tl.constexpr, REMOTE: tl.constexpr, EMULATE: tl.constexpr,
                           OWN_LAYOUT: tl.constexpr, CH: tl.constexpr, SB: tl.constexpr, NVFP4: tl.constexpr,
                           BRANCHLESS: tl.constexpr, PREFETCH: tl.constexpr, C_PAD: tl.constexpr):
    epoch = tl.load(epochs_ptr)
    _send_rows(x_ptr, stride_x, ids_ptr, stride_ids, w_ptr, stride_w, slots_ptr, ordinals_ptr, totals_ptr,
               bases_ptr, peer_bases_ptr, off_x, off_scales, off_meta, off_sx, off_ss, off_sm, T, H, N, rank, R, L,
               ranks_per_node, CT, NC, K, K_PAD, R_PAD, FP8, BT, BLOCK_H, REMOTE, EMULATE, OWN_LAYOUT, CH, SB,
               NVFP4, BRANCHLESS, PREFETCH, C_PAD)
    if last_program_done(send_counter_ptr, True):
        _publish(peer_bases_ptr, off_counts, off_signal, off_scounts, expert_counts_ptr, rank_counts_ptr, totals_ptr,
                 rank, R, L, ranks_per_node, epoch + 1, L_PAD, R_PAD, OWN_LAYOUT == LAYOUT_SCANNED, REMOTE, EMULATE)
        # every program has counted itself, so has read the epoch: it moves on here, and the
        # receive below needs no second count at its end (the split receive keeps one)
        tl.store(epochs_ptr, epoch + 1)
    _recv_layout(signal_ptr, counts_ptr, meta_ptr, epoch + 1, status_ptr, scratch_ptr,
                 row_ids_ptr, row_offsets_ptr, num_tokens_ptr, src_offsets_ptr, recv_counts_ptr,
                 rank, R, L, N, CAP, ALIGN, timeout_ns, max_spins, K, K_PAD, R_PAD, L_PAD, A_PAD, BJ, USE_TIMER)


# ---- launchers -----------------------------------------------------------------------------
# A send lays out its own tokens (no compute_layout launches) up to this many tokens per rank:
# each token then scans the ids of at most this many earlier ones (see _own_layout).
SELF_LAYOUT_MAX_T = 256
# earlier tokens the send's own layout compares at once (GPU): a small batch's last token scans
# up to SELF_LAYOUT_MAX_T - 1 of them, in chunks of 64 (2x H200, decode 128 tokens, fp8 from
# graphs: 32 -> 22.5 us from 23.3; 128 ran 22.2 but spills 16 bytes in the bf16 fused send and
# ran bf16 from graphs 22.0 -> 23.6); a large batch's token at most block_tokens() - 1
SCAN_CHUNK = {int(LAYOUT_SCANNED): 64, int(LAYOUT_FROM_BASES): 32}


# Wire formats whose send assigns its own chunks under an SM budget (LAYOUT_CHUNKED); the
# others take compute_layout's two launches first. 4x H200, prefill 4096 tokens, 24 / 16 SMs,
# chunked against compute_layout: fp8 311.1 / 425.6 us against 393.9 / 409.4, bf16 589.2 /
# 578.2 against 577.9 / 618.4, nvfp4 405.6 / 577.5 against 376.9 / 535.3. bf16 and fp8 sends
# wait on their remote stores, so the assign fills idle issue slots; nvfp4's send is bound by
# its quantisation (as slow into its own buffer as to peers) and the assign lengthens it (2x
# H200, once a thread quantised whole blocks: 237.8 / 336.3 us after compute_layout, 262.2 /
# 373.7 chunked). compute_layout's sorted assign (v43, one H200, a world of one) took nvfp4
# at 24 / 16 SMs from 173.2 / 240.9 to 149.3 / 204.0 us (its assign launch 42 / 59 -> 16 / 20).
CHUNKED_SEND_DTYPES = ("bf16", "fp8")


def _send_tile(cfg: EPConfig, device: torch.device, budget: int | None, tokens: int | None = None
               ) -> tuple[int, int, int]:
    """(rows, channels, warps) of a send program of ``tokens`` tokens: a step holds whole fp8
    groups, or pairs of whole nvfp4 blocks (H / 2 bytes and H / 16 scales).

    An nvfp4 thread quantises a pair of whole 16-channel blocks, so a step has a pair for every
    thread and no more threads than pairs. 4x H200, prefill nvfp4 (us, every SM / 24 SMs): a
    block per thread, 2048 channels at 4 warps and 8 rows x 2048 at 32 warps, 171.2 / 258.3;
    pairs at 4096 channels and 4 warps, 8 x 4096 at 32 warps, 166.9 / 264.1; pairs at 2048
    and 2 warps, 8 x 2048 at 16 warps, **165.4 / 241.4**; 1024 at 1 warp 167.7. Decode keeps
    4096 channels at 4 warps (from CUDA graphs 21.7 us against 21.5 a block per thread;
    2048 at 2 warps 25.0). nvfp4's send under a budget that binds it by its SMs
    (:func:`_bound_by_its_sms`; unless that idles SMs of the budget, :func:`_idles_the_budget`),
    and with every SM, then takes steps that divide H (:func:`_whole_steps`).

    fp8's send keeps its 8 rows x 2048 channels under every budget. With whole steps (16 x 1024,
    v27 to v41 at 16 SMs on 4 GPUs, up to 24 on 2) its round trip came out wrong in 12 of 28
    benchmark checks on 4x H200 at 16 SMs (errors 0.13-0.63 of the largest value, no row
    misplaced; docs/perf.md v42), never in the 8-row form (58 runs at 16 and 24 SMs) nor in
    nvfp4's whole steps. The likeliest cause, a race in the chunked send's assign (a warp
    could read its experts' running rows after another warp had moved them on), is fixed
    (docs/perf.md v45); whole steps come back once a GPU confirms it. The cost, v27's 4x H200
    call at 16 SMs: 351.0 us against 347.0 (both reading fp8 rows as words).
    """
    multiple = {"fp8": FP8_GROUP, "nvfp4": 32}.get(cfg.dispatch_dtype, 8)
    rows, step, warps = comm_tile(cfg.hidden_size, device, budget, "dispatch", multiple=multiple, tokens=tokens)
    if interpreted() or cfg.dispatch_dtype == "bf16":
        return rows, step, warps
    decode = small_batch(tokens, device) and not budget
    if cfg.dispatch_dtype == "nvfp4":
        # 2048 channels a step with every SM or under a budget; a token per SM or fewer (decode)
        # takes 4096, the row in fewer steps
        channels = COMM_WARPS * 32 * (2 if decode else 1) * NVFP4_BLOCK
        step = max(step, min(channels, next_power_of_2(cfg.hidden_size)))
    if budget:
        whole = (cfg.dispatch_dtype == "nvfp4" and _bound_by_its_sms(budget, cfg.world_size)
                 and not _idles_the_budget(tokens, rows, budget))
    else:
        whole = cfg.dispatch_dtype == "nvfp4" and not decode
    if whole:
        rows, step = _whole_steps(rows, step, cfg.hidden_size)
    if cfg.dispatch_dtype == "nvfp4":
        warps = block_warps(rows, step, warps, blocks_per_thread=2)
    return rows, step, warps


# The narrowest step _whole_steps takes
WHOLE_STEP_MIN = 1024

# The SMs of a budget, times the share of a send's rows that go to peers ((R - 1) / R), up to
# which a quantising send is bound by its SMs' instructions (see _bound_by_its_sms)
SM_BOUND_PEER_SMS = 12


def _bound_by_its_sms(budget: int, world_size: int) -> bool:
    """Whether a quantising send under ``budget`` SMs is bound by its SMs' instructions, so
    that its forms in fewer instructions (nvfp4's whole steps, fp8 rows read as words) pay.
    (fp8's whole steps paid too, but gave wrong rows now and then: see :func:`_send_tile`.)

    4x H200, prefill, same call, us at 24 / 16 SMs: fp8 331.2 / 378.8 -> 346.5 / 347.0 with
    whole steps and words (343.8 / 351.0 words alone, 348.1 / 366.6 whole steps alone), nvfp4
    230.7 / 304.7 -> 254.0 / 273.9 with whole steps; 2x H200 (half of a send's rows go to a
    peer, not three quarters), 24 SMs: both won, fp8 181.9 -> 171.3, nvfp4 220.6 -> 184.2.
    Past ~20 SMs on 4 GPUs more SMs hardly help (fp8 at 16 / 20 / 24 / 32 SMs: 381.9 / 321.6
    / 329.5 / 334.7), and there the two forms trade places from one budget to the next (one
    call: at 20 and 32 SMs the whole steps won for nvfp4, at 32 for fp8), so the rule fits
    the budgets measured in the same calls, 16 and 24, on 4 and 2 GPUs; why the faster forms
    lose at 24 SMs on 4 GPUs is not known yet. The rule: budget x (R - 1) / R <=
    SM_BOUND_PEER_SMS."""
    return budget * (world_size - 1) <= SM_BOUND_PEER_SMS * world_size


def _idles_the_budget(tokens: int | None, rows: int, budget: int) -> bool:
    """Whether doubling a send's ``rows`` (whole steps) would lengthen its busiest program:
    a batch of ``tokens`` in blocks of ``rows`` on ``budget`` programs, each program's rows
    counted over its rounds. A small batch then leaves SMs of the budget idle (2x H200, decode
    128 tokens at 24 SMs: nvfp4 at 16 rows took 8 programs, 31.2 us, where fp8's 8 rows took 16,
    24.1 us); a large one loses nothing (4096 tokens at 24 SMs: 176 rows either way).

    >>> _idles_the_budget(128, 8, 24), _idles_the_budget(4096, 8, 24), _idles_the_budget(None, 8, 24)
    (True, False, False)
    """
    if tokens is None:
        return False

    def busiest(r: int) -> int:  # rows of the program with the most blocks
        return cdiv(cdiv(tokens, r), budget) * r

    return busiest(2 * rows) > busiest(rows)


def _whole_steps(rows: int, step: int, H: int) -> tuple[int, int]:
    """(rows, step) with the same threads, the step halved (and the rows doubled) until it
    divides H, down to WHOLE_STEP_MIN channels: a quantising send's threads each pay for their
    step, channels past H or not (deepseek-v3's 7168 channels are 3.5 steps of 2048, a half
    step wasted a row; 7 of 1024). 2x H200, prefill, 24 / 16 SMs: nvfp4 195.4 / 271.5 ->
    184.0 / 254.6 us at 16 rows x 1024 channels, fp8 180.9 / 250.9 -> 176.2 / 237.7; every SM,
    nvfp4 83.2 -> 79.2 at 2 rows x 1024 (fp8's 1024 channels divide it already)."""
    while H % step and step > WHOLE_STEP_MIN:
        rows, step = 2 * rows, step // 2
    return rows, step


def _layout_for_send(cfg: EPConfig, topk_ids_TK: torch.Tensor, layout: DispatchLayout | None,
                     budget: int | None) -> tuple[DispatchLayout, int, torch.Tensor | None, int]:
    """(layout, how, bases, chunk): the caller's layout (LAYOUT_GIVEN), or tensors the send
    fills itself: scanning every earlier token (LAYOUT_SCANNED, small batches), from the
    bases of :func:`block_bases` (LAYOUT_FROM_BASES, which also gives the totals), or, under
    an SM budget, from :func:`count_chunks` (LAYOUT_CHUNKED: bases holds the chunks' counts
    and running rows, each program assigns and sends whole chunks of ``chunk`` tokens).

    Under a budget a few programs would work out every token's layout one after the other
    from bases (prefill at 24 programs: 900 us, 815 us with the one-hot compute_layout of v12);
    by chunks the assign of a block overlaps the stores of the one before. With every SM
    the bases win (4x H200, bf16 prefill: 488.2 us, 494.2 with compute_layout's chunks)."""
    if layout is not None:
        return layout, LAYOUT_GIVEN, None, 0
    T, R, L = topk_ids_TK.shape[0], cfg.world_size, cfg.experts_per_rank
    dev = topk_ids_TK.device
    chunk = 0
    if T > SELF_LAYOUT_MAX_T and budget and cfg.dispatch_dtype not in CHUNKED_SEND_DTYPES:
        layout = compute_layout(topk_ids_TK=topk_ids_TK, world_size=R, experts_per_rank=L, num_sms=budget)
        return layout, LAYOUT_GIVEN, None, 0
    if T > SELF_LAYOUT_MAX_T and budget:
        bt = _send_tile(cfg, dev, budget, T)[0]
        bases, chunk, _ = count_chunks(topk_ids_TK=topk_ids_TK, world_size=R, experts_per_rank=L, programs=budget,
                                       multiple=bt)
        totals = torch.empty(R * L + R, dtype=torch.int32, device=dev)  # written by the last chunk's program
        how = LAYOUT_CHUNKED
    elif T > SELF_LAYOUT_MAX_T:
        bases, totals = block_bases(topk_ids_TK=topk_ids_TK, world_size=R, experts_per_rank=L)
        how = LAYOUT_FROM_BASES
    else:
        bases, totals = None, torch.empty(R * L + R, dtype=torch.int32, device=dev)  # per expert, then per rank
        how = LAYOUT_SCANNED
    return DispatchLayout(torch.empty(T, R, dtype=torch.int32, device=dev),
                          torch.empty(T, cfg.top_k, dtype=torch.int32, device=dev),
                          totals[:R * L], totals[R * L:]), how, bases, chunk


def _common_meta(cfg: EPConfig) -> dict:
    """Constexprs of every dispatch kernel: the padded sizes of its small index vectors."""
    return dict(K=cfg.top_k, K_PAD=next_power_of_2(cfg.top_k), R_PAD=next_power_of_2(cfg.world_size),
                L_PAD=next_power_of_2(cfg.experts_per_rank))


def _common_args(cfg: EPConfig, bufs: SymmetricBuffers, ws: Workspace) -> dict:
    """Arguments of every dispatch kernel: the rank's epoch and the world's sizes."""
    return dict(epochs_ptr=ws.epochs[EPOCH_DISPATCH:], N=cfg.max_tokens_per_rank, rank=bufs.rank,
                R=cfg.world_size, L=cfg.experts_per_rank)


def _send_named(cfg: EPConfig, x_TH, topk_ids_TK, topk_weights_TK, layout: DispatchLayout, how: int,
                bases: torch.Tensor | None, chunk: int, bufs: SymmetricBuffers, ws: Workspace, budget: int | None
                ) -> tuple[dict, dict, int]:
    """Arguments, constexprs and warps of the send half (its tile depends on the SM budget)."""
    bt, bh, warps = _send_tile(cfg, x_TH.device, budget, x_TH.shape[0])
    R, L = cfg.world_size, cfg.experts_per_rank
    args = dict(x_ptr=x_TH, stride_x=x_TH.stride(0), ids_ptr=topk_ids_TK, stride_ids=topk_ids_TK.stride(0),
                w_ptr=topk_weights_TK, stride_w=topk_weights_TK.stride(0), slots_ptr=layout.token_slots_TR,
                ordinals_ptr=layout.ordinals_TK, expert_counts_ptr=layout.expert_counts_E,
                rank_counts_ptr=layout.rank_counts_R,
                # the send's running totals (SCANNED), or where the last chunk writes them (CHUNKED:
                # the layout's counts, one [E + R] tensor made by _layout_for_send)
                totals_ptr=layout.expert_counts_E if how == LAYOUT_CHUNKED else ws.totals,
                bases_ptr=bases if bases is not None else ws.totals,  # read only FROM_BASES or CHUNKED
                CT=chunk, NC=bases.shape[1] if how == LAYOUT_CHUNKED else 0,
                send_counter_ptr=ws.counters[COUNTER_DISPATCH_SEND:], T=x_TH.shape[0], H=cfg.hidden_size,
                ranks_per_node=cfg.gpus_per_node, **bufs.dispatch.send_args(), **_common_args(cfg, bufs, ws))
    # several rows per program (an SM budget, the interpreter): measured at 24 programs on 4x H200,
    # prefill dispatch bf16 769 -> 654 us, fp8 1004 -> 781 us; one row per program keeps the test.
    # PREFETCH (quantised wire rows): the next step's channels load while this one quantises;
    # 2x H200, prefill at 24 / 16 SMs: fp8 308 -> 287 / 428 -> 396 us, nvfp4 399 -> 387 /
    # 561 -> 544; every SM: fp8 130 -> 125, nvfp4 132 -> 117; decode fp8 27.0 -> 25.3, nvfp4
    # 26.2 -> 24.5. bf16 (nothing to overlap) at 24 / 16 SMs: 248 -> 261 / 224 -> 241, so not bf16
    meta = dict(FP8=_read_mode(cfg, x_TH, "fp8", budget), NVFP4=_read_mode(cfg, x_TH, "nvfp4", budget),
                BT=bt, BLOCK_H=bh, OWN_LAYOUT=int(how), CH=64 if interpreted() else SCAN_CHUNK.get(int(how), 32),
                SB=block_tokens(), BRANCHLESS=bt > 1, PREFETCH=cfg.dispatch_dtype != "bf16",
                C_PAD=next_power_of_2(R * L + R),
                **_common_meta(cfg), **remote_meta(cfg))
    return args, meta, warps


def _read_mode(cfg: EPConfig, x_TH: torch.Tensor, dtype: str, budget: int | None) -> int:
    """The send's FP8 or NVFP4 constexpr (READ_WORDS, READ_ELEMENTS; 0: not this dtype):
    words where the rows allow it, fp8's under a budget only while the send is bound by its
    SMs (:func:`_bound_by_its_sms`)."""
    if cfg.dispatch_dtype != dtype:
        return 0
    words = reads_words(x_TH) and (dtype != "fp8" or not budget or _bound_by_its_sms(budget, cfg.world_size))
    return (READ_WORDS if words else READ_ELEMENTS).value


def _send_work(T: int, rows: int, chunks: int) -> int:
    """Programs a send can use: its chunks (LAYOUT_CHUNKED), else its blocks of rows."""
    return chunks or cdiv(T, rows)


def _recv_named(cfg: EPConfig, recv: RecvLayout, bufs: SymmetricBuffers, ws: Workspace) -> tuple[dict, dict]:
    """Arguments and constexprs of the receive half."""
    timeout_ns, max_spins = timeouts(cfg)
    args = dict(status_ptr=ws.status, scratch_ptr=ws.scratch,
                row_ids_ptr=recv.row_ids_M, row_offsets_ptr=recv.row_offsets_L1, num_tokens_ptr=recv.num_tokens_L,
                src_offsets_ptr=recv.src_offsets_RL, recv_counts_ptr=recv.recv_counts_R, CAP=cfg.max_recv_rows,
                ALIGN=cfg.expert_alignment, timeout_ns=timeout_ns, max_spins=max_spins,
                **bufs.dispatch.recv_args(), **_common_args(cfg, bufs, ws))
    meta = dict(A_PAD=next_power_of_2(cfg.expert_alignment), BJ=64 if interpreted() else 32,
                USE_TIMER=not interpreted(), **_common_meta(cfg))
    return args, meta


def _scratch_cap(ws: Workspace, budget: int | None) -> int:
    """Receive programs each need a private row of ws.scratch: never more programs than rows."""
    return min(budget, ws.scratch.shape[0]) if budget else ws.scratch.shape[0]


def _handle(cfg: EPConfig, bufs: SymmetricBuffers, layout: DispatchLayout, recv: RecvLayout, T: int) -> DispatchHandle:
    R, N, H = cfg.world_size, cfg.max_tokens_per_rank, cfg.hidden_size
    v = bufs.local
    if cfg.dispatch_dtype == "nvfp4":  # views of the wire rows: packed codes, block scales
        x, scales = wire_views(v["dispatch.recv.x"].view(R * N, nvfp4_row_bytes(H)), H)
    else:
        x = v["dispatch.recv.x"].view(R * N, H)
        scales = v["dispatch.recv.scales"].view(R * N, H // FP8_GROUP) if cfg.dispatch_dtype == "fp8" else None
    return DispatchHandle(layout, recv, x, scales, v["dispatch.recv.meta"].view(R * N, 3 * cfg.top_k), T)


def dispatch_send(*, cfg: EPConfig, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  bufs: SymmetricBuffers, ws: Workspace, layout: DispatchLayout | None = None,
                  num_sms: int | None = None) -> DispatchLayout:
    """Send this rank's tokens (split form: returns at once; :func:`dispatch_recv` completes).

    x_TH [T, H] bf16 (fp8 and nvfp4 dispatch also take fp16/fp32: they quantise inside the send);
    topk_ids_TK [T, K] int32 (-1 = unused); topk_weights_TK [T, K] fp32. Returns the
    send-side layout, which :func:`dispatch_recv` and the combine need.
    """
    check_send_inputs(cfg, x_TH, topk_ids_TK, topk_weights_TK, bufs.device)
    budget = num_sms or cfg.num_sms
    layout, how, bases, chunk = _layout_for_send(cfg, topk_ids_TK, layout, budget)
    args, meta, warps = _send_named(cfg, x_TH, topk_ids_TK, topk_weights_TK, layout, how, bases, chunk, bufs, ws,
                                    budget)
    launch(_dispatch_send_kernel, work=_send_work(x_TH.shape[0], meta["BT"], args["NC"]), device=bufs.device,
           budget=budget, resident=False, args=args, meta=meta, warps=warps)
    return layout


def dispatch_recv(*, cfg: EPConfig, layout: DispatchLayout, bufs: SymmetricBuffers, ws: Workspace,
                  num_tokens: int, out: RecvLayout | None = None, num_sms: int | None = None,
                  check: bool = True) -> DispatchHandle:
    """Wait for every source's rows and build the expert-major description (split form).

    ``check`` syncs with the device and raises EPTimeoutError / EPOverflowError when a
    source stayed silent or sent more than the buffers hold; with ``check=False`` call
    :func:`ray_ep.kernels.buffers.check_status` later.
    """
    recv = out if out is not None else RecvLayout.allocate(cfg, bufs.device)
    args, meta = _recv_named(cfg, recv, bufs, ws)
    # its last program moves the epoch on (a fused launch's send does it, see _dispatch_fused_kernel)
    args["recv_counter_ptr"] = ws.counters[COUNTER_DISPATCH_RECV:]
    launch(_dispatch_recv_kernel, work=cdiv(cfg.world_size * cfg.max_tokens_per_rank, meta["BJ"]),
           device=bufs.device, budget=_scratch_cap(ws, num_sms or cfg.num_sms), resident=True, args=args, meta=meta)
    if check:
        check_status(ws, bufs.rank, "dispatch")
    return _handle(cfg, bufs, layout, recv, num_tokens)


def dispatch_fused(*, cfg: EPConfig, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                   bufs: SymmetricBuffers, ws: Workspace, out: RecvLayout | None = None, num_sms: int | None = None,
                   check: bool = True, layout: DispatchLayout | None = None) -> DispatchHandle:
    """Send and receive in one launch (GPU; every rank must launch it at once). Arguments as
    :func:`dispatch_send` and :func:`dispatch_recv`.

    Under an SM budget a batch of more tokens than SMs runs as those two launches instead, and
    so does :func:`ray_ep.kernels.combine.combine_fused`: one launch was the slower there. 4x
    H200, prefill 4096 tokens, same call, one launch -> two, us at 24 / 16 SMs: dispatch bf16
    577.1 / 587.5 -> 572.7 / 581.7, fp8 341.6 / 390.8 -> 332.0 / 377.4, nvfp4 241.7 / 338.3 ->
    235.0 / 327.3; combine 943.8 / 1367.4 -> 923.4 / 1321.1. (Not the fused combine's register
    spills: its sum at 2048 channels, none, ran as fast as at 4096.) With every SM two launches
    gain nothing (fp8 268.5 us) and the combine would lose its per-block flags (554.5 -> 538)."""
    budget = num_sms or cfg.num_sms
    if fused_as_two_launches(budget, x_TH.shape[0], bufs.device):
        layout = dispatch_send(cfg=cfg, x_TH=x_TH, topk_ids_TK=topk_ids_TK, topk_weights_TK=topk_weights_TK,
                               bufs=bufs, ws=ws, layout=layout, num_sms=budget)
        return dispatch_recv(cfg=cfg, layout=layout, bufs=bufs, ws=ws, num_tokens=x_TH.shape[0], out=out,
                             num_sms=budget, check=check)
    check_send_inputs(cfg, x_TH, topk_ids_TK, topk_weights_TK, bufs.device)
    layout, how, bases, chunk = _layout_for_send(cfg, topk_ids_TK, layout, budget)
    recv = out if out is not None else RecvLayout.allocate(cfg, bufs.device)
    send_args, send_meta, warps = _send_named(cfg, x_TH, topk_ids_TK, topk_weights_TK, layout, how, bases, chunk,
                                              bufs, ws, budget)
    recv_args, recv_meta = _recv_named(cfg, recv, bufs, ws)
    meta = {**send_meta, **recv_meta}
    work = max(_send_work(x_TH.shape[0], meta["BT"], send_args["NC"]),
               cdiv(cfg.world_size * cfg.max_tokens_per_rank, meta["BJ"]))
    launch(_dispatch_fused_kernel, work=work, device=bufs.device, budget=_scratch_cap(ws, budget),
           resident=True, args={**send_args, **recv_args}, meta=meta, warps=warps)
    if check:
        check_status(ws, bufs.rank, "dispatch")
    return _handle(cfg, bufs, layout, recv, x_TH.shape[0])


# ---- torch implementations (the twins) -------------------------------------------------------
def pack_meta_torch(topk_ids_TK: torch.Tensor, ordinals_TK: torch.Tensor,
                    topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """Meta rows [T, 3K] int32: ids, ordinals, weight bits."""
    weights = topk_weights_TK.float().contiguous().view(torch.int32)
    return torch.cat([topk_ids_TK.int(), ordinals_TK.int(), weights], dim=1)


def expert_major_torch(*, cfg: EPConfig, rank: int, counts_RL1: torch.Tensor, meta_rows: torch.Tensor,
                     row_base_R: torch.Tensor, out: RecvLayout | None = None) -> RecvLayout:
    """The receive-side layout from per-source counts and meta rows.

    ``counts_RL1`` [R, L + 1]: rows from each source, then per local expert. Source s's rows
    are ``meta_rows[row_base_R[s] + i]`` for i < counts[s, 0] (``row_base_R[s] = s * N`` for
    the symmetric buffers, the running sum of counts for packed all-to-all output).
    """
    R, L, A, K = cfg.world_size, cfg.experts_per_rank, cfg.expert_alignment, cfg.top_k
    dev = meta_rows.device
    recv = out if out is not None else RecvLayout.allocate(cfg, dev)
    c = counts_RL1[:, 1:].long()
    tokens = c.sum(0)
    padded = (tokens + A - 1) // A * A
    seg_end = padded.cumsum(0)
    seg_start = seg_end - padded
    src_off = seg_start[None, :] + c.cumsum(0) - c
    row_ids = recv.row_ids_M
    row_ids.fill_(-1)
    for s in range(R):
        n = int(counts_RL1[s, 0])
        if n == 0:
            continue
        j = row_base_R[s].long() + torch.arange(n, device=dev)
        ids = meta_rows[j, :K].long()
        ords = meta_rows[j, K:2 * K].long()
        e = ids - rank * L
        here = (ids >= 0) & (e >= 0) & (e < L)
        pos = src_off[s][e.clamp(0, L - 1)] + ords
        row_ids[pos[here]] = j[:, None].expand(-1, K)[here].int()
    recv.row_offsets_L1.copy_(torch.cat([seg_end.new_zeros(1), seg_end]).int())
    recv.num_tokens_L.copy_(tokens.int())
    recv.src_offsets_RL.copy_(src_off.int())
    recv.recv_counts_R.copy_(counts_RL1[:, 0].int())
    return recv


def dispatch_send_torch(*, cfg: EPConfig, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                      bufs: SymmetricBuffers, ws: Workspace, layout: DispatchLayout | None = None,
                      num_sms: int | None = None) -> DispatchLayout:
    """Torch twin of :func:`dispatch_send`: the same stores through the peers' typed views."""
    check_send_inputs(cfg, x_TH, topk_ids_TK, topk_weights_TK, bufs.device)
    if layout is None:
        layout = compute_layout_torch(topk_ids_TK=topk_ids_TK, world_size=cfg.world_size,
                                    experts_per_rank=cfg.experts_per_rank)
    me, N, L, H = bufs.rank, cfg.max_tokens_per_rank, cfg.experts_per_rank, cfg.hidden_size
    fp8, nvfp4 = cfg.dispatch_dtype == "fp8", cfg.dispatch_dtype == "nvfp4"
    quantize = {"fp8": quantize_fp8_torch, "nvfp4": quantize_nvfp4_torch}.get(cfg.dispatch_dtype)
    rows, scales = quantize(x_TH) if quantize else (x_TH, None)
    meta = pack_meta_torch(topk_ids_TK, layout.ordinals_TK, topk_weights_TK)
    epoch = int(ws.epochs[EPOCH_DISPATCH])
    for d, peer in enumerate(bufs.peers):
        slots = layout.token_slots_TR[:, d].long()
        sent = slots >= 0
        dst_rows = me * N + slots[sent]
        if nvfp4:  # into the wire rows: packed codes, then block scales (as bytes)
            q_view, s_view = wire_views(peer["dispatch.recv.x"].view(-1, nvfp4_row_bytes(H)), H)
            q_view[dst_rows] = rows[sent]
            s_view.view(torch.uint8)[dst_rows] = scales[sent].view(torch.uint8)
        else:
            peer["dispatch.recv.x"].view(-1, H)[dst_rows] = rows[sent]
        if fp8:
            peer["dispatch.recv.scales"].view(-1, cfg.hidden_size // FP8_GROUP)[dst_rows] = scales[sent]
        peer["dispatch.recv.meta"].view(-1, 3 * cfg.top_k)[dst_rows] = meta[sent]
        counts = peer["dispatch.recv_count.counts"][(epoch + 1) % 2]  # this round's set, as _publish
        counts[me, 0] = layout.rank_counts_R[d]
        counts[me, 1:] = layout.expert_counts_E[d * L:(d + 1) * L]
        peer["dispatch.recv_count.signal"][me] = epoch + 1
    return layout


def dispatch_recv_torch(*, cfg: EPConfig, layout: DispatchLayout, bufs: SymmetricBuffers, ws: Workspace,
                      num_tokens: int, out: RecvLayout | None = None, num_sms: int | None = None,
                      check: bool = True) -> DispatchHandle:
    """Torch twin of :func:`dispatch_recv` (a silent source is flagged at once, no waiting)."""
    v = bufs.local
    epoch = int(ws.epochs[EPOCH_DISPATCH])
    silent = v["dispatch.recv_count.signal"] < epoch + 1
    recv = out if out is not None else RecvLayout.allocate(cfg, bufs.device)
    if bool(silent.any()):
        ws.status[0] |= STATUS_TIMEOUT
        ws.status[1:][silent] = 1
    else:
        N, A = cfg.max_tokens_per_rank, cfg.expert_alignment
        counts = v["dispatch.recv_count.counts"][(epoch + 1) % 2]
        padded = (counts[:, 1:].sum(0) + A - 1) // A * A
        if int(counts[:, 0].max()) > N or int(padded.sum()) > cfg.max_recv_rows or int(counts.min()) < 0:
            ws.status[0] |= STATUS_OVERFLOW
        else:
            row_base = torch.arange(cfg.world_size, device=bufs.device, dtype=torch.int32) * N
            expert_major_torch(cfg=cfg, rank=bufs.rank, counts_RL1=counts,
                             meta_rows=v["dispatch.recv.meta"].view(-1, 3 * cfg.top_k), row_base_R=row_base, out=recv)
    ws.epochs[EPOCH_DISPATCH] += 1  # as the kernel: the round is over, failed or not
    if check:
        check_status(ws, bufs.rank, "dispatch")
    return _handle(cfg, bufs, layout, recv, num_tokens)
