"""One rank's experts of an R-rank world, timed on this one device.

``python -m ray_ep.bench.experts_world --preset deepseek-v3-prefill --world 4 --expert-dtype fp8``

The experts are most of a prefill MoE layer, and their time depends on the rows a rank
receives (how many local experts, how many rows each), not on the links: rank 0 of a 4-GPU
world runs 64 of deepseek-v3's 256 experts over ~512 rows each, a world of one all 256 over
~128. This gives the first figure where only one GPU is at hand. Every rank's dispatch send
runs into a :class:`~ray_ep.transport.local.LocalWorld` (all R ranks' buffers on this device),
then rank 0's receive, so rank 0 holds the rows rank 0 of R GPUs receives; its seeded experts
(drawn on the device) then run as the layer runs them. Ops, in rotation, each after a GPU sleep
(the benchmark's clock, without its barriers), medians:

- ``experts``: :func:`ray_ep.bench.loops.experts_alone`, the routed experts then the shared
  ones (what ``ray-ep bench --layer`` times as the experts alone);
- ``routed``: :func:`~ray_ep.kernels.experts.run_experts` alone;
- ``shared``: :func:`~ray_ep.kernels.experts.shared_experts` alone;
- ``gemm``: the two routed grouped GEMMs without the SwiGLU (:func:`ray_ep.bench.loops.expert_gemms`).

Before timing, rank 0's routed output is checked against the torch twin
(:func:`~ray_ep.kernels.experts.run_experts_torch`) on the same rows. A figure here predicts an
R-GPU run's experts row to within a few percent (docs/perf.md compares them); it does not time
communication. On CPU the torch twins run (a smoke run of the tiny preset; the check then
compares the twin with itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Sequence

import torch

from ..config import EPConfig
from ..inputs import rank_inputs
from ..kernels import dispatch as D
from ..kernels.experts import ExpertScratch, LocalExperts, run_experts, run_experts_torch, shared_experts
from ..reference import FP8_EXPERTS_TOLERANCE
from ..transport.local import LocalWorld
from ..weights import init_expert_weights
from .loops import ROUND_TRIP_TOL, Clock, expert_flops, expert_gemms, experts_alone, relative_error
from .runner import BENCH_PRESETS, DISPATCH_DTYPES, EXPERT_DTYPES, preset_config

OPS = ("experts", "routed", "shared", "gemm")
# the routed output against its torch twin, by expert dtype (the layer's tolerances)
TOLERANCE = {"bf16": ROUND_TRIP_TOL, "fp8": FP8_EXPERTS_TOLERANCE}


def config_for(preset: str, world: int, tokens: int | None = None, dispatch_dtype: str | None = None,
               expert_dtype: str = "bf16") -> tuple[EPConfig, int]:
    """(config of an R-rank world on one node for ``preset`` of ``ray-ep bench``, tokens per rank)."""
    spec = BENCH_PRESETS[preset]
    n = tokens or spec["tokens"]
    return preset_config(preset, n_nodes=1, gpus_per_node=world, max_tokens_per_rank=n,
                         dispatch_dtype=dispatch_dtype or spec["dtypes"][0], expert_dtype=expert_dtype), n


def rank0_rows(cfg: EPConfig, tokens: int, seed: int, routing: str, device: torch.device):
    """(world, rank 0's dispatch handle, rank 0's own tokens) after every rank's send of
    ``tokens`` seeded tokens and rank 0's receive. ``world`` keeps the rows alive."""
    world = LocalWorld.create(cfg, device)
    # the kernels on a GPU, their torch twins elsewhere (the interpreter is too slow for a world)
    send, recv = (D.dispatch_send, D.dispatch_recv) if device.type == "cuda" else \
        (D.dispatch_send_torch, D.dispatch_recv_torch)
    inputs = [rank_inputs(cfg, tokens, r, seed, routing, device=device) for r in range(cfg.world_size)]
    layouts = [send(cfg=cfg, x_TH=x, topk_ids_TK=ids, topk_weights_TK=w, bufs=world.bufs[r], ws=world.workspaces[r])
               for r, (x, ids, w) in enumerate(inputs)]
    handle = recv(cfg=cfg, layout=layouts[0], bufs=world.bufs[0], ws=world.workspaces[0], num_tokens=tokens)
    return world, handle, inputs[0][0]


def rank0_experts(cfg: EPConfig, seed: int, device: torch.device) -> LocalExperts:
    """Rank 0's seeded experts, drawn on ``device`` (seconds, not the minutes a CPU draw of a
    large layer takes; benchmark values, not the reference's)."""
    weights = init_expert_weights(cfg, seed=seed, experts=range(cfg.experts_per_rank), device=device,
                                  draw_on_device=device.type == "cuda")
    experts = LocalExperts.build(cfg, weights, device)
    experts.check(cfg)
    return experts


