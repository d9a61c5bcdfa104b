"""Device-side synchronisation shared by the dispatch and combine kernels.

Protocol (one round of one group, dispatch or combine):

1. every program of a send launch stores its rows, then increments the launch's done
   counter with release semantics at system scope (a CTA barrier first, so the stores of
   all its threads are ordered before);
2. the program that finds the counter at ``num_programs - 1`` is the last: it resets the
   counter, writes the per-destination counts and releases one signal per destination
   carrying the round number ``epoch + 1``;
3. receivers poll their R signals with acquire semantics until each is ``>= epoch + 1``
   (monotonic, so nothing is ever cleared and a fast peer running ahead cannot be missed),
   bounded by a timeout that sets error bits instead of hanging;
4. the last program of the receive launch advances the rank's epoch (its counter at GPU
   scope: nothing outside this GPU waits on it); in a fused launch whose send counts its
   programs, the send's last program does, since every program has read the epoch by then.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._util import INTERPRETED
from .buffers import STATUS_TIMEOUT

_STATUS_TIMEOUT = tl.constexpr(STATUS_TIMEOUT)


@triton.jit
def now_ns(USE_TIMER: tl.constexpr):
    """The GPU's global nanosecond timer; 0 in the interpreter (which counts spins instead)."""
    if USE_TIMER:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)
    else:
        return tl.zeros((), dtype=tl.int64)


@triton.jit
def peer_ptr(peer_bases_ptr, rank, offset_bytes, DTYPE: tl.constexpr):
    """Typed pointer to byte ``offset_bytes`` of rank ``rank``'s symmetric block."""
    return at_offset(tl.load(peer_bases_ptr + rank), offset_bytes, DTYPE)


