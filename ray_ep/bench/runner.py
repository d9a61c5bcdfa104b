"""Benchmarks: ray_ep's dispatch / combine / MoE layer beside the baselines, in one run.

``python -m ray_ep.bench`` (or ``ray-ep bench``) prints a table and can write JSON and a plot.
Protocol (docs/benchmarking.md): per preset a correctness check before timing, warm-up, >= 50 timed
iterations each after a barrier across ranks, rotating inputs; per rank the median, and the
maximum over ranks (the slowest rank sets the layer's time), p10 / p90 beside it. Baselines
in the same run: the NCCL pipeline (``torch`` backend), raw all_to_all_single with equal
splits, and the copy-engine peer copy of one GPU pair.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Sequence

import ray
from tqdm import tqdm

from ..config import EPConfig, describe_config_error
from ..driver import EPCluster
from ..errors import EPInputError
from .loops import LAYER_TOL, ROUND_TRIP_TOL, row_bytes, run_row

# docs/benchmarking.md presets: model preset, tokens per rank, dispatch dtypes
BENCH_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3-prefill": {"model": "deepseek-v3", "tokens": 4096, "dtypes": ["bf16", "fp8"]},
    "deepseek-v3-decode": {"model": "deepseek-v3", "tokens": 128, "dtypes": ["fp8", "bf16"]},
    "qwen3-moe-prefill": {"model": "qwen3-moe", "tokens": 4096, "dtypes": ["bf16"]},
    "mixtral-prefill": {"model": "mixtral", "tokens": 4096, "dtypes": ["bf16"]},
    # F 128 instead of the model preset's 64, so --expert-dtype fp8 runs here too (its GEMMs
    # reduce over whole 128 x 128 weight blocks)
    "tiny": {"model": "tiny", "tokens": 32, "dtypes": ["bf16", "fp8"], "overrides": {"intermediate_size": 128}},
}
EXPERT_DTYPES = ("bf16", "fp8")  # what --expert-dtype takes (EPConfig.expert_dtype)
DISPATCH_DTYPES = ("bf16", "fp8", "nvfp4")  # what --dispatch-dtype takes (EPConfig.dispatch_dtype)
# Table labels of run_bench's backends, by what ran: the torch backend's pipeline runs over NCCL on
# GPUs and over gloo on CPU workers.
BACKEND_LABELS = {"nvshmem": "ray_ep", "torch": "nccl-pipeline"}
CPU_BACKEND_LABELS = {"torch": "gloo-pipeline"}
PLOT_NEEDS = "--plot needs matplotlib: pip install 'ray-ep[plot]'"


def preset_config(preset: str, **fields: Any) -> EPConfig:
    """The EPConfig of BENCH_PRESETS[preset]: its model preset, its overrides, then ``fields``."""
    spec = BENCH_PRESETS[preset]
    return EPConfig.preset(spec["model"], **{**spec.get("overrides", {}), **fields})


def backend_label(backend: str, gpu_workers: bool) -> str:
    """The table's name of a run_bench backend (``nvshmem`` / ``torch``) on GPU or CPU workers."""
    if not gpu_workers and backend in CPU_BACKEND_LABELS:
        return CPU_BACKEND_LABELS[backend]
    return BACKEND_LABELS[backend]


@dataclass(frozen=True)
class BenchRow:
    """One line of the table: times in microseconds (median of the slowest rank)."""

    preset: str
    backend: str
    op: str
    dtype: str
    routing: str
    tokens: int
    world_size: int
    sms: str
    median_us: float
    p10_us: float
    p90_us: float
    per_rank_median_us: list[float]
    remote_gbps: float
    received_gbps: float
    check_error: float | None = None
    misplaced_rows: int = 0
    topology: str = ""
    """n_nodes x gpus_per_node, e.g. 1x4 (one node) or 2x2 (other-node ranks get NVSHMEM puts)."""
    experts: str = "-"
    """Layer and GEMM rows: the routed experts' weight dtype (bf16 or fp8); '-' otherwise."""
    tflops: float | None = None
    """Layer, experts and GEMM rows: TFLOP/s per rank of the experts' work (layer and experts rows:
    routed rows x 6HF plus shared experts; GEMM rows: the two routed GEMMs) over the row's time."""
    weight_gbps: float | None = None
    """GEMM rows: routed expert weight bytes / median per rank (the decode bound: weights read once)."""
    launches: list = field(default_factory=list)
    """Dispatch and combine rows of ray_ep's kernels: [kernel, programs, most SMs occupied] of each
    launch of one call (rank 0's), in launch order."""
    launch_us: list = field(default_factory=list)
    """The same rows: the time of each of those launches in microseconds, the slowest rank's
    median over a few calls after the timed ones (a receive's includes its wait for peers)."""
    host_us: float | None = None
    """Eager layer and experts rows: the slowest rank's median host time from calling the layer
    to its return (its launches from Python); at or above median_us the row is host-bound."""
    check_tol: float = ROUND_TRIP_TOL
    """The largest check_error that passes: ROUND_TRIP_TOL, or a layer row's LAYER_TOL."""
    check_detail: str = ""
    """A failed check: where, per rank ("rank 2: 3 of 4096 tokens wrong; ...", see
    :func:`ray_ep.bench.loops.where_wrong`); empty when it passed."""

    @property
    def check_failed(self) -> bool:
        """A checked row off by more than check_tol (its round trip, or a layer's output
        against the serial layer's), or with misplaced rows."""
        return self.check_error is not None and (self.check_error > self.check_tol or self.misplaced_rows > 0)

    @property
    def sms_used(self) -> str:
        """The most SMs each launch occupied, in launch order ("108/24": a pass on 108 SMs, then a
        receive on 24); '-' where nothing was recorded."""
        return "/".join(str(sms) for _, _, sms in self.launches) or "-"

    @property
    def us_per_launch(self) -> str:
        """:attr:`launch_us` rounded, in launch order ("9/301/18"); '-' where none was timed."""
        return "/".join(f"{us:.0f}" for us in self.launch_us) or "-"