def time_ops(cfg: EPConfig, tokens: int, *, seed: int = 0, routing: str = "uniform", iters: int = 12,
             warmup: int = 2, device: torch.device | str | None = None) -> dict:
    """Rank 0's experts of ``cfg``'s world on one device: {"us": {op: median}, "tflops": ...,
    "rows", "check_error", "tolerance"} (see the module docstring). Raises RuntimeError when
    the routed output is off its twin by more than the tolerance."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    world, h, x0 = rank0_rows(cfg, tokens, seed, routing, device)
    experts = rank0_experts(cfg, seed, device)
    scratch = ExpertScratch.allocate(cfg, device, rows=None if device.type == "cuda" else 0)
    rows = int(h.recv.num_tokens_L.sum())
    got = run_experts(handle=h, experts=experts, scratch=scratch)[:int(h.recv.row_offsets_L1[-1])].clone()
    twin = ExpertScratch.allocate(cfg, device, rows=0)
    want = run_experts_torch(handle=h, experts=experts, scratch=twin)[:got.shape[0]]
    live = h.recv.row_ids_M[:got.shape[0]] >= 0  # padding rows are never computed
    err = relative_error(got[live], want[live])
    tol = TOLERANCE[cfg.expert_dtype]
    if not err <= tol:
        raise RuntimeError(f"rank 0's routed experts are off their torch twin: relative error {err:.3g} > {tol:g}")
    del twin, want
    ops = {"experts": lambda: experts_alone(h, experts, scratch, x0),
           "routed": lambda: run_experts(handle=h, experts=experts, scratch=scratch),
           "shared": lambda: shared_experts(x0, experts),
           "gemm": expert_gemms(h, experts, scratch)}
    times: dict[str, list[float]] = {op: [] for op in ops}
    clock = Clock(device, None)
    for i in range(warmup + iters):
        for op, fn in ops.items():
            s = clock.start()
            fn()
            us = clock.stop(s)
            if i >= warmup:
                times[op].append(us)
    med = {op: statistics.median(v) for op, v in times.items()}
    del world
    return {"us": med, "tflops": expert_flops(cfg, rows, tokens) / med["experts"] / 1e6, "rows": rows,
            "check_error": err, "tolerance": tol}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ray_ep.bench.experts_world",
                                description="Rank 0's experts of an R-rank world, timed on this one device.")
    p.add_argument("--preset", default=None, choices=sorted(BENCH_PRESETS),
                   help="a ray-ep bench preset (default: deepseek-v3-prefill on a GPU, tiny on CPU)")
    p.add_argument("--world", type=int, default=4, help="ranks of the simulated world (default 4)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the preset's)")
    p.add_argument("--expert-dtype", dest="expert_dtype", default="bf16", help="comma list of bf16,fp8")
    p.add_argument("--dispatch-dtype", dest="dispatch_dtype", default=None, choices=DISPATCH_DTYPES)
    p.add_argument("--routing", default="uniform", choices=("uniform", "skewed"))
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    dtypes = args.expert_dtype.split(",")
    bad = [d for d in dtypes if d not in EXPERT_DTYPES]
    if bad or args.world < 1 or args.iters < 1 or args.warmup < 0:
        p.error(f"--expert-dtype takes {','.join(EXPERT_DTYPES)}, --world and --iters at least 1, --warmup at "
                f"least 0 (got {args.expert_dtype}, {args.world}, {args.iters}, {args.warmup})")
    preset = args.preset or ("deepseek-v3-prefill" if torch.cuda.is_available() else "tiny")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    results = []
    print(f"{preset}, rank 0 of {args.world} ranks, on one {name}; us, medians of {args.iters}")
    print("experts | dispatch | rows | " + " | ".join(OPS) + " | TFLOP/s (experts) | check")
    for dt in dtypes:
        try:
            cfg, tokens = config_for(preset, args.world, args.tokens, args.dispatch_dtype, dt)
        except Exception as e:  # pydantic names the field and the rule
            p.error(f"{preset} on {args.world} ranks with {dt} experts: {e}")
        res = time_ops(cfg, tokens, routing=args.routing, iters=args.iters, warmup=args.warmup, device=device)
        res.update(preset=preset, world=args.world, tokens=tokens, expert_dtype=dt, dispatch_dtype=cfg.dispatch_dtype,
                   routing=args.routing, device=name)
        results.append(res)
        us = res["us"]
        print(f"{dt} | {cfg.dispatch_dtype} | {res['rows']} | " + " | ".join(f"{us[op]:.1f}" for op in OPS)
              + f" | {res['tflops']:.0f} | {res['check_error']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
