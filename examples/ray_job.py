"""A Ray job: start the EP group across the cluster's nodes, check it against the reference,
benchmark it, and keep the results as artifacts.

    ray job submit --working-dir . -- python examples/ray_job.py --config configs/job-1node.yaml

Inside ``ray job submit`` RAY_ADDRESS is set and the job joins that cluster; without it
(``python examples/ray_job.py ...`` on a laptop) it starts a local Ray. Writes into ``--out``
(default ./artifacts, created; relative to the job's working directory on the head node):

    ray_ep_check.json   the check: error per rank, tolerance, verdict, devices, config
    ray_ep_bench.json   every benchmark figure (ray_ep.bench), with versions and commit
    ray_ep_bench.png    time and bandwidth against tokens per rank

and prints the check table and the benchmark table. Exits 1 if the check fails (the
benchmark is then skipped: the numbers of a wrong layer mean nothing).

Config (YAML): ``ep:`` EPConfig fields (``preset:`` to start from one), ``check:`` arguments
of EPCluster.check, ``bench:`` arguments of ray_ep.bench.run_bench, ``cluster:`` EPCluster
options (use_gpu, placement_strategy, num_cpus_per_worker). See configs/job-1node.yaml.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from ray_ep import EPCluster, EPConfig, bench


class CheckOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_tokens: int | None = Field(default=None, ge=0)
    """Tokens per rank (default: max_tokens_per_rank)."""
    rounds: int = Field(default=2, gt=0)
    routing: str = "uniform"
    seed: int = 0


class BenchOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    presets: list[str] = ["tiny"]
    backends: list[str] | None = None
    """nvshmem and/or torch; default: the cluster's backend (+ the torch baseline on GPUs)."""
    tokens: list[int] | None = None
    """A sweep of tokens per rank (default: the preset's)."""
    routing: list[str] = ["uniform"]
    iters: int = Field(default=50, gt=0)
    warmup: int = Field(default=5, ge=0)
    num_sms: int | None = None
    layer: bool = False
    """Also time whole MoE layers."""
    baselines: bool = True
    """Raw all_to_all and the peer copy (GPUs only)."""


class ClusterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    use_gpu: bool | None = None
    placement_strategy: str | None = None
    """Default STRICT_SPREAD over nodes; PACK lets one 4-GPU host play 2 nodes x 2 GPUs."""
    num_cpus_per_worker: float | None = None


class JobConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ep: dict = {"preset": "tiny"}
    check: CheckOptions = CheckOptions()
    bench: BenchOptions = BenchOptions()
    cluster: ClusterOptions = ClusterOptions()


def load_config(path: str, args: argparse.Namespace) -> tuple[JobConfig, EPConfig]:
    job = JobConfig(**(yaml.safe_load(Path(path).read_text()) or {}))
    overrides = {k: v for k, v in (("n_nodes", args.nodes), ("gpus_per_node", args.gpus_per_node)) if v is not None}
    return job, EPConfig.from_dict(job.ep, **overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="job YAML (configs/job-1node.yaml, configs/job-2nodes.yaml)")
    parser.add_argument("--out", default="artifacts", help="artifacts directory (default ./artifacts)")
    parser.add_argument("--nodes", type=int, help="override ep.n_nodes")
    parser.add_argument("--gpus-per-node", type=int, help="override ep.gpus_per_node")
    parser.add_argument("--dry-run", action="store_true", help="validate the config, print the plan, start nothing")
    args = parser.parse_args(argv)

    try:
        job, cfg = load_config(args.config, args)
    except (ValueError, OSError) as e:  # pydantic's ValidationError is a ValueError
        print(f"ray_job: bad config {args.config}: {e}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    print(f"ray_ep job: {args.config}: {cfg.n_nodes} node(s) x {cfg.gpus_per_node} rank(s), H={cfg.hidden_size}, "
          f"E={cfg.n_experts}, K={cfg.top_k}, N_max={cfg.max_tokens_per_rank}, backend {cfg.backend}; "
          f"bench {job.bench.presets}; artifacts -> {out}", flush=True)
    if args.dry_run:
        print(cfg.model_dump_json(indent=1))
        return 0
    out.mkdir(parents=True, exist_ok=True)

    # inside `ray job submit` RAY_ADDRESS names the cluster; else EPCluster starts a local Ray
    address = "auto" if os.environ.get("RAY_ADDRESS") else None
    t0 = time.perf_counter()
    with EPCluster(cfg, address=address, use_gpu=job.cluster.use_gpu,
                   placement_strategy=job.cluster.placement_strategy,
                   num_cpus_per_worker=job.cluster.num_cpus_per_worker) as ep:
        info = ep.info()
        nodes = sorted({row["node_id"] for row in info})
        print(f"EP group up in {time.perf_counter() - t0:.1f} s: {ep.world_size} ranks on {len(nodes)} node(s), "
              f"backend {ep.backend}, device {info[0].get('gpu', info[0]['device'])}", flush=True)

        c = job.check
        report = ep.check(num_tokens=c.num_tokens, seed=c.seed, routing=c.routing, rounds=c.rounds)
        print("\ncheck against ray_ep.reference:")
        print(report.table(), flush=True)
        check_path = out / "ray_ep_check.json"
        check_path.write_text(json.dumps({
            "passed": report.passed, "max_rel_error": report.max_rel_error, "max_abs_error": report.max_abs_error,
            "per_rank_rel_error": report.per_rank_rel_error, "tolerance": report.tolerance,
            "backend": report.backend, "rounds": report.rounds, "num_tokens": c.num_tokens, "routing": c.routing,
            "config": cfg.model_dump(), "workers": info}, indent=1))
        if not report.passed:
            print(f"\nFAILED: the check is off by {report.max_rel_error:.2e} (tolerance {report.tolerance:.0e}); "
                  f"benchmark skipped. Wrote {check_path}", file=sys.stderr)
            return 1

        b = job.bench
        print(f"\nbenchmark: presets {b.presets}, tokens {b.tokens or 'preset default'}, {b.iters} iterations",
              flush=True)
        result = bench.run_bench(ep, presets=b.presets, backends=b.backends, tokens=b.tokens, routing=b.routing,
                                 iters=b.iters, warmup=b.warmup, num_sms=b.num_sms, layer=b.layer,
                                 baselines=b.baselines, progress=sys.stderr.isatty())
    print(result.table())
    result.to_json(str(out / "ray_ep_bench.json"))
    result.plot(str(out / "ray_ep_bench.png"))
    print(f"\nartifacts: {check_path}, {out / 'ray_ep_bench.json'}, {out / 'ray_ep_bench.png'} "
          f"({time.perf_counter() - t0:.1f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