@dataclass
class BenchResult:
    rows: list[BenchRow] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def table(self) -> str:
        ow = max([11] + [len(r.op) + 1 for r in self.rows])  # layer-mb2-graph is wider than the rest
        head = (f"{'preset':<21}{'backend':<15}{'topo':<5}{'op':<{ow}}{'dtype':<6}{'wts':<5}{'routing':<9}{'T/rank':>7}"
                f"{'SMs':>5} {'SMs used':>14}{'median us':>11}{'p10':>9}{'p90':>9}{'remote GB/s':>12}{'recv GB/s':>10}"
                f"{'check':>10}{'TFLOP/s':>9}{'wt GB/s':>9}{'host us':>9} {'us per launch':>14}")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            chk = ("-" if r.check_error is None else "MISPLACED" if r.misplaced_rows else "FAIL" if r.check_failed
                   else f"{r.check_error:.1e}")
            tf = "-" if r.tflops is None else f"{r.tflops:.1f}"
            wg = "-" if r.weight_gbps is None else f"{r.weight_gbps:.0f}"
            hu = "-" if r.host_us is None else f"{r.host_us:.0f}"
            lines.append(f"{r.preset:<21}{r.backend:<15}{r.topology:<5}{r.op:<{ow}}{r.dtype:<6}{r.experts:<5}{r.routing:<9}"
                         f"{r.tokens:>7}{r.sms:>5} {r.sms_used:>14}{r.median_us:>11.1f}{r.p10_us:>9.1f}{r.p90_us:>9.1f}"
                         f"{r.remote_gbps:>12.2f}{r.received_gbps:>10.2f}{chk:>10}{tf:>9}{wg:>9}{hu:>9} "
                         f"{r.us_per_launch:>14}")
        device = self.meta.get("device", "")
        peaks = {e: dense_peak(device, e) for e in ("bf16", "fp8")}
        if any(r.tflops is not None for r in self.rows) and peaks["bf16"]:
            lines.append(f"# TFLOP/s beside the device's dense peak: {peaks['bf16']:.0f} bf16, {peaks['fp8']:.0f} fp8")
        if self.meta:
            lines.append(f"# {self.meta.get('device', '?')} x{self.meta.get('world_size', '?')}, "
                         f"commit {self.meta.get('commit', '?')}, {self.meta.get('iters', '?')} iterations, "
                         f"combine by {self.meta.get('combine_mode', 'push')}")
        lines += [f"# check FAILED: {where}" for where in self.failed_checks()]
        return "\n".join(lines)

    def failed_checks(self) -> list[str]:
        """One line per failed check (the dispatch and combine rows of a run share their round
        trip; a micro-batched or graph-replayed layer row is checked against the serial layer):
        the run, the error against its tolerance, and where each rank went wrong."""
        seen: dict[tuple, str] = {}
        for r in self.rows:
            if r.check_failed:
                # the dispatch and combine rows of a run share one round trip; a layer row has its own
                layer = "" if r.op in ("dispatch", "combine") else r.op
                run = (r.preset, r.backend, r.topology, r.dtype, r.routing, r.tokens, r.sms, layer, r.experts)
                what = (f"{layer} ({r.experts} experts) against the serial layer: difference"
                        if layer else "round-trip error")
                misplaced = f", misplaced rows {r.misplaced_rows}" if r.misplaced_rows else ""
                seen.setdefault(run, f"{r.preset} {r.backend} {r.topology} {r.dtype} {r.routing} {r.tokens} "
                                     f"tokens/rank {r.sms} SMs: {what} {r.check_error:.2e} (tolerance "
                                     f"{r.check_tol:.0e}){misplaced}; {r.check_detail or 'no detail recorded'}")
        return list(seen.values())

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"meta": self.meta, "rows": [asdict(r) for r in self.rows]}, f, indent=1)

    @classmethod
    def from_json(cls, path: str) -> "BenchResult":
        """Read a file written by :meth:`to_json` (e.g. to plot or print a past run again)."""
        with open(path) as f:
            data = json.load(f)
        names = {f.name for f in fields(BenchRow)}
        rows = [BenchRow(**{k: v for k, v in r.items() if k in names}) for r in data.get("rows", [])]
        return cls(rows=rows, meta=data.get("meta", {}))

    def plot(self, path: str) -> None:
        """One column per operation (dispatch, combine, layer): time per call above, remote GB/s
        per rank below. A single token count per preset gives grouped bars (one group per
        preset, one bar per backend and dtype); a sweep (--tokens) gives lines over tokens per
        rank. The raw all_to_all appears as a reference beside dispatch and combine, the
        copy-engine peer copy as a horizontal line (the link's ceiling) in the GB/s panels."""
        _plot(self, path)


# ---- plot ------------------------------------------------------------------------------------
PLOT_OPS = ("dispatch", "combine", "layer")
# backend label -> (colours, one per dispatch dtype, marker, legend text)
_STYLE: dict[str, tuple[list[str], str, str]] = {
    "ray_ep": (["#1f77b4", "#7fb8e0", "#08306b", "#4a90c9"], "o", "ray_ep"),
    "nccl-pipeline": (["#e6550d", "#fdae6b", "#a63603", "#f5894a"], "s", "NCCL pipeline"),
    "gloo-pipeline": (["#e6550d", "#fdae6b", "#a63603", "#f5894a"], "s", "gloo pipeline"),
    "nccl-a2a-equal": (["#7f7f7f"], "^", "raw NCCL all_to_all_single (bf16, equal splits)"),
}
_OTHER = (["#2ca02c", "#98df8a", "#9467bd", "#c5b0d5"], "D", "")


