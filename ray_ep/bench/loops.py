"""Per-rank benchmark loops, run inside the workers through ``EPCluster.run(run_row, ...)``
(:mod:`ray_ep.bench.runner` aggregates the ranks' figures into table rows).

Protocol (docs/benchmarking.md): inputs rotate among a few seeded sets (never zeros); warm-up first;
every timed iteration starts after a barrier across ranks; device time is measured with CUDA
events. Before the events the host queues a short GPU sleep and an on-stream barrier, so the
kernels run back to back on aligned GPUs and the Python launch cost of the phase stays out of
the figure (production decode replays CUDA graphs). On CPU the host clock is used.

Correctness before timing and on the last timed round: each rank checks its own round trip
with identity experts (``combine(dispatch(x))`` must equal ``x * sum(weights)``) and that
every expert-major row belongs to a token that chose that expert. Layer rows: each pipelined
or graph-replayed layer against the serial layer on the same input.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..config import FP8_GROUP, EPConfig, nvfp4_row_bytes
from ..errors import EPInputError
from ..fp8 import dequantize_fp8_torch, quantize_fp8_torch
from ..graphs import LayerGraphs
from ..nvfp4 import dequantize_nvfp4_torch, quantize_nvfp4_torch
from ..inputs import rank_inputs
from ..kernels._util import recorded_launches
from ..kernels.experts import run_experts, shared_experts
from ..kernels.grouped_gemm import grouped_gemm, grouped_gemm_torch
from ..pipeline import moe_layer, moe_micro_batched
from ..reference import FP8_EXPERTS_TOLERANCE
from ..transport.base import Transport
from ..types import DispatchHandle

log = logging.getLogger(__name__)

# The largest error an identity round trip may have, relative to its largest expected value:
# one bf16 rounding of each partial sum and of the output (H200, deepseek-v3 prefill: 2.8e-3
# bf16, 4.2e-3 fp8, 5.7e-3 nvfp4). A row above it is a wrong result, not a slow one: the table
# marks it FAIL, says where it went wrong, and `ray-ep bench` exits with status 1.
ROUND_TRIP_TOL = 2e-2
# A layer's output against the serial layer's on the same input, by expert dtype: the same
# math in another schedule, but a GEMM tile chosen for fewer rows sums in another order, and
# where that tips a bf16 rounding of an fp8 expert's gate_up output, its SwiGLU value lands on
# the next e4m3 step (ray_ep.reference.FP8_EXPERTS_TOLERANCE)
LAYER_TOL = {"bf16": ROUND_TRIP_TOL, "fp8": FP8_EXPERTS_TOLERANCE}
SLEEP_CYCLES = 4_000_000  # ~2 ms at H100/H200 clocks: the host queues a whole phase meanwhile
LAUNCH_TIMING_ITERS = 5  # calls after the timed ones, each launch between a pair of marks


@dataclass(frozen=True)
class RankTimes:
    """One rank's figures for one benchmark row (times in microseconds, per iteration)."""

    rank: int
    times_us: dict[str, list[float]]
    remote_rows: int
    received_rows: int
    check_error: float
    misplaced_rows: int
    flops: int = 0
    """Layer rows: the experts' whole work per iteration (routed rows x 6HF, shared experts)."""
    gemm_flops: float = 0.0
    """Layer rows: floating-point operations of this rank's two expert GEMMs (real rows only)."""
    weight_bytes: int = 0
    """Layer rows: bytes of this rank's routed expert weights (each GEMM reads them at least once)."""
    launches: dict[str, list[tuple[str, int, int]]] = field(default_factory=dict)
    """Per op: (kernel, programs, most SMs occupied) of each communication kernel launch of one call
    (ray_ep's kernels; empty for the torch backend)."""
    launch_us: dict[str, list[float]] = field(default_factory=dict)
    """Per op: the median time of each of those launches (:func:`launch_times`)."""
    host_us: dict[str, list[float]] = field(default_factory=dict)
    """Eager layer rows: per call, the host's time from calling the layer to its return (its
    launches from Python; nothing in it waits for the device): a row whose host time reaches its
    device time is bound by the host."""
    check_detail: str = ""
    """A failed check (error above ROUND_TRIP_TOL, or misplaced rows): where (:func:`where_wrong`)."""
    layer_checks: dict[str, float] = field(default_factory=dict)
    """Layer rows other than the serial layer (micro-batched, replayed from CUDA graphs): the
    largest difference of the op's output from the serial layer's on the same input, relative to
    the serial layer's largest value (:func:`relative_error`)."""
    layer_check_details: dict[str, str] = field(default_factory=dict)
    """The same ops: where the output differs, if by more than LAYER_TOL of the expert dtype."""

    def to_dict(self) -> dict:
        return asdict(self)


