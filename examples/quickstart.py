"""Quickstart: one MoE layer through ray_ep on the embedded default.

Starts a local Ray, one worker per GPU (CPU workers over gloo when there is no GPU),
dispatches a batch of tokens to their experts, runs the experts, combines the outputs and
checks every rank's result against the plain-torch reference. Prints one line per rank: the
tokens it sent, the rows its experts received (one per token routed to one of them), its
busiest expert (global id) with that expert's rows, and the error against the reference.

    python examples/quickstart.py [--workers N] [--tokens T] [--routing skewed]
"""

from __future__ import annotations

import argparse
import time

import torch

from ray_ep import EPCluster, EPConfig, init_expert_weights, make_inputs
from ray_ep import reference


def main() -> int:
    gpus = torch.cuda.device_count()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=gpus or 2, help="ranks (default: GPUs, or 2 CPU workers)")
    parser.add_argument("--tokens", type=int, default=24, help="tokens per rank")
    parser.add_argument("--routing", default="skewed", choices=["uniform", "skewed", "one-expert"])
    args = parser.parse_args()

    # the tiny preset: H=128, 16 experts, top-4, SwiGLU experts of width 64
    cfg = EPConfig.preset("tiny", gpus_per_node=args.workers, max_tokens_per_rank=max(32, args.tokens))
    weights = init_expert_weights(cfg, seed=0)
    xs, topk_ids, topk_weights = make_inputs(cfg, args.tokens, seed=1, routing=args.routing)

    t0 = time.perf_counter()
    with EPCluster(cfg) as ep:                               # starts a local Ray and the workers
        t_start = time.perf_counter() - t0
        ep.load_experts(weights)
        received = ep.dispatch(xs, topk_ids, topk_weights)   # phase by phase...
        ep.compute()
        outs = ep.combine()
        t1 = time.perf_counter()
        again = ep.forward(xs, topk_ids, topk_weights)       # ...or a whole layer at once
        t_layer = time.perf_counter() - t1
        backend = ep.backend

    refs = reference.moe_forward(cfg, xs, topk_ids, topk_weights, weights)
    print(f"ray_ep quickstart: {cfg.world_size} ranks, backend {backend}, {args.tokens} tokens per rank, "
          f"{args.routing} routing (Ray and workers started in {t_start:.1f} s; one forward() {t_layer * 1e3:.0f} ms)")
    print(f"{'rank':>4} {'tokens':>7} {'rows received':>14} {'busiest expert (rows)':>22} {'max |out - ref|':>16}")
    worst = 0.0
    for r in range(cfg.world_size):
        err = (outs[r].float() - refs[r].float()).abs().max().item() if args.tokens else 0.0
        same = torch.equal(outs[r], again[r])
        worst = max(worst, err / max(refs[r].float().abs().max().item(), 1e-6) if args.tokens else 0.0)
        per_expert = received[r].tokens_per_expert             # rows of each of this rank's experts
        busiest = max(range(len(per_expert)), key=per_expert.__getitem__)
        expert = f"e{r * cfg.experts_per_rank + busiest} ({per_expert[busiest]})"
        print(f"{r:>4} {xs[r].shape[0]:>7} {sum(per_expert):>14} {expert:>22} {err:>16.2e}"
              + ("" if same else "  (phase-by-phase and forward differ!)"))
    ok = worst <= 3e-2
    print(f"max relative error {worst:.2e} against ray_ep.reference: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