def _plot(res: BenchResult, path: str) -> list[str]:
    """Draw ``res`` into ``path``; returns the legend's labels (one per series)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res.rows
    ops = [op for op in PLOT_OPS if any(r.op == op for r in rows)]
    if not ops:
        raise ValueError("nothing to plot: no dispatch, combine or layer rows")
    main = [r for r in rows if r.op in ops]
    a2a = [r for r in rows if r.op == "all_to_all"]
    peer = [r for r in rows if r.op == "peer_copy"]
    presets = list(dict.fromkeys(r.preset for r in main))
    tokens_of = {p: sorted({r.tokens for r in main if r.preset == p}) for p in presets}
    sweep = any(len(t) > 1 for t in tokens_of.values())
    routings = list(dict.fromkeys(r.routing for r in main))
    def dtype_of(r: BenchRow) -> str:  # layer rows with fp8 experts are a series of their own
        return r.dtype if r.experts in ("-", "bf16") else f"{r.dtype} {r.experts} experts"

    dtypes = list(dict.fromkeys(dtype_of(r) for r in main))
    # a --num-sms sweep: a series per budget ('-': a backend without one, e.g. the NCCL pipeline)
    budgets = list(dict.fromkeys(r.sms for r in main if r.sms != "-"))

    # series: (backend, dtype, routing, SM budget), plus the preset when lines of several presets
    # share an axis
    def key(r: BenchRow) -> tuple:
        return (r.preset if sweep and len(presets) > 1 else "", r.backend, dtype_of(r), r.routing,
                r.sms if len(budgets) > 1 and r.sms != "-" else "")

    # ray_ep beside the pipeline for each dtype: order by (dtype, routing, backend)
    rank_of = {b: i for i, b in enumerate(_STYLE)}
    keys = sorted(dict.fromkeys(key(r) for r in main),
                  key=lambda k: (presets.index(k[0]) if k[0] else 0, dtypes.index(k[2]), routings.index(k[3]),
                                 budgets.index(k[4]) if k[4] else 0, rank_of.get(k[1], len(rank_of))))
    if a2a:
        keys.append(("", "nccl-a2a-equal", "bf16", "-", ""))
    # colour: the backend's family, shaded by dtype; routing: line style (lines) or hatching (bars);
    # SM budget: hatching (bars) or marker (lines); with lines of several presets, the marker
    # tells the preset
    markers = "os^Dv<>p"
    budget_hatches = ["", "//", "xx", "\\\\", "--", "++"]
    style = {}
    for k in keys:
        colours, marker, name = _STYLE.get(k[1], _OTHER)
        if k[0]:
            marker = markers[presets.index(k[0]) % len(markers)]
        elif k[4]:
            marker = markers[budgets.index(k[4]) % len(markers)]
        if k[1] == "nccl-a2a-equal":
            label, colour = name, colours[0]
        else:
            label = " ".join(x for x in (k[0], name or k[1], k[2] if len(dtypes) > 1 else "",
                                         k[3] if len(routings) > 1 else "", f"@{k[4]} SMs" if k[4] else "") if x)
            colour = colours[dtypes.index(k[2]) % len(colours)]
        skewed = k[3] not in ("-", routings[0])
        hatch = budget_hatches[budgets.index(k[4]) % len(budget_hatches)] if k[4] else ""
        hatch += "..." if skewed else ""
        style[k] = dict(color=colour, marker=marker, label=label, linestyle="--" if skewed else "-",
                        hatch="//" if k[1] == "nccl-a2a-equal" else (hatch or None))

    fig, axes = plt.subplots(2, len(ops), figsize=(5.2 * len(ops) + 1, 8.2), squeeze=False)
    metrics = (("median_us", "time per call, us (log)"), ("remote_gbps", "remote GB/s per rank"))
    for c, op in enumerate(ops):
        series = {k: [r for r in main if r.op == op and key(r) == k] for k in keys}
        if op in ("dispatch", "combine") and a2a:
            series[keys[-1]] = a2a
        series = {k: v for k, v in series.items() if v}
        for m, (attr, ylabel) in enumerate(metrics):
            ax = axes[m][c]
            if sweep:
                for k, rs in series.items():
                    rs = sorted(rs, key=lambda r: r.tokens)
                    st = style[k]
                    ax.plot([r.tokens for r in rs], [getattr(r, attr) for r in rs], marker=st["marker"],
                            color=st["color"], linestyle=st["linestyle"], label=st["label"],
                            linewidth=0 if k[1] == "nccl-a2a-equal" else 1.5, markersize=6)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("tokens per rank")
            else:
                slots = list(series)
                width = 0.84 / max(len(slots), 1)
                for j, k in enumerate(slots):
                    by_preset = {r.preset: getattr(r, attr) for r in series[k]}
                    xs = [i + (j - (len(slots) - 1) / 2) * width for i, p in enumerate(presets) if p in by_preset]
                    ys = [by_preset[p] for p in presets if p in by_preset]
                    st = style[k]
                    bars = ax.bar(xs, ys, width=width * 0.92, color=st["color"], label=st["label"],
                                  hatch=st["hatch"], edgecolor="white", linewidth=0.5)
                    ax.bar_label(bars, labels=[f"{y:.0f}" if y >= 100 else f"{y:.3g}" for y in ys], fontsize=6.5,
                                 rotation=90, padding=2)
                ax.set_xticks(range(len(presets)),
                              [f"{p}\n{tokens_of[p][0]} tokens/rank" for p in presets], fontsize=8.5)
                ax.set_xlim(-0.5, len(presets) - 0.5)
            if attr == "median_us":
                ax.set_yscale("log")
                values = [r.median_us for rs in series.values() for r in rs if r.median_us > 0]
                if values:  # whole decades: bars start at a power of ten, room above for their labels
                    ax.set_ylim(10 ** math.floor(math.log10(min(values) * 0.9)),
                                10 ** math.ceil(math.log10(max(values) * (1.5 if sweep else 4))))
                ax.set_title(op if op != "combine" or len(dtypes) < 2 else
                             "combine (bf16; dtype = the dispatch before it)", fontsize=11)
            else:
                top = ax.get_ylim()[1] * 1.12  # room for the bar labels
                if peer:
                    gbps = peer[0].remote_gbps
                    ax.axhline(gbps, color="#d62728", linestyle=":", linewidth=1.6,
                               label=f"copy-engine peer copy, one GPU pair: {gbps:.0f} GB/s (link ceiling)")
                    ax.annotate(f"copy engine {gbps:.0f} GB/s", (1, gbps), xycoords=("axes fraction", "data"),
                                xytext=(-4, 3), textcoords="offset points", ha="right", va="bottom",
                                color="#d62728", fontsize=8)
                    top = max(top, gbps * 1.2)
                ax.set_ylim(0, top)
                if op == "layer":
                    ax.set_title("layer: dispatch bytes / layer time", fontsize=9)
            ax.set_ylabel(ylabel)
            ax.grid(True, axis="y", alpha=0.3)
            ax.set_axisbelow(True)

    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    ncol = min(3, len(labels))
    nrows = math.ceil(len(labels) / ncol)
    fig.legend([handles[lab] for lab in labels], labels, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
    meta = res.meta
    sms = [b for b in dict.fromkeys(r.sms for r in main if r.backend == "ray_ep") if b != "-"]
    device_sms = meta.get("sms")
    sm_text = f", ray_ep on {'/'.join(sms)} SMs" if sms else ""
    if sms and device_sms and sms != [str(device_sms)]:
        sm_text += f" (of {device_sms})"
    topo = {r.topology for r in main} - {""}
    title = (f"ray_ep benchmark: {meta.get('device', '?')} x{meta.get('world_size', '?')}"
             + (f" ({topo.pop()})" if len(topo) == 1 else "") + f", commit {meta.get('commit', '?')}{sm_text}")
    sub = (f"{'/'.join(routings)} routing, {meta.get('iters', '?')} iterations; time: the slowest rank's median "
           f"(lower is better); GB/s: bytes each rank sends to the other ranks (higher is better)")
    fig.suptitle(title + "\n" + sub, fontsize=11)
    fig.tight_layout(rect=(0, 0.025 + 0.03 * nrows, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return labels


def _pct(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1])."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def dense_peak(device_name: str, dtype: str = "bf16") -> float | None:
    """Dense tensor-core peak (TFLOP/s, vendor figure; fp8 twice bf16) of a known GPU, else None."""
    scale = 2.0 if dtype == "fp8" else 1.0
    if "H100" in device_name and "PCIe" in device_name:
        return 756.0 * scale
    if "H100" in device_name or "H200" in device_name or "H800" in device_name:
        return 989.4 * scale  # SXM
    return None


def _is_layer_op(op: str) -> bool:
    """Rows whose TFLOP/s is the experts' whole work: layer, layer-mb<n> (micro-batched), their
    -graph forms (replayed from CUDA graphs), experts."""
    return op in ("layer", "experts") or op.startswith("layer-")


def aggregate(per_rank: list[dict], op: str, cfg: EPConfig, nbytes_per_row: int, **labels: Any) -> BenchRow:
    """Median per rank, the slowest rank's median as the figure, p10/p90 over all samples."""
    medians = [statistics.median(r["times_us"][op]) for r in per_rank]
    samples = [t for r in per_rank for t in r["times_us"][op]]
    slowest = max(medians)
    remote = statistics.mean(r["remote_rows"] for r in per_rank) * nbytes_per_row
    received = statistics.mean(r["received_rows"] for r in per_rank) * nbytes_per_row
    gemm = {}
    if op.startswith("gemm"):  # us -> TFLOP/s: flops / us / 1e6; bytes / us / 1e3 -> GB/s
        gemm = dict(tflops=statistics.mean(r["gemm_flops"] / m / 1e6 if m else 0.0 for r, m in zip(per_rank, medians)),
                    weight_gbps=statistics.mean(r["weight_bytes"] / m / 1e3 if m else 0.0
                                                for r, m in zip(per_rank, medians)))
    elif _is_layer_op(op):  # the experts' whole work (shared experts too) over the slowest rank's time
        flops = statistics.mean(r.get("flops", 0) for r in per_rank)
        gemm = dict(tflops=flops / slowest / 1e6 if flops and slowest else None)
    return BenchRow(op=op, world_size=cfg.world_size, topology=f"{cfg.n_nodes}x{cfg.gpus_per_node}",
                    median_us=slowest, p10_us=_pct(samples, 0.1), p90_us=_pct(samples, 0.9), per_rank_median_us=medians,
                    remote_gbps=remote / slowest / 1e3 if slowest else 0.0,
                    received_gbps=received / slowest / 1e3 if slowest else 0.0,
                    **_check_fields(per_rank, op, cfg),
                    misplaced_rows=sum(r["misplaced_rows"] for r in per_rank),
                    launches=[list(x) for x in per_rank[0].get("launches", {}).get(op, [])],
                    launch_us=_slowest_per_launch([r.get("launch_us", {}).get(op, []) for r in per_rank]),
                    host_us=_slowest_median([r.get("host_us", {}).get(op, []) for r in per_rank]), **gemm, **labels)


