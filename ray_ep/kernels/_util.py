"""Launcher helpers shared by the kernel modules: launch shapes and the launch itself."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass, field, replace

import torch
import triton
import triton.language as tl


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# for device code that takes another path in Triton's CPU interpreter (which has no inline PTX)
INTERPRETED = tl.constexpr(interpreted())



# Host-side twins of ``triton.cdiv`` / ``triton.next_power_of_2``: Triton 3.6 makes those
# constexpr functions, whose call from host code unwraps its arguments first (~2 us a call on
# the CPU host against ~0.1); with these a dispatch and combine spend ~30% less of their own
# Python before the launches (docs/perf.md v48)
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, as ``triton.cdiv``."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n <= 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _cuda_index(device: torch.device) -> int:
    """The index of a CUDA device ("cuda" alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def sm_major(device: torch.device | str) -> int:
    """A CUDA device's compute capability major (9: Hopper), asked once per device: launchers
    check it on every call, and torch's query takes ~10 us of host time each; 0 for a CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return _major(_cuda_index(device))


def num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device; 4 stand-ins for a CPU (interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return _sm_count(_cuda_index(device))


_side_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def side_stream(device: torch.device | str, slot: int = 0) -> torch.cuda.Stream:
    """A side stream of a CUDA device, made once and reused: slot 0 for the layer's shared
    experts and communication and a combine's receive beside its send, slot 1 for that receive
    when the caller is on slot 0 (the pipelined layer's combines)."""
    key = (_cuda_index(torch.device(device)), slot)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device=key[0])
    return _side_streams[key]


COMM_WARPS = 4  # warps per row of a communication kernel's tile (see comm_tile)
# rows per program and channels per step under an SM budget (see comm_tile)
BUDGET_ROWS = {"dispatch": 8, "combine": 8}
BUDGET_CHANNELS = {"dispatch": 2048, "combine": 1024}
# small batches (decode, see SMALL_BATCH_TOKENS_PER_SM): channels per step of a program's row at 8
# per thread (one 16-byte bf16 vector per row in flight), see comm_tile
SMALL_BATCH_CHANNELS = {"combine": 4096, "dispatch": 2048}
# up to how many tokens per SM a launch takes that tile. One H100, a world of one, decode
# (deepseek-v3, fp8 dispatch), us from CUDA graphs at 256 tokens (two per SM), against one row
# of 1024 channels at 4 warps: combine 23.5-23.6 -> 17.3, dispatch 17.0 -> 18.3 (its own layout
# scans every earlier token, so a second token per program lengthens the chain); 128 tokens
# unchanged
SMALL_BATCH_TOKENS_PER_SM = {"combine": 2, "dispatch": 1}

# Per-SM limits of Hopper (sm_90, H100 / H200; CUDA occupancy tables): they bound how many
# programs of a kernel are resident at once
MAX_THREADS_PER_SM = 2048
REGISTERS_PER_SM = 65536
MAX_BLOCKS_PER_SM = 32
SHARED_BYTES_PER_SM = 227 * 1024  # the most one SM gives to thread blocks (of 228 KiB)


def prefill_rows(rows_per_expert: int) -> bool:
    """Whether a grouped GEMM over ``rows_per_expert`` capacity rows per expert takes the prefill
    launches (the Hopper fp8 kernel, 128-row tiles, bf16 persistent grids): more than 64. At 64
    or fewer (decode) 64-row tiles read each weight once per 64 rows, and the weights' bandwidth
    bounds the GEMM."""
    return rows_per_expert > 64

_resident: dict[tuple, int] = {}  # programs per SM that fit at once, per compiled variant


@dataclass(frozen=True)
class LaunchRecord:
    """One communication kernel launch: its programs and the most SMs they can occupy (one per
    program, at most the device's SMs; 4 stand-ins on a CPU). Not fewer even where an SM could
    hold several programs: the hardware spreads a small grid over idle SMs."""

    kernel: str
    programs: int
    sms: int
    marks: tuple | None = field(default=None, compare=False, repr=False)
    """Inside ``recorded_launches(timed=True)``: (start, end) around the launch, CUDA events on
    its stream on a GPU, host clock readings on a CPU (where the interpreter has run the kernel
    by the time the launch returns)."""

    def elapsed_us(self) -> float | None:
        """Microseconds between the marks (on a GPU after waiting for the end event); None if
        the launch was not timed."""
        if self.marks is None:
            return None
        start, end = self.marks
        if isinstance(start, float):
            return (end - start) * 1e6
        end.synchronize()
        return start.elapsed_time(end) * 1e3


_recorders: list[tuple[list[LaunchRecord], bool]] = []  # (records, timed) of each open block


@contextlib.contextmanager
def recorded_launches(timed: bool = False):
    """Collect a :class:`LaunchRecord` of every :func:`launch` inside the block (this thread's
    and any other's: use it around one call at a time); ``timed``: with marks around each
    launch (:meth:`LaunchRecord.elapsed_us`; an event pair costs the stream a little, so time
    the calls themselves outside such a block). Example::

        with recorded_launches() as launches:
            transport.combine(y, handle, torch.bfloat16)
        [(r.kernel, r.programs, r.sms) for r in launches]
    """
    records: list[LaunchRecord] = []
    entry = (records, timed)
    _recorders.append(entry)
    try:
        yield records
    finally:
        _recorders[:] = [e for e in _recorders if e is not entry]  # by identity: equal lists are not the same block


def _mark(device: torch.device | str):
    """A point on the current stream (a recorded CUDA event) or, on a CPU, the host clock."""
    if torch.device(device).type != "cuda":
        return time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _occupancy(compiled) -> int:
    """Programs of a compiled kernel one SM holds at once (threads, registers, shared memory)."""
    threads = 32 * compiled.metadata.num_warps
    regs = max(1, getattr(compiled, "n_regs", 0) or 1)
    shared = getattr(compiled.metadata, "shared", 0) or 0
    fits = [MAX_THREADS_PER_SM // threads, REGISTERS_PER_SM // (regs * threads), MAX_BLOCKS_PER_SM]
    if shared:
        fits.append(SHARED_BYTES_PER_SM // shared)
    return max(1, min(fits))


_named_ok: set[tuple] = set()  # (kernel, names) pairs already checked


def check_names(kernel, args: dict, meta: dict) -> None:
    """Raise TypeError unless ``args`` (runtime values) and ``meta`` (constexprs) name every
    parameter of ``kernel`` exactly once: a launch passes nothing by position, so no argument
    can land in another's place, and a missing or stray name is an error, not a silent
    default (Triton alone reports a stray keyword only when it compiles a new variant)."""
    key = (kernel, tuple(args), tuple(meta))
    if key in _named_ok:
        return
    params = set(kernel.arg_names)
    given = set(args) | set(meta)
    both = set(args) & set(meta)
    if given != params or both:
        name = getattr(kernel, "__name__", repr(kernel))
        raise TypeError(f"{name}: missing {sorted(params - given)}, unknown {sorted(given - params)}, "
                        f"given twice {sorted(both)}")
    _named_ok.add(key)


def launch(kernel, *, work: int, device: torch.device, budget: int | None, resident: bool, args: dict,
           meta: dict, warps: int = COMM_WARPS) -> None:
    """Launch a communication kernel over ``work`` program-sized pieces (its loops stride by
    the grid, so any grid size is correct).

    - ``budget``: at most that many programs (the SM budget of the benchmarks).
    - ``resident``: the kernel spins on signals from its own programs or peers, so every
      program must be resident at once: the grid is the SMs times the programs one SM holds
      (measured from the compiled kernel; one per SM until the first launch has compiled it).
    - otherwise one program per piece, and the hardware keeps every SM full.

    ``args`` and ``meta`` (constexprs) are the kernel's parameters by name (see :func:`check_names`).
    Inside :func:`recorded_launches` the launch is recorded (programs, SMs).
    """
    check_names(kernel, args, meta)
    sms = num_sms(device)
    key = (kernel.fn.__qualname__, str(device), warps, tuple(sorted(meta.items())))
    if budget is not None:
        grid = min(work, budget, sms * _resident.get(key, 1))
    elif resident:
        grid = min(work, sms * _resident.get(key, 1))
    else:
        grid = work
    extra = {}
    if meta.get("REMOTE") and not meta.get("EMULATE"):
        from ._shmem import extern_libs

        extra["extern_libs"] = extern_libs()  # NVSHMEM's device library, linked at compile
    timed = any(t for _, t in _recorders)
    start = _mark(device) if timed else None
    compiled = kernel[(max(1, grid),)](**args, **meta, num_warps=warps, **extra)
    marks = (start, _mark(device)) if timed else None
    if key not in _resident and torch.device(device).type == "cuda" and compiled is not None:
        _resident[key] = _occupancy(compiled)
    if _recorders:
        programs = max(1, grid)
        record = LaunchRecord(kernel.fn.__name__, programs, min(sms, programs))
        for records, t in _recorders:
            records.append(replace(record, marks=marks) if t else record)


def remote_meta(cfg) -> dict:
    """Constexprs of the kernels that reach other nodes: REMOTE when the topology has several
    nodes (ranks on other nodes get NVSHMEM puts), EMULATE in the interpreter (puts become
    copies through the peer table, see ``_shmem``)."""
    return dict(REMOTE=cfg.n_nodes > 1, EMULATE=interpreted())


def tile_shape(H: int, device: torch.device | str, multiple: int = 8) -> tuple[int, int]:
    """(rows, channels) of a row tile.

    On GPUs one row per program and up to 1024 channels per step (16 B per thread at
    COMM_WARPS = 4): small programs, many of them resident on every SM, each with a few
    independent loads in flight, hide memory and NVLink latency. (2048 fp8 channels per step,
    16 B stores, measured no faster: 372 vs 364 us for prefill fp8 dispatch.) In the
    interpreter, whole rows and many of them per op (numpy is fastest on big arrays).
    """
    if interpreted():
        return 16, max(multiple, min(8192, next_power_of_2(H)))
    return 1, max(multiple, min(1024, next_power_of_2(H)))


def small_batch(tokens: int | None, device: torch.device | str, per_sm: int = 1) -> bool:
    """A launch of at most ``per_sm`` tokens per SM (decode); False when the tokens are not known."""
    return tokens is not None and tokens <= per_sm * num_sms(device)


def fused_as_two_launches(budget: int | None, tokens: int, device: torch.device | str) -> bool:
    """Whether a fused dispatch or combine runs as its send and receive launches: under an SM
    budget with more tokens than SMs, where one launch measured slower (see
    :func:`ray_ep.kernels.dispatch.dispatch_fused`)."""
    return bool(budget) and not small_batch(tokens, device)


def comm_tile(H: int, device: torch.device | str, budget: int | None, kind: str, multiple: int = 8,
              channels: int | None = None, tokens: int | None = None) -> tuple[int, int, int]:
    """(rows, channels, warps) of a dispatch or combine program (``channels``: the step under
    a budget instead of BUDGET_CHANNELS[kind]; ``tokens``: the launch's tokens, if known).

    Without an SM budget: :func:`tile_shape` (one row, many small programs per SM). Under a
    budget the grid is at most ``budget`` programs, so each must fill its SM: BUDGET_ROWS[kind]
    rows at COMM_WARPS warps per row, 1024 threads at 8 rows, and BUDGET_CHANNELS[kind]
    channels per step: one program per SM holds few loads in flight, so each thread takes
    several 16-byte vectors per step (prefill, 2x H200, 24 / 16 SMs: dispatch bf16 250 / 341 us
    at 4 rows x 1024, 261 / 237 at 8 x 1024, 246 / 227 at 8 x 2048; fp8 455 / 654, 345 / 482,
    308 / 428; combine 800 us at 8 rows, 959 at 4; its per-token sum at 4096 channels instead
    of 1024: combine 779 -> 610 / 1115 -> 881 us. Pipelining the channel loop with cp.async,
    2 or 3 stages, was slower for both: dispatch bf16 287-413 us, combine 974-1427 at 24 SMs).

    Without a budget and with at most SMALL_BATCH_TOKENS_PER_SM[kind] tokens per SM (``tokens``:
    decode), a program takes SMALL_BATCH_CHANNELS[kind] of its row per step with a warp per 256
    of them: a row's steps run one after another, so fewer, wider steps end it sooner (decode,
    2x H200, 128 tokens: combine 25.5 -> 22.0 us, from CUDA graphs 25.1 -> 21.3 at 4096 channels
    and 16 warps; 8192 channels 24.2). Dispatch at 2048 channels and 8 warps, against 1024 at 4,
    from CUDA graphs: fp8 25.7 -> 25.2 us on 4x H200, 22.4 -> 21.6 on 2x H200 (bf16 22.2 ->
    22.3); 4096 at 16 warps 23.2, 2048 at 16 warps 24.7 (2x H200, fp8).
    """
    rows, step = tile_shape(H, device, multiple)
    if budget and not interpreted():
        rows = BUDGET_ROWS[kind]
        step = max(multiple, min(channels or BUDGET_CHANNELS[kind], next_power_of_2(H)))
    elif (kind in SMALL_BATCH_CHANNELS and small_batch(tokens, device, SMALL_BATCH_TOKENS_PER_SM[kind])
          and not interpreted()):
        step = max(multiple, min(SMALL_BATCH_CHANNELS[kind], next_power_of_2(H)))
        return rows, step, max(COMM_WARPS, min(32, step // 256))
    return rows, step, COMM_WARPS * rows


def tma_addressable(t: torch.Tensor) -> bool:
    """Whether Hopper bulk copies (TMA) can address ``t``'s rows: last dim contiguous, base and
    the other strides 16-byte aligned (also what 16-byte async copies of its rows need)."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:-1])


def timeouts(cfg) -> tuple[int, int]:
    """(timeout_ns for the GPU timer, max polls for the interpreter, ~1 ms each there) of a
    receive that waits for its peers."""
    return int(cfg.recv_timeout_s * 1e9), max(1, int(cfg.recv_timeout_s * 1000))


@triton.jit
def tile_in_group(tile, tiles_G, tile_ends_G, groups):
    """(group g, g's tile index) of a flat ``tile`` index over the groups' tiles laid end to end
    (``tiles_G`` per group, ``tile_ends_G`` their inclusive cumsum, ``groups`` = arange): the
    persistent loops' map from a tile to its expert or receive region, in the grouped GEMMs
    (Triton, and Gluon inside ``gluon.jit(expert_tile.fn)``). A group with no tiles ends
    where the one before it does, so the count skips it."""
    g = tl.sum((tile_ends_G <= tile).to(tl.int32), axis=0)
    return g, tile - tl.sum(tl.where(groups == g, tile_ends_G - tiles_G, 0), axis=0)


@triton.jit
def expert_tile(tile, experts, tokens_L, m_tiles_L, tiles_L, tile_ends_L):
    """(expert, m tile, o tile, the expert's real rows) of a flat tile index over the experts'
    tiles laid end to end (``tiles_L`` = m tiles x o tiles per expert, ``tile_ends_L`` their
    inclusive cumsum), m fastest inside an expert, so programs in flight share a weight slice:
    the grouped GEMMs' tile order (Triton, and Gluon through ``gluon.jit(expert_tile.fn)``)."""
    e, local = tile_in_group(tile, tiles_L, tile_ends_L, experts)
    this = experts == e
    m_tiles = tl.sum(tl.where(this, m_tiles_L, 0), axis=0)
    tokens = tl.sum(tl.where(this, tokens_L, 0), axis=0)
    o_tile = local // m_tiles
    return e, local - o_tile * m_tiles, o_tile, tokens


# The SwiGLU's sigmoid, 1 / (1 + 2^(-x log2 e)), on the approximate units (ex2.approx.ftz,
# rcp.approx.ftz: 4 instructions) rather than ``tl.sigmoid``'s exp and full division with their
# range fix-ups (~12). Shared by the SwiGLU kernel and the Hopper GEMM's fused SwiGLU epilogue,
# so the two keep the same bits (deepseek-v3's fp8 experts on 4 ranks' rank 0, two H100s:
# 3185 -> 3159 us and 3170 -> 3149, the outputs bit for bit the same as before there;
# docs/perf.md v56, v57).
_SIGMOID_PTX = tl.constexpr("{ .reg .f32 t; mul.ftz.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; "
                            "add.ftz.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }")


@triton.jit
def fast_sigmoid(x):
    """sigmoid(x) of fp32 ``x`` by ``_SIGMOID_PTX`` (``tl.sigmoid`` in the CPU interpreter,
    which runs no PTX): within an ulp or two of ``tl.sigmoid``."""
    if INTERPRETED:
        return tl.sigmoid(x)
    else:
        return tl.inline_asm_elementwise(_SIGMOID_PTX, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