def identity_outputs(h: DispatchHandle) -> torch.Tensor:
    """Expert outputs of identity experts: y[m] = the dispatched row (dequantised), bf16."""
    return h.expert_major_rows().to(torch.bfloat16)


def placement(h: DispatchHandle, cfg: EPConfig, rank: int) -> tuple[int, str]:
    """(misplaced rows, where) of a receive: expert-major rows whose token did not choose the
    segment's expert (must be 0), and in one line ('' when none) how many of them name a row
    past what its source sent this round (a position this round's receive never wrote: a gap
    or a collision among the ordinals, or wrong counts) and their local experts. Read the
    handle before the combine on several ranks: after it a peer may already be dispatching the
    next round into this rank's received rows."""
    if not h.meta_rows.shape[0]:  # the torch backend's packed receive: nothing arrived
        return 0, ""
    L, K, N = cfg.experts_per_rank, cfg.top_k, cfg.max_tokens_per_rank
    r = h.recv
    offs = r.row_offsets_L1.long()
    seg = torch.searchsorted(offs[1:], torch.arange(r.row_ids_M.numel(), device=offs.device), right=True)
    ids = r.row_ids_M.long()
    real = (ids >= 0) & (seg < L)
    chosen = h.meta_rows[ids.clamp(min=0)][:, :K].long()
    bad = real & ~(chosen == (rank * L + seg)[:, None]).any(dim=1)
    n = int(bad.sum())
    if not n:
        return 0, ""
    j = ids[bad]
    stale = int((j % N >= r.recv_counts_R.long()[j // N]).sum())
    return n, (f"{n} expert-major rows of tokens that did not choose the expert ({stale} of them name a row past "
               f"what its source sent this round), local experts {_spans(torch.unique(seg[bad]).tolist())}")


def expected_round_trip(x: torch.Tensor, w: torch.Tensor, cfg: EPConfig) -> torch.Tensor:
    if cfg.dispatch_dtype == "fp8":
        x = dequantize_fp8_torch(*quantize_fp8_torch(x), out_dtype=torch.float32)
    elif cfg.dispatch_dtype == "nvfp4":
        x = dequantize_nvfp4_torch(*quantize_nvfp4_torch(x), out_dtype=torch.float32)
    return x.float() * w.sum(-1, keepdim=True)


def relative_error(out: torch.Tensor, exp: torch.Tensor) -> float:
    """The largest |out - exp| relative to the largest |exp| (0 for no rows): what every check
    of the benchmark compares against its tolerance."""
    if not exp.shape[0]:
        return 0.0
    exp = exp.float()
    return ((out.float() - exp).abs().max() / exp.abs().max().clamp_min(1e-6)).item()


def round_trip_error(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, cfg: EPConfig) -> float:
    """Largest error of an identity-expert round trip relative to the largest expected value."""
    return relative_error(out, expected_round_trip(x, w, cfg)) if x.shape[0] else 0.0


def _spans(values: list[int], most: int = 6) -> str:
    """Sorted ints as ranges, "0-3, 7, 9-12", at most ``most`` of them ("... (n ranges)")."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:most])
    return text + (f", ... ({len(spans)} ranges)" if len(spans) > most else "")


def where_wrong(out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, cfg: EPConfig) -> str:
    """Where a round trip is wrong, in one line (:func:`where_off` against its expected value)."""
    return where_off(out, expected_round_trip(x, w, cfg), ids, cfg) if x.shape[0] else ""


def where_off(out: torch.Tensor, exp: torch.Tensor, ids: torch.Tensor, cfg: EPConfig, tol: float = ROUND_TRIP_TOL
              ) -> str:
    """Where ``out`` [T, H] is off ``exp``, in one line: how many tokens, and for the worst one
    which channels (by groups of FP8_GROUP: a group or a few alone point at fp8 scales), the
    ratio of its output to the expected value over them (one ratio across the whole row: a share
    of one expert lost or doubled; ratios all over: another token's data) and the ranks its
    experts (``ids``) live on. Empty when every value is within ``tol`` of the largest."""
    if not exp.shape[0]:
        return ""
    exp = exp.float()
    err = (out.float() - exp).abs() / exp.abs().max().clamp_min(1e-6)
    wrong = err > tol
    if not bool(wrong.any()):
        return ""
    t = int(err.amax(dim=1).argmax())
    cols = wrong[t].nonzero().flatten()
    groups = torch.unique(cols // FP8_GROUP).tolist()
    known = cols[exp[t, cols] != 0]
    ratio = (out[t, known].float() / exp[t, known]).cpu() if known.numel() else torch.zeros(1)
    ranks = sorted({int(e) // cfg.experts_per_rank for e in ids[t].tolist() if 0 <= e < cfg.n_experts})
    return (f"{int(wrong.any(dim=1).sum())} of {exp.shape[0]} tokens wrong; the worst, token {t}: {cols.numel()} of "
            f"{exp.shape[1]} channels in {len(groups)} group(s) of {FP8_GROUP} ({_spans(groups)}), out / expected "
            f"{ratio.median():.3g} ({ratio.min():.3g} to {ratio.max():.3g}), its experts on ranks {ranks}")


def round_trip_figures(h: DispatchHandle, out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                       cfg: EPConfig, rank: int, placed: tuple[int, str] | None = None
                       ) -> tuple[float, int, int, int, str]:
    """(round-trip error, misplaced rows, rows sent to other ranks, rows received, where it
    failed: :func:`placement`, :func:`where_wrong`; '' when it passed) of one checked
    dispatch + identity-expert combine. ``placed``: :func:`placement` taken before the
    combine; else it is read now, so a caller on several ranks must keep peers from
    dispatching again until every rank is done here."""
    remote = int(h.layout.rank_counts_R.sum() - h.layout.rank_counts_R[rank])
    bad, where = placed if placed is not None else placement(h, cfg, rank)
    err = round_trip_error(out, x, w, cfg)
    wrong = where_wrong(out, x, ids, w, cfg) if err > ROUND_TRIP_TOL else ""
    detail = "; ".join(part for part in (where, wrong) if part)
    return err, bad, remote, int(h.recv.recv_counts_R.sum()), detail


def soak(t: Transport, cfg: EPConfig, rank: int, device: torch.device, *, rounds: int, num_tokens: int,
         routing: str, fused: bool, seed: int = 0) -> dict:
    """``rounds`` dispatch + combine rounds in a row on the same buffers, fresh inputs each
    round, identity experts: the largest round-trip error and misplaced rows seen."""
    worst, bad, detail = 0.0, 0, ""
    for i in range(rounds):
        x, ids, w = rank_inputs(cfg, num_tokens, rank, seed + i, routing, device=device)
        h = t.dispatch(x, ids, w, fused=fused)
        # the received rows before the combine: after it a faster peer may already be
        # dispatching the next round into them (no barrier between rounds here)
        placed = placement(h, cfg, rank)
        out = t.combine(identity_outputs(h), h, torch.bfloat16, fused=fused)
        err, misplaced, _, _, where = round_trip_figures(h, out, x, ids, w, cfg, rank, placed=placed)
        if where and not detail:  # the first failed round says where
            detail = f"round {i}: {where}"
        worst, bad = max(worst, err), bad + misplaced
    return {"rank": rank, "max_rel_error": worst, "misplaced_rows": bad, "rounds": rounds, "detail": detail}


class Clock:
    """CUDA events on GPUs (with the sleep + on-stream barrier), the host clock on CPUs.
    ``transport`` None: one process alone (no barriers; on a GPU it waits for the device first)."""

    def __init__(self, device: torch.device, transport: Transport | None):
        self.cuda = device.type == "cuda"
        self.t = transport

    def start(self):
        if self.t is not None:
            self.t.barrier()  # host-level: every rank is here
        elif self.cuda:
            torch.cuda.synchronize()
        if not self.cuda:
            return time.perf_counter()
        torch.cuda._sleep(SLEEP_CYCLES)
        if self.t is not None:
            self.t.device_barrier()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, start) -> float:
        if not self.cuda:
            return (time.perf_counter() - start) * 1e6
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        ev.synchronize()
        return start.elapsed_time(ev) * 1e3


def bench_comm(t: Transport, cfg: EPConfig, rank: int, device: torch.device, *, num_tokens: int, routing: str,
               seed: int, iters: int, warmup: int, fused: bool, sets: int = 3) -> RankTimes:
    """Dispatch and combine (identity experts between them), each timed on its own. The form
    timed is checked before timing and again on the last timed round (after many rounds on the
    same buffers)."""
    inputs = [rank_inputs(cfg, num_tokens, rank, seed + i, routing, device=device) for i in range(sets)]
    x, ids, w = inputs[0]
    h = t.dispatch(x, ids, w, fused=fused)
    first = round_trip_figures(h, t.combine(identity_outputs(h), h, torch.bfloat16, fused=fused), x, ids, w, cfg,
                               rank)
    clock = Clock(device, t)
    times: dict[str, list[float]] = {"dispatch": [], "combine": []}
    launches = {}
    with t.deferred_checks():  # no host sync inside the timed region
        for i in range(warmup + iters):
            ops, h, out = _round_trip(t, clock, inputs[i % sets], fused)
            for op, (us, rec) in ops.items():
                launches.setdefault(op, [(r.kernel, r.programs, r.sms) for r in rec])
                if i >= warmup:
                    times[op].append(us)
        x, ids, w = inputs[(warmup + iters - 1) % sets]
        last = round_trip_figures(h, out, x, ids, w, cfg, rank)  # before other rounds reuse the buffers
        launch_us = launch_times(t, inputs, clock, fused)
    err, bad, detail = _both_checks(first, last)
    return RankTimes(rank, times, first[2], first[3], err, bad, launches=launches, launch_us=launch_us,
                     check_detail=detail)


def _both_checks(first: tuple, last: tuple) -> tuple[float, int, str]:
    """(error, misplaced rows, where) of a row's two checks (:func:`round_trip_figures`): the
    first round and the last timed one."""
    where = "; ".join(f"{when}: {d}" for when, d in (("first round", first[4]), ("last timed round", last[4])) if d)
    return max(first[0], last[0]), first[1] + last[1], where


def _round_trip(t: Transport, clock: Clock, inputs: tuple, fused: bool, timed: bool = False
                ) -> tuple[dict[str, tuple], DispatchHandle, torch.Tensor]:
    """A dispatch of ``inputs`` (x, ids, weights), then a combine of identity experts' rows,
    each started after the clock's barrier: (per op (microseconds, its launch records; with
    ``timed``, each launch between a pair of marks), the handle, the combine's output)."""
    x, ids, w = inputs
    s = clock.start()
    with recorded_launches(timed) as dispatched:
        h = t.dispatch(x, ids, w, fused=fused)
    d_us = clock.stop(s)
    y = identity_outputs(h)
    s = clock.start()
    with recorded_launches(timed) as combined:
        out = t.combine(y, h, torch.bfloat16, fused=fused)
    return {"dispatch": (d_us, dispatched), "combine": (clock.stop(s), combined)}, h, out


def launch_times(t: Transport, inputs: list, clock: Clock, fused: bool,
                 iters: int = LAUNCH_TIMING_ITERS) -> dict[str, list[float]]:
    """Per op, the median time of each communication kernel launch of a dispatch and of a
    combine, over ``iters`` calls made after the timed ones (a pair of marks around every
    launch would cost the timed calls a little). A receive's time includes its wait for the
    slowest peer's send. Empty where nothing is launched through ray_ep's kernels."""
    calls: dict[str, list[list]] = {"dispatch": [], "combine": []}
    for i in range(iters):
        for op, (_, rec) in _round_trip(t, clock, inputs[i % len(inputs)], fused, timed=True)[0].items():
            calls[op].append(rec)
    return {op: [statistics.median(r.elapsed_us() for r in same) for same in zip(*recs)]
            for op, recs in calls.items() if recs and all(len(r) == len(recs[0]) for r in recs)}


def bench_comm_graphs(t: Transport, cfg: EPConfig, rank: int, device: torch.device, *, num_tokens: int, routing: str,
                      seed: int, iters: int, warmup: int, fused: bool, sets: int = 3) -> RankTimes:
    """Dispatch and combine each captured once in a CUDA graph (as decode steps run in
    production), then replayed on new inputs copied into the captured ones; each replay timed
    on its own, as :func:`bench_comm` times the eager calls. The first and the last replay are checked."""
    inputs = [rank_inputs(cfg, num_tokens, rank, seed + i, routing, device=device) for i in range(sets)]
    x, ids, w = (v.clone() for v in inputs[0])
    h = t.dispatch(x, ids, w, fused=fused)  # eager once: compiles, fills the allocator's pool
    t.combine(identity_outputs(h), h, torch.bfloat16, fused=fused)
    torch.cuda.synchronize()
    g_dispatch, g_combine = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with t.deferred_checks():  # no host sync may happen inside a capture
        with torch.cuda.graph(g_dispatch):
            h = t.dispatch(x, ids, w, fused=fused)
        y = torch.zeros(cfg.max_recv_rows, cfg.hidden_size, dtype=torch.bfloat16, device=device)
        with torch.cuda.graph(g_combine):
            out = t.combine(y, h, torch.bfloat16, fused=fused)
    clock = Clock(device, t)
    times: dict[str, list[float]] = {"dispatch": [], "combine": []}
    first = None
    for i in range(warmup + iters):
        xi, idsi, wi = inputs[i % sets]
        x.copy_(xi)
        ids.copy_(idsi)
        w.copy_(wi)
        s = clock.start()
        g_dispatch.replay()
        d_us = clock.stop(s)
        y.copy_(identity_outputs(h))
        s = clock.start()
        g_combine.replay()
        c_us = clock.stop(s)
        t.check_status()  # a timeout or overflow flagged during the replays
        if i == 0:
            first = round_trip_figures(h, out, xi, idsi, wi, cfg, rank)
        if i >= warmup:
            times["dispatch"].append(d_us)
            times["combine"].append(c_us)
    err, bad, detail = _both_checks(first, round_trip_figures(h, out, xi, idsi, wi, cfg, rank))  # and the last replay
    return RankTimes(rank, times, first[2], first[3], err, bad, check_detail=detail)


def expert_flops(cfg: EPConfig, expert_rows: int, num_tokens: int) -> int:
    """Multiply-adds x 2 of a rank's experts: the routed experts over ``expert_rows`` rows
    (gate_up H -> 2F, down F -> H) and the shared experts over its own ``num_tokens``."""
    per_row = 2 * cfg.hidden_size * 3 * cfg.intermediate_size
    return per_row * (expert_rows + cfg.n_shared_experts * num_tokens)


def bench_layer(t: Transport, cfg: EPConfig, rank: int, device: torch.device, *, experts, scratch, num_tokens: int,
                routing: str, seed: int, iters: int, warmup: int, sets: int = 3,
                micro: tuple[list[Transport], list] | None = None, cuda_graph: bool = False) -> RankTimes:
    """A whole MoE layer (dispatch, grouped-GEMM experts, combine, shared experts: the layer
    :meth:`ray_ep.EPCommunicator.moe` runs, :func:`ray_ep.pipeline.moe_layer`) and, on the
    same dispatch, the experts alone (no communication: what the layer would take if
    communication were free). ``flops`` is the experts' work on the first input set.
    ``micro``: (transports, scratches) of micro-batches: the pipelined layer is timed too
    (``layer-mb<n>``, :func:`ray_ep.pipeline.moe_micro_batched`). ``cuda_graph`` (GPUs): both
    layers also replayed from CUDA graphs (``layer-graph``, ``layer-mb<n>-graph``:
    :class:`ray_ep.graphs.LayerGraphs`, inputs copied in and the output out, the flags checked
    after each replay), which the host's launches then do not hold up.

    Then, on the rows and weights of the last round: ``gemm``, this rank's two expert GEMMs
    (gate_up over the dispatched rows, down over the SwiGLU output) as the layer runs them;
    and ``gemm-torch``, torch's own grouped GEMM over the same rows and weights
    (:func:`torch_expert_gemms`), where this torch build has one for the weights' dtype.

    Each layer other than the serial one is checked against it on the same input, at the second
    iteration (the first replay of a graph, whose first call captures): ``layer_checks``."""
    inputs = [rank_inputs(cfg, num_tokens, rank, seed + i, routing, device=device) for i in range(sets)]
    check_at = min(1, warmup + iters - 1)
    outs: dict[str, torch.Tensor] = {}  # each layer's output at check_at
    clock = Clock(device, t)
    times: dict[str, list[float]] = {"layer": [], "experts": []}
    host_us: dict[str, list[float]] = {}
    remote = received = flops = 0
    replayed = {}  # row -> (graphs, layer function, the transports it uses)
    if cuda_graph and device.type == "cuda":
        replayed["layer-graph"] = (LayerGraphs(t, cfg.max_tokens_per_rank),
                                   lambda a, b, c: moe_layer(t, scratch, experts, a, b, c, torch.bfloat16)[0], None)
        if micro is not None:
            replayed[f"layer-mb{len(micro[0])}-graph"] = (
                LayerGraphs(micro[0][0], cfg.max_tokens_per_rank),
                lambda a, b, c: moe_micro_batched(micro[0], micro[1], experts, a, b, c, torch.bfloat16), micro[0])

    def timed(op: str, fn, keep: bool, eager: bool = True):
        """fn() timed on the device and, ``eager`` (launched from Python, no host sync inside),
        the host's time to return from it (its launches)."""
        s = clock.start()
        h0 = time.perf_counter()
        res = fn()
        host = (time.perf_counter() - h0) * 1e6
        us = clock.stop(s)
        if keep:
            times.setdefault(op, []).append(us)
            if eager:
                host_us.setdefault(op, []).append(host)
        return res

    with contextlib.ExitStack() as deferred:  # no host sync inside the timed regions
        for tr in [t, *(micro[0] if micro else [])]:
            deferred.enter_context(tr.deferred_checks())
        for i in range(warmup + iters):
            x, ids, w = inputs[i % sets]
            keep = i >= warmup
            out, h = timed("layer", lambda: moe_layer(t, scratch, experts, x, ids, w, torch.bfloat16), keep)
            if i == check_at:
                outs["layer"] = out.clone()
            # the dispatched rows stay in the buffers until the next dispatch, which no rank
            # starts before the next iteration's barriers
            timed("experts", lambda: experts_alone(h, experts, scratch, x), keep)
            if micro is not None:
                op = f"layer-mb{len(micro[0])}"
                out = timed(op, lambda: moe_micro_batched(micro[0], micro[1], experts, x, ids, w, torch.bfloat16), keep)
                if i == check_at:
                    outs[op] = out.clone()
            for op, (graphs, fn, used) in replayed.items():  # the first call of each captures
                # a replay checks its flags on the host (a sync): no host time to report
                out = timed(op, lambda: graphs.moe(op, fn, x, ids, w, transports=used), keep, eager=False)
                if i == check_at:
                    outs[op] = out.clone()
            if i == 0:
                remote = int(h.layout.rank_counts_R.sum() - h.layout.rank_counts_R[rank])
                received = int(h.recv.recv_counts_R.sum())
                flops = expert_flops(cfg, int(h.recv.num_tokens_L.sum()), x.shape[0])
        # the last round's handle stays valid until the next dispatch: time the GEMMs on it
        gemms = {"gemm": expert_gemms(h, experts, scratch)}
        theirs = torch_expert_gemms(h, experts, scratch)
        if theirs is not None:
            gemms["gemm-torch"] = theirs
        for op, fn in gemms.items():
            times[op] = []
            for i in range(warmup + iters):
                s = clock.start()
                fn()
                us = clock.stop(s)
                if i >= warmup:
                    times[op].append(us)
    H, Fi = cfg.hidden_size, cfg.intermediate_size
    gemm_flops = 2.0 * int(h.recv.num_tokens_L.sum()) * (H * 2 * Fi + Fi * H)
    wbytes = sum(w.numel() * w.element_size() for w in (experts.w_gate_up_LHF2, experts.w_down_LFH,
                                                         experts.w_gate_up_scales, experts.w_down_scales)
                 if w is not None)
    ids = inputs[check_at % sets][1]
    serial = outs.pop("layer")
    tol = LAYER_TOL[cfg.expert_dtype]
    # the same math in another schedule: up to a bf16 rounding where sums run in another order
    checks = {op: relative_error(out, serial) for op, out in outs.items()}
    details = {op: where_off(outs[op], serial, ids, cfg, tol) for op, d in checks.items() if d > tol}
    return RankTimes(rank, times, remote, received, 0.0, 0, flops, gemm_flops, wbytes, host_us=host_us,
                     layer_checks=checks, layer_check_details=details)


def experts_alone(h: DispatchHandle, experts, scratch, x_TH: torch.Tensor) -> None:
    """The layer's experts without its communication (the ``experts`` row): the routed experts
    over the rows ``h`` received, then the shared experts over this rank's own tokens ``x_TH``."""
    run_experts(handle=h, experts=experts, scratch=scratch)
    shared_experts(x_TH, experts)


def expert_gemms(h: DispatchHandle, experts, scratch):
    """A call that runs this rank's two expert GEMMs (gate_up into ``scratch.h_M2F``, down from
    ``scratch.a_MF`` into ``scratch.y_MH``), SwiGLU left out: the products torch's grouped GEMM
    is compared with. (With fp8 weights on Hopper, :func:`run_experts` runs the SwiGLU inside
    the gate_up GEMM instead, and never writes ``h_M2F``.)"""
    on_gpu = h.x_rows.device.type == "cuda"
    gemm = grouped_gemm if on_gpu else grouped_gemm_torch
    r = h.recv
    segs = dict(row_offsets_L1=r.row_offsets_L1, num_tokens_L=r.num_tokens_L)
    # CPU scratch holds the rows that arrived (run_experts_torch), GPU scratch every capacity row
    n = slice(None) if on_gpu else slice(0, int(r.row_offsets_L1[-1]))
    a_scales = scratch.a_scales_MG[n] if scratch.a_scales_MG is not None else None

    def run():
        gemm(a=h.x_rows, a_scales=h.scales_rows, a_row_ids=r.row_ids_M[n], b_LDO=experts.w_gate_up_LHF2,
             b_scales=experts.w_gate_up_scales, out=scratch.h_M2F[n], **segs)
        gemm(a=scratch.a_MF[n], a_scales=a_scales, b_LDO=experts.w_down_LFH, b_scales=experts.w_down_scales,
             out=scratch.y_MH[n], **segs)
    return run


def torch_expert_gemms(h: DispatchHandle, experts, scratch):
    """The baseline of :func:`expert_gemms`: torch's grouped GEMM over the same expert-major
    rows and weights, or None where this torch has none for them.

    bf16 weights: ``torch._grouped_mm`` on the rows gathered and dequantised to bf16 beforehand
    (outside the timing). fp8 weights: ``torch._scaled_grouped_mm`` on the fp8 rows, with the
    one scale per row and per output column that it supports (ones: the bytes and the
    tensor-core work of a 128 x 128 block-scaled GEMM, not its values). Whether it exists is
    probed on a small problem of the same dtypes and device, never on this rank's rows, so every
    rank decides alike (the timing loop has barriers): a build without a kernel for this device
    (no fp8 grouped GEMM on CPU) gives None, logged."""
    fp8 = experts.fp8
    fn = getattr(torch, "_scaled_grouped_mm" if fp8 else "_grouped_mm", None)
    if fn is None:
        return None
    w1, w2 = experts.w_gate_up_LHF2, experts.w_down_LFH
    dev = w1.device
    try:
        probe = torch.zeros(16, w1.shape[1], device=dev).to(w1.dtype)
        one = torch.tensor([16], dtype=torch.int32, device=dev)
        if fp8:
            fn(probe, w1[:1], torch.ones(16, device=dev), torch.ones(1, w1.shape[2], device=dev), offs=one,
               out_dtype=torch.bfloat16)
        else:
            fn(probe, w1[:1], offs=one)
    except (RuntimeError, NotImplementedError) as e:
        log.warning("no %s baseline here: %s", fn.__name__, str(e).split(". ")[0][:200])
        return None
    r = h.recv
    M = int(r.row_offsets_L1[-1])  # a host sync, before any timing
    offs = r.row_offsets_L1[1:].contiguous()  # each expert's end row: torch's group offsets
    a1 = h.expert_major_rows(M).to(torch.bfloat16)
    a2 = scratch.a_MF[:M]
    if M == 0:  # nothing arrived: nothing to multiply (torch may refuse empty groups)
        return lambda: None
    if fp8:
        a1 = quantize_fp8_torch(a1)[0]
        L = w1.shape[0]
        ones = [torch.ones(M, device=dev), torch.ones(L, w1.shape[2], device=dev),
                torch.ones(M, device=dev), torch.ones(L, w2.shape[2], device=dev)]

        def run():
            fn(a1, w1, ones[0], ones[1], offs=offs, out_dtype=torch.bfloat16)
            fn(a2, w2, ones[2], ones[3], offs=offs, out_dtype=torch.bfloat16)
    else:
        def run():
            fn(a1, w1, offs=offs)
            fn(a2, w2, offs=offs)
    return run


def bench_alltoall(t: Transport, cfg: EPConfig, rank: int, device: torch.device, *, rows_per_peer: int,
                   iters: int, warmup: int) -> RankTimes:
    """Raw all_to_all_single of bf16 rows [H], equal splits (the NCCL reference figure)."""
    import torch.distributed as dist

    R, H = cfg.world_size, cfg.hidden_size
    g = torch.Generator(device=device).manual_seed(rank)
    inp = torch.randn(R * rows_per_peer, H, generator=g, device=device).to(torch.bfloat16)
    out = torch.empty_like(inp)
    clock = Clock(device, t)
    times: dict[str, list[float]] = {"all_to_all": []}
    for i in range(warmup + iters):
        s = clock.start()
        dist.all_to_all_single(out, inp)
        us = clock.stop(s)
        if i >= warmup:
            times["all_to_all"].append(us)
    return RankTimes(rank, times, (R - 1) * rows_per_peer, R * rows_per_peer, 0.0, 0)


def bench_peer_copy(t: Transport, rank: int, device: torch.device, *, nbytes: int, iters: int,
                    warmup: int) -> RankTimes:
    """Copy-engine copy of ``nbytes`` from rank 0 into rank 1's symmetric block (one pair,
    one way: the practical NVLink ceiling). Other ranks only join the barriers."""
    bufs = t.bufs
    times: dict[str, list[float]] = {"peer_copy": []}
    clock = Clock(device, t)
    src = dst = None
    if rank == 0:
        peer = bufs.peers[1]["combine.recv.x"].view(-1).view(torch.uint8)
        n = min(nbytes, peer.numel())
        dst = peer[:n]
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    for i in range(warmup + iters):
        s = clock.start()
        if dst is not None:
            dst.copy_(src, non_blocking=True)
        us = clock.stop(s)
        if i >= warmup:
            times["peer_copy"].append(us)
    n = dst.numel() if dst is not None else 0
    return RankTimes(rank, times, n, n, 0.0, 0)


def row_bytes(cfg: EPConfig, phase: str) -> int:
    """Payload bytes of one row on the wire (meta rows excluded): bf16 2H, fp8 H + 4H/128,
    nvfp4 the wire row (H/2 + H/16, padded to 16 bytes)."""
    H = cfg.hidden_size
    if phase == "dispatch":
        if cfg.dispatch_dtype == "nvfp4":
            return nvfp4_row_bytes(H)
        return H + 4 * H // FP8_GROUP if cfg.dispatch_dtype == "fp8" else 2 * H
    return H * (2 if cfg.combine_dtype == "bf16" else 4)


def run_row(worker, kind: str, *, group: str = "main", backend: str | None = None, **kwargs) -> dict:
    """One benchmark row on this rank, run as ``EPCluster.run(run_row, kind, ...)``
    (collective: every rank at once).

    kind: ``comm`` (dispatch and combine), ``comm_graphs`` (the same, replayed from CUDA
    graphs), ``layer`` (whole MoE layer; loads seeded experts if the group has none),
    ``all_to_all`` (raw NCCL, equal splits), ``peer_copy`` (copy engine, rank 0 -> rank 1),
    ``soak`` (many correctness rounds in a row, no timing).
    """
    g = worker.group_state(group)
    rank, device = worker.rank, worker.device
    if kind == "comm":
        return bench_comm(worker.transport(backend, group), g.cfg, rank, device, **kwargs).to_dict()
    if kind == "comm_graphs":
        return bench_comm_graphs(worker.transport(backend, group), g.cfg, rank, device, **kwargs).to_dict()
    if kind == "layer":
        if 0 not in g.experts:
            worker.load_experts(seed=0, group=group, draw_on_device=True)  # timing only: no reference
        n = kwargs.pop("micro_batches", 1)
        micro = None
        if n > 1:
            parts = g.comm.micro_batch_communicators(n)  # collective on first use
            micro = ([c.transport(backend) for c in parts], [c.scratch for c in parts])
        return bench_layer(worker.transport(backend, group), g.cfg, rank, device, experts=g.experts[0],
                           scratch=g.comm.scratch, micro=micro, **kwargs).to_dict()
    if kind == "soak":
        return soak(worker.transport(backend, group), g.cfg, rank, device, **kwargs)
    if kind == "all_to_all":
        return bench_alltoall(worker.transport("torch", group), g.cfg, rank, device, **kwargs).to_dict()
    if kind == "peer_copy":
        return bench_peer_copy(worker.transport("nvshmem", group), rank, device, **kwargs).to_dict()
    raise EPInputError(f"unknown benchmark kind {kind!r}: use comm, comm_graphs, layer, soak, all_to_all or "
                       f"peer_copy")