def _check_fields(per_rank: list[dict], op: str, cfg: EPConfig) -> dict:
    """check_error and check_detail of an op's row: the round trip of dispatch and combine
    rows; for a layer other than the serial one, its difference from the serial layer; else
    none (check_error None)."""
    tol = ROUND_TRIP_TOL
    if op in ("dispatch", "combine"):
        errors = [r["check_error"] for r in per_rank]
        details = [r.get("check_detail", "") for r in per_rank]
    elif per_rank and all(op in r.get("layer_checks", {}) for r in per_rank):
        errors = [r["layer_checks"][op] for r in per_rank]
        details = [r.get("layer_check_details", {}).get(op, "") for r in per_rank]
        tol = LAYER_TOL[cfg.expert_dtype]
    else:
        return {"check_error": None}
    return {"check_error": max(errors), "check_tol": tol, "check_detail": "; ".join(
        f"rank {r['rank']}: {d}" for r, d in zip(per_rank, details) if d)}


def _slowest_median(per_rank: list[list[float]]) -> float | None:
    """The largest per-rank median; None unless every rank has samples."""
    if not per_rank or not all(per_rank):
        return None
    return max(statistics.median(t) for t in per_rank)


def _slowest_per_launch(per_rank: list[list[float]]) -> list[float]:
    """Per launch, the slowest rank's time; empty unless every rank timed the same launches."""
    if not per_rank or not per_rank[0] or any(len(t) != len(per_rank[0]) for t in per_rank):
        return []
    return [max(ts) for ts in zip(*per_rank)]


