"""Accuracy of the MoE layer by dispatch dtype (fp8 and nvfp4 against bf16 dispatch) and by
expert weight dtype (fp8 weights against bf16 weights).

    python -m ray_ep.bench.accuracy --preset tiny --world 2            # CPU workers
    python -m ray_ep.bench.accuracy --preset deepseek-v3 --gpus 4      # GPUs (nvshmem)
    python -m ray_ep.bench.accuracy --preset tiny --world 2 --intermediate-size 128 \
        --dispatch-dtype fp8 --expert-dtype bf16,fp8                   # fp8 experts too

Every rank draws its seeded inputs (x ~ N(0, 1) times ``--x-scale``, router ids and weights) and
runs whole MoE layers (dispatch, seeded routed and shared experts, combine; fp32 output) once
per (dispatch dtype, expert dtype), on the same experts: fp8 experts are the bf16 ones
quantised per 128 x 128 block. The figures compare each output y with the output y0 of bf16
dispatch and bf16 experts for the same tokens: ``rel`` = ||y - y0|| / ||y0|| over all tokens
of all ranks, and per token ||y_t - y0_t|| / ||y0_t||, its mean and largest. Only the
dispatch and weight roundings differ (the combine dtype is the config's, bf16 by default, on
both sides).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from ..config import PRESETS, EPConfig
from ..errors import EPError
from ..inputs import ROUTINGS, rank_inputs

DTYPES = ("fp8", "nvfp4")
EXPERT_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class AccuracyRow:
    """One (dispatch dtype, expert dtype)'s MoE output against bf16 dispatch with bf16
    experts, over all ranks' tokens."""

    preset: str
    dtype: str
    x_scale: float
    tokens: int
    rel: float
    token_rel_mean: float
    token_rel_max: float
    experts: str = "bf16"


def _key(dtype: str, experts: str) -> str:
    return dtype if experts == "bf16" else f"{dtype}/{experts}-experts"


def rank_errors(worker, groups: dict[str, str], *, num_tokens: int, seed: int, routing: str,
                x_scale: float) -> dict:
    """Inside a worker (``EPCluster.run``): this rank's squared errors of each group's layer
    output against the bf16 group's (``groups``: key -> group name, "bf16" first; collective).
    Every group runs the bf16 group's experts: as they are, or quantised per block for a group
    whose config has fp8 experts."""
    from ..kernels.experts import LocalExperts
    from ..weights import ExpertWeights

    base = worker.group_state(groups["bf16"])
    if 0 not in base.experts:
        worker.load_experts(seed=seed, group=groups["bf16"], draw_on_device=True)
    outs = {}
    for key, name in groups.items():
        g = worker.group_state(name)
        if 0 not in g.experts:  # the same expert tensors in every group
            b = base.experts[0]
            if g.cfg.expert_dtype == "fp8":
                bf16 = ExpertWeights(b.w_gate_up_LHF2, b.w_down_LFH, b.shared_gate_up_SHF2, b.shared_down_SFH)
                g.experts[0] = LocalExperts.build(g.cfg, bf16, worker.device)
            else:
                g.experts[0] = b
        x, ids, w = rank_inputs(g.cfg, num_tokens, worker.rank, seed, routing, device=worker.device)
        outs[key] = worker.moe(x * x_scale, ids, w, group=name, out_dtype="fp32").float()
    ref = outs["bf16"]
    ref_norm = ref.norm(dim=1).clamp_min(1e-30)
    res = {}
    for dt, y in outs.items():
        tok = (y - ref).norm(dim=1) / ref_norm
        res[dt] = {"sq_err": float(((y - ref) ** 2).sum()), "sq_ref": float((ref ** 2).sum()),
                   "tok_sum": float(tok.sum()), "tok_max": float(tok.max()) if tok.numel() else 0.0,
                   "tokens": int(tok.numel())}
    return res


def measure(cluster, preset: str, *, dtypes: Sequence[str] = DTYPES, num_tokens: int = 256, seed: int = 0,
            routing: str = "uniform", x_scales: Sequence[float] = (1.0,), expert_dtypes: Sequence[str] = ("bf16",),
            **overrides) -> list[AccuracyRow]:
    """Rows of :class:`AccuracyRow` for every (dispatch dtype in bf16 + ``dtypes``, expert dtype
    in ``expert_dtypes``) but bf16 / bf16, the reference, on a started cluster (one worker group
    each, dropped afterwards). ``overrides``: EPConfig fields over the preset's (e.g.
    intermediate_size=128, which fp8 experts need of the tiny preset)."""
    base = cluster.config
    cases = [(dt, edt) for edt in expert_dtypes for dt in ("bf16", *dtypes)]
    groups = {_key(dt, edt): f"accuracy/{_key(dt, edt)}" for dt, edt in [("bf16", "bf16"), *cases]}
    made = []
    try:
        for (dt, edt) in dict.fromkeys([("bf16", "bf16"), *cases]):
            cfg = EPConfig.preset(preset, **{**overrides, **dict(
                n_nodes=base.n_nodes, gpus_per_node=base.gpus_per_node, max_tokens_per_rank=num_tokens,
                dispatch_dtype=dt, expert_dtype=edt)})
            if not made:  # the bf16 experts, plus their fp8 copy (counted as a second layer: a bound)
                cluster.require_memory(cfg, what=f"the accuracy run of {preset}", symmetric=True, scratch=True,
                                       layers=2 if "fp8" in expert_dtypes else 1)
            cluster.call_workers("add_group", groups[_key(dt, edt)], cfg)
            made.append(groups[_key(dt, edt)])
        rows = []
        for xs in x_scales:
            per_rank = cluster.run(rank_errors, groups, num_tokens=num_tokens, seed=seed, routing=routing, x_scale=xs)
            for dt, edt in cases:
                if (dt, edt) == ("bf16", "bf16"):
                    continue
                r = [p[_key(dt, edt)] for p in per_rank]
                n = sum(v["tokens"] for v in r)
                rows.append(AccuracyRow(preset, dt, xs, n, math.sqrt(sum(v["sq_err"] for v in r)
                                                                     / max(sum(v["sq_ref"] for v in r), 1e-30)),
                                        sum(v["tok_sum"] for v in r) / max(n, 1), max(v["tok_max"] for v in r),
                                        experts=edt))
        return rows
    finally:
        for name in made:
            cluster.call_workers("drop_group", name)