@triton.jit
def at_offset(base, offset_bytes, DTYPE: tl.constexpr):
    """Typed pointer to byte ``offset_bytes`` of the symmetric block at address ``base``."""
    # blocks and sub-buffers are 128 B aligned: tell the compiler so stores vectorise
    return tl.multiple_of((base + offset_bytes).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def peer_bases(peer_bases_ptr, R, R_PAD: tl.constexpr):
    """Every rank's block address, a tuple of R_PAD (0 past R), for :func:`at_offset`. Load
    them before a loop that stores: inside it, every store could have overwritten the table
    for all the compiler knows, so it reloads the address before each store (a dependent
    load per destination and step)."""
    bases = ()
    for d in tl.static_range(R_PAD):
        bases = bases + (tl.load(peer_bases_ptr + d, mask=d < R, other=0),)
    return bases


@triton.jit
def last_program_done(counter_ptr, SYSTEM: tl.constexpr):
    """Count this program as finished (release); True for the last one, which also resets the
    counter for the next launch. Call after all of the program's stores.

    SYSTEM (a send): the last program releases signals that publish every program's stores to
    peers, so the count is released at system scope. Otherwise (a receive, whose last program
    only advances this GPU's epoch for the next launch on it) at GPU scope, which does not wait
    for this GPU's writes to reach other GPUs."""
    tl.debug_barrier()  # every thread's stores happen before the release below
    if SYSTEM:
        old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    else:
        old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = old == tl.num_programs(0) - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def release_signals(peer_bases_ptr, R, ranks_per_node, signal_offset_bytes, slot, value, R_PAD: tl.constexpr):
    """Publish ``value`` in slot ``slot`` of the signal array of every rank on this node (nodes
    of ranks_per_node ranks; ``slot`` is this rank), release, system scope, one lane per rank so the
    releases go out together. Call after a CTA barrier that follows the stores they publish."""
    d = tl.arange(0, R_PAD)
    near = (d < R) & ((d // ranks_per_node) == (slot // ranks_per_node))
    base = tl.load(peer_bases_ptr + d, mask=near, other=0)
    sig = (base + signal_offset_bytes).to(tl.pointer_type(tl.int64)) + slot
    tl.atomic_xchg(sig, tl.zeros((R_PAD,), dtype=tl.int64) + value, mask=near, sem="release", scope="sys")


@triton.jit
def live_blocks(counts_ptr, count_stride, R, BJ: tl.constexpr, R_PAD: tl.constexpr):
    """Blocks of BJ rows that hold received rows, source by source: (rows per source
    [R_PAD], first block of each source [R_PAD], total blocks).

    Loops visit only these blocks, so an empty receive region costs nothing (the host never
    knows the counts).
    """
    s = tl.arange(0, R_PAD)
    rows = tl.load(counts_ptr + s * count_stride, mask=s < R, other=0)
    nblk = (rows + BJ - 1) // BJ
    ends = tl.cumsum(nblk, axis=0)
    return rows, ends - nblk, tl.sum(nblk, axis=0)


@triton.jit
def locate_block(b, rows, starts, R_PAD: tl.constexpr, BJ: tl.constexpr):
    """Source, first row and row count of live block ``b`` (see :func:`live_blocks`)."""
    s = tl.arange(0, R_PAD)
    # sources with no rows share their start with the next one: the last one with rows <= b
    src = tl.max(tl.where((b >= starts) & (rows > 0), s, 0), axis=0)
    first = (b - tl.sum(tl.where(s == src, starts, 0), axis=0)) * BJ
    return src, first, tl.sum(tl.where(s == src, rows, 0), axis=0)


@triton.jit
def load_acquire(ptrs, mask):
    """The int64 words at ``ptrs`` where ``mask`` (else 0), each read with acquire semantics at
    system scope. On a GPU a plain ``ld.acquire.sys`` per lane: a poll that finds a flag raised
    is then itself the acquire, where a relaxed (volatile) poll needs an acquiring atomic after
    it, one more round trip to L2 between the flag and the first load it guards (one H200, a
    world of one, decode dispatch from CUDA graphs: 13.5 -> 13.2 us). :func:`wait_blocks` keeps
    relaxed polls: its waiting programs share SMs with sending ones, and with acquiring polls
    (each empties the SM's L1) the flagged combine ran slower (prefill 173 -> 186 us, decode
    +0.5). The interpreter (no inline PTX) adds 0 atomically instead."""
    if INTERPRETED:
        return tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys")
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b64 $0, 0; @p ld.acquire.sys.global.b64 $0, [$1]; }",
            "=l,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _expired(start, spins, timeout_ns, max_spins, USE_TIMER: tl.constexpr):
    """1 once a wait begun at ``start`` has lasted ``timeout_ns`` (GPU) or ``max_spins`` polls
    (the interpreter, which has no timer), else 0."""
    if USE_TIMER:
        return ((now_ns(USE_TIMER) - start) > timeout_ns).to(tl.int32)
    else:
        return (spins > max_spins).to(tl.int32)


@triton.jit
def _report_silent(pending, status_ptr, R_PAD: tl.constexpr):
    """After a wait: STATUS_TIMEOUT and status[1 + s] for each source still ``pending``.
    Returns True when none is."""
    src = tl.arange(0, R_PAD)
    silent = tl.max(pending.to(tl.int32), axis=0)
    if silent > 0:
        tl.atomic_or(status_ptr, _STATUS_TIMEOUT)
        tl.store(status_ptr + 1 + src, 1, mask=pending)
    return silent == 0


@triton.jit
def wait_signals(signal_ptr, R, target, status_ptr, timeout_ns, max_spins,
                 R_PAD: tl.constexpr, USE_TIMER: tl.constexpr):
    """Spin until signal_ptr[s] >= target for every s < R (acquire, system scope).

    Returns True when all arrived. On timeout (``timeout_ns`` on a GPU, ``max_spins`` polls in
    the interpreter) it sets STATUS_TIMEOUT and status[1 + s] for each silent source and
    returns False: a dead peer is reported, never waited on forever.
    """
    src = tl.arange(0, R_PAD)
    live = src < R
    # every read acquires (a fresh read each turn: the compiler may not hoist it), so once a
    # source's signal is seen the rows and counts it published before it are visible
    sig = load_acquire(signal_ptr + src, live)
    pending = live & (sig < target)
    start = now_ns(USE_TIMER)
    spins = 0
    expired = 0
    while (tl.max(pending.to(tl.int32), axis=0) > 0) & (expired == 0):
        sig = load_acquire(signal_ptr + src, pending)
        pending = pending & (sig < target)
        spins += 1
        expired = _expired(start, spins, timeout_ns, max_spins, USE_TIMER)
    tl.debug_barrier()  # the other threads read after the lanes that acquired
    return _report_silent(pending, status_ptr, R_PAD)


@triton.jit
def timed_out(status_ptr):
    """Whether a program of this launch (or of an earlier one on this rank) has timed out."""
    return (tl.load(status_ptr, volatile=True) & _STATUS_TIMEOUT) != 0


@triton.jit
def wait_blocks(first_flag_ptrs, last_flag_ptrs, need, two, target, status_ptr, timeout_ns, max_spins,
                R_PAD: tl.constexpr, USE_TIMER: tl.constexpr):
    """Spin until, for every rank d with ``need[d]``, both flags (the first and the last block
    of rows about to be loaded from d; ``two[d]``: they differ, else the first is the last)
    are >= target (acquire, system scope).

    Returns True when all are ready. Once any program of the launch has timed out
    (STATUS_TIMEOUT set) it returns False at once; on its own timeout it sets that bit and
    status[1 + d] for each rank still silent, as :func:`wait_signals` does.
    """
    failed = timed_out(status_ptr)
    # the acquiring reads go out beside the status load, not after it, and a second acquire
    # follows only a spin: one round trip when the blocks are there (as they mostly are by
    # the time a block of tokens is summed), where there were three. The last block is read
    # only where it is not the first: each read whose value is used is a round trip of its
    # own (its value reaches the program's threads through shared memory, after a barrier).
    two = need & two
    a = tl.atomic_add(first_flag_ptrs, 0, mask=need, sem="acquire", scope="sys")
    b = tl.atomic_add(last_flag_ptrs, 0, mask=two, sem="acquire", scope="sys")
    pending = need & (failed == 0) & ((a < target) | (two & (b < target)))
    if tl.max(pending.to(tl.int32), axis=0) > 0:
        start = now_ns(USE_TIMER)
        spins = 0
        expired = 0
        while (tl.max(pending.to(tl.int32), axis=0) > 0) & (expired == 0):
            a = tl.load(first_flag_ptrs, mask=pending, other=0, volatile=True)
            b = tl.load(last_flag_ptrs, mask=pending & two, other=0, volatile=True)
            pending = pending & ((a < target) | (two & (b < target)))
            spins += 1
            expired = _expired(start, spins, timeout_ns, max_spins, USE_TIMER)
        # acquire: the rows the peers stored before their flags are visible now
        tl.atomic_add(first_flag_ptrs, 0, mask=need & (failed == 0), sem="acquire", scope="sys")
        tl.atomic_add(last_flag_ptrs, 0, mask=two & (failed == 0), sem="acquire", scope="sys")
    tl.debug_barrier()
    return _report_silent(pending, status_ptr, R_PAD) & (failed == 0)