class _Progress:
    """The progress line on stderr: the case about to run, cases done, elapsed and remaining time
    (tqdm's estimate). A thread redraws it every second, so the clock moves during a long case
    (the first one compiles the kernels)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done_cases, self.t0 = total, 0, time.monotonic()
        # a terminal gets the redrawn bar; a log file or pipe one plain line per case (no \r noise)
        tty = enabled and sys.stderr.isatty()
        self.plain = enabled and not tty
        self.bar = tqdm(total=total, disable=not tty, leave=False, file=sys.stderr, unit="case",
                        bar_format="bench {n_fmt}/{total_fmt} cases |{bar:12}| {elapsed}<{remaining}  {desc}")
        self._closed = threading.Event()
        self._thread = None
        if tty:
            self._thread = threading.Thread(target=self._tick, name="ray_ep-bench-progress", daemon=True)
            self._thread.start()

    def _tick(self) -> None:
        while not self._closed.wait(1.0):
            self.bar.refresh()

    def start(self, what: str) -> None:
        """Show the case that is about to run."""
        if self.plain:
            print(f"ray-ep bench: [{self.done_cases}/{self.total} cases, {time.monotonic() - self.t0:.0f} s] {what}",
                  file=sys.stderr, flush=True)
        self.bar.set_description_str(what, refresh=True)

    def done(self) -> None:
        self.done_cases += 1
        self.bar.update()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.bar.close()


def source_commit(path: str | None = None) -> str:
    """The commit of the checkout that holds ``path`` (default: this package), with '+dirty'
    when its tracked files differ from it (a copied tree whose .git is older says so instead
    of naming a commit it does not run); RAY_EP_COMMIT wins (set it where .git is not shipped,
    as in Ray jobs); 'unknown' outside a checkout."""
    commit = os.environ.get("RAY_EP_COMMIT", "")
    if commit:
        return commit
    where = path or os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                              timeout=5)
        if head.returncode or not head.stdout.strip():
            return "unknown"
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                 capture_output=True, text=True, timeout=30)
        return head.stdout.strip() + ("+dirty" if changed.returncode or changed.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _meta(cluster: EPCluster, iters: int) -> dict:
    import torch
    import triton

    info = cluster.info()
    commit = source_commit()
    meta = {"device": info[0].get("gpu", "cpu"), "world_size": cluster.world_size,
            "n_nodes": cluster.config.n_nodes, "gpus_per_node": cluster.config.gpus_per_node,
            "sms": info[0].get("sms"), "backend": cluster.backend, "iters": iters, "commit": commit,
            "combine_mode": cluster.config.combine_mode,
            "versions": {"torch": torch.__version__, "triton": triton.__version__, "ray": ray.__version__}}
    try:
        from importlib.metadata import version

        meta["versions"]["nvshmem4py"] = version("nvshmem4py-cu13")
    except Exception:
        pass
    return meta


def run_bench(cluster: EPCluster, *, presets: Sequence[str], backends: Sequence[str] | None = None,
              tokens: Sequence[int] | None = None, routing: Sequence[str] = ("uniform",), iters: int = 50,
              warmup: int = 5, num_sms: int | Sequence[int | None] | None = None, fused: bool = True,
              layer: bool = False, baselines: bool = True, progress: bool = True, seed: int = 0,
              dtypes: Sequence[str] | None = None, cuda_graph: bool = False, micro_batches: int = 2,
              expert_dtypes: Sequence[str] = ("bf16",)) -> BenchResult:
    """Benchmark ``presets`` (names of BENCH_PRESETS) on a started cluster.

    backends: ``nvshmem`` (ray_ep's kernels) and/or ``torch`` (the NCCL / gloo pipeline);
    default: the cluster's backend, plus ``torch`` as the baseline on GPUs. tokens: a sweep
    of tokens per rank (default: the preset's). ``num_sms``: an SM budget of the communication
    kernels, or a list of budgets (a sweep; None = all SMs). ``layer`` adds whole-MoE-layer rows (loads
    seeded experts). ``baselines`` adds raw all_to_all and the peer copy (GPUs only).
    ``progress``: a progress line on stderr. dtypes: the dispatch dtypes of every preset's rows
    (bf16, fp8, nvfp4; default: each preset's own list). ``cuda_graph``: ray_ep's dispatch and
    combine also replayed from CUDA graphs (rows labelled ``ray_ep-graph``; GPUs only), and
    with ``layer`` the layers too (``layer-graph``, ``layer-mb<n>-graph`` rows).
    ``micro_batches``: with ``layer``, also the layer pipelined over that many micro-batches
    (``layer-mb<n>`` rows; 1: none). expert_dtypes: the routed expert weight dtypes of the
    ``layer`` rows (bf16, fp8; each gets its layer, experts, ``gemm`` and, where torch has one,
    ``gemm-torch`` rows).
    """
    expert_dtypes = list(expert_dtypes)
    bad = [e for e in expert_dtypes if e not in EXPERT_DTYPES] or ([] if expert_dtypes else ["(none)"])
    if bad:
        raise EPInputError(f"unknown expert dtype {bad[0]!r}; choose from {list(EXPERT_DTYPES)}")
    for p in presets:
        if p not in BENCH_PRESETS:
            raise EPInputError(f"unknown benchmark preset {p!r}; choose from {sorted(BENCH_PRESETS)}")
    for dt in dtypes or ():
        if dt not in DISPATCH_DTYPES:
            raise EPInputError(f"unknown dispatch dtype {dt!r}; choose from {list(DISPATCH_DTYPES)}")
    on_gpu = cluster.backend == "nvshmem"
    if cuda_graph and not on_gpu:
        raise EPInputError("cuda_graph needs GPU workers with the nvshmem backend (CUDA graphs replay its kernels)")
    if backends is None:
        backends = ["nvshmem", "torch"] if on_gpu else ["torch"]
    backends = ["torch" if b in ("nccl", "gloo") else b for b in backends]
    if "nvshmem" in backends and not on_gpu:
        raise EPInputError("the nvshmem backend needs GPU workers, and these run on CPUs; use the torch backend "
                           "(CLI: --backend torch; API: backends=['torch'])")
    result = BenchResult(meta=_meta(cluster, iters))
    budgets = list(num_sms) if isinstance(num_sms, (list, tuple)) else [num_sms]
    gpu_workers = result.meta["device"] != "cpu"  # the torch backend runs over NCCL there, else gloo
    base = cluster.config
    plan = []
    for p in presets:
        spec = BENCH_PRESETS[p]
        sweep = list(tokens) if tokens else [spec["tokens"]]
        for dt in dtypes or spec["dtypes"]:
            for b in backends:
                for rt in routing:
                    for T in sweep:
                        # the torch pipeline has no SM budget: it runs once, not per budget
                        for sms in (budgets if b == "nvshmem" else [None]):
                            plan.append((p, dt, b, rt, T, sms))
    per_case = 1 + int(cuda_graph) + (len(expert_dtypes) if layer else 0)
    bar = _Progress(len(plan) * per_case + (len(presets) + 1 if baselines and on_gpu else 0), progress)
    try:
        for p in presets:
            _run_preset(cluster, result, bar, p, [c for c in plan if c[0] == p], tokens=tokens, iters=iters,
                        warmup=warmup, fused=fused, layer=layer, baselines=baselines and on_gpu, seed=seed,
                        device_sms=result.meta.get("sms"), gpu_workers=gpu_workers, cuda_graph=cuda_graph,
                        micro_batches=micro_batches, expert_dtypes=expert_dtypes if layer else expert_dtypes[:1])
        if baselines and on_gpu and base.gpus_per_node >= 2:  # a pair on one node
            bar.start("copy-engine peer copy, one GPU pair")
            per_rank = cluster.run(run_row, "peer_copy", nbytes=256 * 2**20, iters=iters, warmup=warmup)
            times = per_rank[0]["times_us"]["peer_copy"]  # rank 0's figures
            med = statistics.median(times)
            nb = per_rank[0]["remote_rows"]
            result.rows.append(BenchRow(preset="-", backend="copy-engine", op="peer_copy", dtype="u8", routing="-",
                                        tokens=0, world_size=2, sms="-", median_us=med, topology="1x2",
                                        p10_us=_pct(times, 0.1), p90_us=_pct(times, 0.9), per_rank_median_us=[med],
                                        remote_gbps=nb / med / 1e3, received_gbps=nb / med / 1e3))
            bar.done()
    finally:
        bar.close()
    return result


def _run_preset(cluster: EPCluster, result: BenchResult, bar: _Progress, p: str, plan: list[tuple], *,
                tokens, iters: int, warmup: int, fused: bool, layer: bool, baselines: bool, seed: int,
                device_sms, gpu_workers: bool, expert_dtypes: Sequence[str], cuda_graph: bool = False,
                micro_batches: int = 2) -> None:
    """The rows of one preset: per dispatch dtype, SM budget and expert dtype a worker group of
    its own, dropped afterwards. Dispatch and combine rows come from the first expert dtype's
    group only (the expert weights do not change them)."""
    spec = BENCH_PRESETS[p]
    base = cluster.config
    n_max = max(list(tokens) if tokens else [spec["tokens"]])
    groups = list(dict.fromkeys((c[1], c[5]) for c in plan))  # (dtype, budget) in plan order
    for (dt, num_sms), edt in ((g, e) for g in groups for e in expert_dtypes):
        first = edt == expert_dtypes[0]
        cfg = preset_config(p, n_nodes=base.n_nodes, gpus_per_node=base.gpus_per_node, max_tokens_per_rank=n_max,
                            dispatch_dtype=dt, num_sms=num_sms, recv_timeout_s=base.recv_timeout_s, expert_dtype=edt,
                            combine_mode=base.combine_mode)
        sms_label = str(num_sms or device_sms or "-")
        name = f"bench/{p}/{dt}/{num_sms or 'all'}/{edt}"
        bar.start(f"{p} {dt}{f' at {num_sms} SMs' if num_sms else ''}: allocating buffers")
        # with --layer the micro-batched rows add buffers of their own (made on first use)
        mem_cfg = cfg.model_copy(update={"micro_batches": micro_batches}) if layer else cfg
        cluster.require_memory(mem_cfg, what=f"the {p} {dt} rows", symmetric=True, layers=int(layer), scratch=layer)
        cluster.call_workers("add_group", name, cfg)
        interrupted = False
        experts_done: set[tuple] = set()
        try:
            for (_, ddt, b, rt, T, sms) in plan:
                if (ddt, sms) != (dt, num_sms):
                    continue
                labels = dict(preset=p, backend=backend_label(b, gpu_workers), dtype=dt, routing=rt, tokens=T,
                              sms=sms_label if b == "nvshmem" else "-")
                case = f"{p} {labels['backend']} {dt} {rt} T={T}"
                if first:
                    bar.start(f"{case}: dispatch + combine")
                    per_rank = cluster.run(run_row, "comm", group=name, backend=b, num_tokens=T, routing=rt,
                                           seed=seed, iters=iters, warmup=warmup, fused=fused)
                    result.rows.append(aggregate(per_rank, "dispatch", cfg, row_bytes(cfg, "dispatch"), **labels))
                    result.rows.append(aggregate(per_rank, "combine", cfg, row_bytes(cfg, "combine"), **labels))
                    bar.done()
                if first and cuda_graph and b == "nvshmem":
                    bar.start(f"{case}: dispatch + combine from CUDA graphs")
                    per_rank = cluster.run(run_row, "comm_graphs", group=name, backend=b, num_tokens=T, routing=rt,
                                           seed=seed, iters=iters, warmup=warmup, fused=fused)
                    graph_labels = {**labels, "backend": "ray_ep-graph"}
                    result.rows.append(aggregate(per_rank, "dispatch", cfg, row_bytes(cfg, "dispatch"), **graph_labels))
                    result.rows.append(aggregate(per_rank, "combine", cfg, row_bytes(cfg, "combine"), **graph_labels))
                    bar.done()
                if layer:
                    bar.start(f"{case}: MoE layer, {edt} experts")
                    graphs = cuda_graph and b == "nvshmem"
                    per_rank = cluster.run(run_row, "layer", group=name, backend=b, num_tokens=T,
                                           routing=rt, seed=seed, iters=iters, warmup=warmup,
                                           micro_batches=micro_batches, cuda_graph=graphs)
                    layer_ops = ["layer", f"layer-mb{micro_batches}", "gemm", "gemm-torch"]
                    if graphs:  # beside the eager rows they repeat
                        layer_ops[1:1] = ["layer-graph"]
                        layer_ops[3:3] = [f"layer-mb{micro_batches}-graph"]
                    if (rt, T, edt) not in experts_done:  # the experts alone: the same kernels on every backend
                        experts_done.add((rt, T, edt))
                        layer_ops.insert(2, "experts")
                    for op in layer_ops:  # experts and GEMM rows move no dispatch bytes
                        if op in per_rank[0]["times_us"]:
                            nbytes = row_bytes(cfg, "dispatch") if op.startswith("layer") else 0
                            result.rows.append(aggregate(per_rank, op, cfg, nbytes, experts=edt, **labels))
                    bar.done()
            if baselines and first and (dt, num_sms) == groups[0]:
                bar.start(f"{p}: all_to_all_single, equal splits")
                per_rank = cluster.run(run_row, "all_to_all", group=name, rows_per_peer=n_max,
                                       iters=iters, warmup=warmup)
                result.rows.append(aggregate(per_rank, "all_to_all", cfg, 2 * cfg.hidden_size, preset=p,
                                             backend="nccl-a2a-equal", dtype="bf16", routing="-", tokens=n_max,
                                             sms="-"))
                bar.done()
        except KeyboardInterrupt:
            # the workers may still be inside a row: a drop_group would queue behind it; the
            # caller stops (or kills) the workers instead
            interrupted = True
            raise
        finally:
            if not interrupted:
                cluster.call_workers("drop_group", name)


BENCH_EXIT_STATUSES = """\
exit status:
  0    every row ran and every check passed
  1    a check failed (FAIL or MISPLACED in the table, where under it; the table and --json
       are written), the plot failed, or a cluster error
  2    bad flags (one line), or --plot without matplotlib
  130  Ctrl-C (the workers are stopped)"""


def add_arguments(parser) -> None:
    """The flags of ``ray-ep bench`` / ``python -m ray_ep.bench``."""
    parser.epilog = BENCH_EXIT_STATUSES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keeps the epilog's lines
    parser.add_argument("--preset", action="append", choices=sorted(BENCH_PRESETS),
                        help="benchmark preset (repeatable); default: deepseek-v3-prefill on GPUs, tiny on CPU")
    from ..cli import positive_int

    parser.add_argument("--gpus", type=positive_int, help="GPUs (ranks) on one node; default: all the cluster has")
    parser.add_argument("--world", type=positive_int, help="ranks (CPU workers when there is no GPU)")
    parser.add_argument("--topology", help="NODESxGPUS, e.g. 2x2 (several nodes)")
    parser.add_argument("--backend", default=None,
                        help="comma list of nvshmem,torch (torch = NCCL pipeline on GPUs, gloo on CPU)")
    parser.add_argument("--tokens", help="comma list of tokens per rank (a sweep); default: the preset's")
    parser.add_argument("--routing", default="uniform", help="comma list of uniform,skewed")
    parser.add_argument("--dispatch-dtype", dest="dispatch_dtype",
                        help="comma list of bf16,fp8,nvfp4: the dispatch dtypes of every preset's rows "
                             "(default: each preset's own, see docs/benchmarking.md)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--num-sms", type=sm_budgets, default=None,
                        help="SM budget of the communication kernels, or a comma list (a sweep, e.g. 16,24,32; "
                             "'all' = no budget)")
    parser.add_argument("--split", action="store_true", help="time the split send/recv forms instead of fused")
    parser.add_argument("--combine-mode", dest="combine_mode", choices=("push", "pull"), default="push",
                        help="EPConfig.combine_mode of ray_ep's rows: push (default), or pull (one node: partial "
                             "rows formed on the SMs --num-sms leaves, every SM without it, and loaded by their "
                             "sources on the --num-sms budget)")
    parser.add_argument("--layer", action="store_true",
                        help="also time whole MoE layers (experts included), the experts alone and their grouped "
                             "GEMMs beside torch's")
    parser.add_argument("--expert-dtype", dest="expert_dtype", default="bf16",
                        help="comma list of bf16,fp8: the routed expert weight dtypes of the --layer rows "
                             "(fp8: e4m3 with one scale per 128 x 128 block)")
    parser.add_argument("--micro-batches", type=positive_int, default=2,
                        help="with --layer, also the layer pipelined over this many micro-batches (1: none)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="also time dispatch and combine replayed from CUDA graphs (GPUs; rows 'ray_ep-graph'), "
                             "and with --layer the layers (rows 'layer-graph', 'layer-mb<n>-graph')")
    parser.add_argument("--no-baselines", action="store_true", help="skip raw all_to_all and the peer copy")
    parser.add_argument("--json", help="write every figure to this JSON file")
    parser.add_argument("--plot", help="write a figure of time and remote bandwidth per operation to this PNG "
                                       "(needs matplotlib: pip install 'ray-ep[plot]')")
    parser.add_argument("--address", default=None, help="Ray address (default: start a local Ray)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--no-memory-check", action="store_true",
                        help="run even when a preset's memory plan exceeds the free GPU or host memory")


def sm_budgets(text: str) -> list[int | None]:
    """``--num-sms``: '24' or '16,24,all' -> [16, 24, None] (None: every SM)."""
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        if part == "all":
            out.append(None)
            continue
        try:
            n = int(part)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"SM budgets are positive integers or 'all', got {part!r}")
        out.append(n)
    return out


def topology_from_args(args, default_world: int) -> tuple[int, int]:
    """(n_nodes, gpus_per_node) from --topology / --gpus / --world."""
    if args.topology:
        from ..cli import topology_arg

        return topology_arg(args.topology)
    return 1, args.gpus or args.world or default_world


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ray_ep.bench``: ``ray-ep bench`` with its error handling (one line per error)."""
    from ..cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


def _require_matplotlib() -> None:
    """--plot without matplotlib: fail before any cluster starts (exit status 2, like a bad flag)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"ray-ep bench: {PLOT_NEEDS}", file=sys.stderr)
        raise SystemExit(2) from None


def _mute_ray_ep_logs() -> None:
    """After Ctrl-C the workers are stopped on purpose: no log lines about failed ranks."""
    logging.getLogger("ray_ep").setLevel(logging.CRITICAL + 1)


def run_from_args(args) -> int:
    import torch

    if args.plot:
        _require_matplotlib()
    for path in (args.json, args.plot):
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and not os.path.isdir(folder):
            print(f"ray-ep bench: cannot write {path}: no folder {folder}", file=sys.stderr)
            return 2
    if args.micro_batches > 8:
        print(f"ray-ep bench: --micro-batches takes 1 .. 8, got {args.micro_batches}", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    if args.cuda_graph and (not gpus or (args.backend or "") == "torch"):
        print("ray-ep bench: --cuda-graph replays ray_ep's kernels from CUDA graphs: it needs GPUs and the nvshmem "
              "backend", file=sys.stderr)
        return 2
    if not gpus and not args.address and "nvshmem" in (args.backend or "").split(","):
        print("ray-ep bench: --backend nvshmem needs GPU workers and this machine has no GPU; use --backend torch "
              "(or --address of a Ray cluster with GPUs)", file=sys.stderr)
        return 2
    default_world = gpus if gpus else 2
    n_nodes, per_node = topology_from_args(args, default_world)
    presets = args.preset or (["deepseek-v3-prefill"] if gpus else ["tiny"])
    first = BENCH_PRESETS[presets[0]]
    backend = "torch" if (args.backend or "").split(",") == ["torch"] else "auto"
    try:
        cfg = EPConfig.preset(first["model"], n_nodes=n_nodes, gpus_per_node=per_node, backend=backend,
                              max_tokens_per_rank=first["tokens"], combine_mode=args.combine_mode)
    except ValueError as e:  # pydantic's ValidationError: a flag combination the config refuses
        print(f"ray-ep bench: {describe_config_error(e)}", file=sys.stderr)
        return 2
    backends = args.backend.split(",") if args.backend else None
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    dtypes = args.dispatch_dtype.split(",") if args.dispatch_dtype else None
    bad = [d for d in dtypes or () if d not in DISPATCH_DTYPES]
    if bad:
        print(f"ray-ep bench: --dispatch-dtype: unknown {', '.join(bad)}; choose from {','.join(DISPATCH_DTYPES)}",
              file=sys.stderr)
        return 2
    expert_dtypes = [e for e in args.expert_dtype.split(",") if e]
    bad = [e for e in expert_dtypes if e not in EXPERT_DTYPES] or ([] if expert_dtypes else ["(none)"])
    if bad:
        print(f"ray-ep bench: --expert-dtype: unknown {', '.join(bad)}; choose from {','.join(EXPERT_DTYPES)}",
              file=sys.stderr)
        return 2
    progress = not args.quiet
    ep = EPCluster(cfg, address=args.address, check_memory=not args.no_memory_check)
    log_level = logging.getLogger("ray_ep").level
    try:
        if progress:
            print(f"ray-ep bench: starting {cfg.world_size} workers ({n_nodes}x{per_node}, "
                  f"{'GPU' if gpus else 'CPU'}) ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        # the driver's waits on the workers poll every 0.5 s, so Ctrl-C lands here mid-row; leaving
        # the `with` on a KeyboardInterrupt kills the workers (no collective shutdown behind the row)
        with ep:
            if progress:
                print(f"ray-ep bench: workers up in {time.monotonic() - t0:.1f} s, backend {ep.backend}",
                      file=sys.stderr, flush=True)
            res = run_bench(ep, presets=presets, backends=backends, tokens=tokens,
                                     routing=args.routing.split(","), iters=args.iters, warmup=args.warmup,
                                     num_sms=args.num_sms, fused=not args.split, layer=args.layer,
                                     baselines=not args.no_baselines, progress=progress, dtypes=dtypes,
                                     cuda_graph=args.cuda_graph, micro_batches=args.micro_batches,
                                     expert_dtypes=expert_dtypes)
    except KeyboardInterrupt:
        _mute_ray_ep_logs()
        ep.shutdown(kill=True)  # idempotent: whatever a Ctrl-C inside start() or shutdown() left
        print("ray-ep bench: interrupted; workers stopped", file=sys.stderr, flush=True)
        return 130
    finally:
        logging.getLogger("ray_ep").setLevel(log_level)
    # the table and the JSON first: a failing plot must not lose them
    print(res.table(), flush=True)
    if args.json:
        res.to_json(args.json)
    if args.plot:
        try:
            res.plot(args.plot)
        except Exception as e:
            print(f"ray-ep bench: the plot failed ({type(e).__name__}: {e}); the table is above"
                  + (f", the figures in {args.json}" if args.json else ""), file=sys.stderr)
            return 1
    if failed := res.failed_checks():
        print(f"ray-ep bench: the correctness check failed on {len(failed)} run(s) (FAIL or MISPLACED in the "
              f"table, where under it): their times are of wrong results", file=sys.stderr)
        return 1
    return 0