def table(rows: Sequence[AccuracyRow]) -> str:
    head = (f"{'preset':<14}{'dispatch':<10}{'experts':<9}{'x scale':>9}{'tokens':>8}{'rel error':>11}"
            f"{'token mean':>12}{'token max':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.preset:<14}{r.dtype:<10}{r.experts:<9}{r.x_scale:>9g}{r.tokens:>8}{r.rel:>11.4f}"
                     f"{r.token_rel_mean:>12.4f}{r.token_rel_max:>11.4f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from ..cli import positive_int
    from ..driver import EPCluster

    ap = argparse.ArgumentParser(prog="python -m ray_ep.bench.accuracy", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model preset (default tiny)")
    ap.add_argument("--gpus", type=positive_int, help="GPUs (ranks) on one node; default: all, or 2 CPU workers")
    ap.add_argument("--world", type=positive_int, help="ranks (CPU workers when there is no GPU)")
    ap.add_argument("--tokens", type=positive_int, default=256, help="tokens per rank (default 256)")
    ap.add_argument("--routing", default="uniform", choices=ROUTINGS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--x-scale", default="1", help="comma list: x ~ N(0, 1) times each (default 1)")
    ap.add_argument("--dispatch-dtype", default=",".join(DTYPES), help="comma list of fp8,nvfp4")
    ap.add_argument("--expert-dtype", default="bf16",
                    help="comma list of bf16,fp8: the expert weights of every dispatch dtype's layers (default bf16)")
    ap.add_argument("--intermediate-size", type=positive_int,
                    help="F over the preset's (fp8 experts need a multiple of 128; the tiny preset has 64)")
    ap.add_argument("--json", help="write the rows to this JSON file")
    ap.add_argument("--address", default=None, help="Ray address (default: start a local Ray)")
    ap.add_argument("--no-memory-check", action="store_true",
                    help="run even where the memory plan says the experts do not fit")
    a = ap.parse_args(argv)
    dtypes = [d for d in a.dispatch_dtype.split(",") if d]
    if any(d not in DTYPES for d in dtypes):
        ap.error(f"--dispatch-dtype: choose from {','.join(DTYPES)}")
    expert_dtypes = [d for d in a.expert_dtype.split(",") if d]
    if not expert_dtypes or any(d not in EXPERT_DTYPES for d in expert_dtypes):
        ap.error(f"--expert-dtype: choose from {','.join(EXPERT_DTYPES)}")
    overrides = {} if a.intermediate_size is None else {"intermediate_size": a.intermediate_size}
    gpus = torch.cuda.device_count()
    world = a.gpus or a.world or gpus or 2
    for edt in expert_dtypes:
        try:  # a config error in one line, before any worker starts
            EPConfig.preset(a.preset, gpus_per_node=world, max_tokens_per_rank=a.tokens, expert_dtype=edt,
                            **overrides)
        except ValueError as e:
            from ..config import describe_config_error

            ap.error(("--expert-dtype fp8: " if edt == "fp8" else "") + describe_config_error(e))
    cfg = EPConfig.preset(a.preset, n_nodes=1, gpus_per_node=world, max_tokens_per_rank=a.tokens)
    try:
        with EPCluster(cfg, address=a.address, check_memory=not a.no_memory_check) as ep:
            rows = measure(ep, a.preset, dtypes=dtypes, num_tokens=a.tokens, seed=a.seed, routing=a.routing,
                           x_scales=[float(s) for s in a.x_scale.split(",")], expert_dtypes=expert_dtypes,
                           **overrides)
            backend = ep.backend
    except EPError as e:  # one line, as the ray-ep commands print them
        print(f"{ap.prog}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    size = f", F {a.intermediate_size}" if a.intermediate_size else ""
    print(f"# {a.preset}{size}: {world} ranks, backend {backend}, {a.routing} routing, seed {a.seed}; "
          f"error of the MoE output against bf16 dispatch with bf16 experts")
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
