"""A Ray job: start the EP group across the cluster's nodes, check it against the reference,
benchmark it, and keep the results as artifacts.

    export RAY_AUTH_MODE=disabled    # a trusted machine; docs/ray-job.md for token auth
    ray start --head
    ray job submit --working-dir . -- python examples/ray_job.py --config configs/job-1node.yaml --out /tmp/ray_ep_job
    ray stop

Inside ``ray job submit`` RAY_ADDRESS is set and the job joins that cluster; without it
(``python examples/ray_job.py ...`` on a laptop) it starts a local Ray. It needs only ray_ep's
own dependencies (the ``job`` extra, ``ray[default]``, is for the job server on the cluster);
``--plot`` also needs matplotlib (the ``plot`` extra). Writes into ``--out`` (default
./artifacts, created; relative to the job's working directory on the head node):

    ray_ep_check.json   the check: error per rank, tolerance, verdict, devices, config
    ray_ep_bench.json   every benchmark figure (ray_ep.bench), with versions and commit
    ray_ep_bench.png    time and bandwidth against tokens per rank (only with --plot)

and prints the check table and the benchmark table. The benchmark is skipped when the check
fails: the numbers of a wrong layer mean nothing.

Config (YAML): ``ep:`` EPConfig fields (``preset:`` to start from one), ``check:`` arguments
of EPCluster.check (and ``tolerance:``), ``bench:`` arguments of ray_ep.bench.run_bench,
``cluster:`` EPCluster options (use_gpu, placement_strategy, num_cpus_per_worker). See
configs/job-1node.yaml.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ray_ep import EPCluster, EPConfig, EPError, bench
from ray_ep.actors.group import PLACEMENT_STRATEGIES
from ray_ep.inputs import ROUTINGS

# exit statuses: each failure has its own (also in --help and docs/ray-job.md)
EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_MISSING_DEPENDENCY = 3
EXIT_CLUSTER = 4
EXIT_INTERNAL = 5

EXIT_STATUSES = f"""\
exit status:
  {EXIT_OK}  the check passed and the benchmark ran (or --dry-run: the config is valid)
  {EXIT_CHECK_FAILED}  the check failed: an error above the tolerance (benchmark skipped), or a
     benchmark row's own round-trip check (FAIL in its table; the artifacts are written)
  {EXIT_USAGE}  bad arguments or config (the message names the field), or --out not writable
  {EXIT_MISSING_DEPENDENCY}  an optional package is missing (--plot: pip install 'ray-ep[plot]')
  {EXIT_CLUSTER}  cluster or worker error: Ray unreachable, topology does not fit, a worker died
  {EXIT_INTERNAL}  unexpected error (a bug: the traceback is printed)
Every failure ends with one line on stderr, "ray_job: ...". Under `ray job submit` the job's
status message says "Job entrypoint command failed with exit code N" (`ray job submit` itself
exits 1 for any failed job)."""


class JobError(Exception):
    """A failure with its exit status; the message is one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def one_line(text: str) -> str:
    return " ".join(str(text).split())


class CheckOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_tokens: int | None = Field(default=None, ge=0)
    """Tokens per rank (default: max_tokens_per_rank)."""
    rounds: int = Field(default=2, gt=0)
    routing: str = "uniform"
    seed: int = 0
    tolerance: float | None = Field(default=None, gt=0)
    """Largest relative error that passes (default: ray_ep's for the layer, ray_ep.reference.check_tolerance)."""

    @field_validator("routing")
    @classmethod
    def _routing(cls, v: str) -> str:
        if v not in ROUTINGS:
            raise ValueError(f"must be one of {', '.join(ROUTINGS)}")
        return v


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

    @field_validator("presets")
    @classmethod
    def _presets(cls, v: list[str]) -> list[str]:
        if bad := [p for p in v if p not in bench.BENCH_PRESETS]:
            raise ValueError(f"unknown {bad}: choose from {', '.join(bench.BENCH_PRESETS)}")
        return v

    @field_validator("backends")
    @classmethod
    def _backends(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (bad := [b for b in v if b not in ("nvshmem", "torch", "nccl", "gloo")]):
            raise ValueError(f"unknown {bad}: choose from nvshmem, torch")
        return v

    @field_validator("routing")
    @classmethod
    def _routing(cls, v: list[str]) -> list[str]:
        if bad := [r for r in v if r not in ROUTINGS]:
            raise ValueError(f"unknown {bad}: choose from {', '.join(ROUTINGS)}")
        return v


class ClusterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    use_gpu: bool | None = None
    placement_strategy: str | None = None
    """Default STRICT_SPREAD over nodes; PACK lets one 4-GPU host play 2 nodes x 2 GPUs."""
    num_cpus_per_worker: float | None = Field(default=None, ge=0)

    @field_validator("placement_strategy")
    @classmethod
    def _strategy(cls, v: str | None) -> str | None:
        if v is not None and v not in PLACEMENT_STRATEGIES:
            raise ValueError(f"must be one of {', '.join(PLACEMENT_STRATEGIES)}")
        return v


class JobConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ep: dict = {"preset": "tiny"}
    check: CheckOptions = CheckOptions()
    bench: BenchOptions = BenchOptions()
    cluster: ClusterOptions = ClusterOptions()


def _validation_text(e: ValidationError) -> str:
    """pydantic's errors on one line: 'bench.iterations: Extra inputs are not permitted; ...'."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def load_config(path: str, args: argparse.Namespace) -> tuple[JobConfig, EPConfig]:
    """The job's config and its EPConfig; JobError(EXIT_USAGE) naming the field when wrong."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise JobError(EXIT_USAGE, f"cannot read --config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise JobError(EXIT_USAGE, f"bad config {path}: not valid YAML: {one_line(e)}") from None
    if not isinstance(data, dict):
        raise JobError(EXIT_USAGE, f"bad config {path}: the top level must be a mapping (ep:, check:, bench:, "
                                   f"cluster:), got {type(data).__name__}")
    overrides = {k: v for k, v in (("n_nodes", args.nodes), ("gpus_per_node", args.gpus_per_node)) if v is not None}
    try:
        job = JobConfig(**data)
    except ValidationError as e:
        raise JobError(EXIT_USAGE, f"bad config {path}: {_validation_text(e)}") from None
    try:
        cfg = EPConfig.from_dict(job.ep, **overrides)
    except ValidationError as e:
        raise JobError(EXIT_USAGE, f"bad config {path}: ep: {_validation_text(e)}") from None
    except (ValueError, TypeError, KeyError) as e:  # an unknown preset, a bad topology override
        raise JobError(EXIT_USAGE, f"bad config {path}: ep: {one_line(e)}") from None
    return job, cfg


def check_optional_dependencies(args: argparse.Namespace) -> None:
    """Fail before any work when an asked-for optional package is missing."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise JobError(EXIT_MISSING_DEPENDENCY,
                           f"--plot needs matplotlib ({one_line(e)}): pip install 'ray-ep[plot]', "
                           f"or leave --plot out") from None


def prepare_out(path: str) -> Path:
    out = Path(path).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JobError(EXIT_USAGE, f"cannot create --out {out}: {e.strerror or e}") from None
    if not os.access(out, os.W_OK):
        raise JobError(EXIT_USAGE, f"cannot write into --out {out}: permission denied")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray_job", description=__doc__.split("\n\n")[0],
                                     epilog=EXIT_STATUSES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="job YAML (configs/job-1node.yaml, configs/job-2nodes.yaml)")
    parser.add_argument("--out", default="artifacts", help="artifacts directory (default ./artifacts)")
    parser.add_argument("--nodes", type=int, help="override ep.n_nodes")
    parser.add_argument("--gpus-per-node", type=int, help="override ep.gpus_per_node")
    parser.add_argument("--plot", action="store_true",
                        help="also write ray_ep_bench.png (needs matplotlib: pip install 'ray-ep[plot]')")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config and the optional packages, print the plan, start nothing")
    return parser


def run(args: argparse.Namespace) -> int:
    job, cfg = load_config(args.config, args)
    check_optional_dependencies(args)
    out = Path(args.out).resolve()
    print(f"ray_ep job: {args.config}: {cfg.n_nodes} node(s) x {cfg.gpus_per_node} rank(s), H={cfg.hidden_size}, "
          f"E={cfg.n_experts}, K={cfg.top_k}, N_max={cfg.max_tokens_per_rank}, backend {cfg.backend}; "
          f"bench {job.bench.presets}; artifacts -> {out}", flush=True)
    if args.dry_run:
        print(cfg.model_dump_json(indent=1))
        return EXIT_OK
    out = prepare_out(args.out)

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
        b = job.bench
        if ep.backend != "nvshmem" and "nvshmem" in (b.backends or []):
            raise JobError(EXIT_USAGE, f"bad config {args.config}: bench.backends asks for nvshmem, but the "
                                       f"cluster runs backend {ep.backend} (no GPU per rank); use [torch]")

        c = job.check
        report = ep.check(num_tokens=c.num_tokens, seed=c.seed, routing=c.routing, rounds=c.rounds)
        if c.tolerance is not None:
            report = dataclasses.replace(report, tolerance=c.tolerance)
        print("\ncheck against ray_ep.reference:")
        print(report.table(), flush=True)
        check_path = out / "ray_ep_check.json"
        check_path.write_text(json.dumps({
            "passed": report.passed, "max_rel_error": report.max_rel_error, "max_abs_error": report.max_abs_error,
            "per_rank_rel_error": report.per_rank_rel_error, "tolerance": report.tolerance,
            "backend": report.backend, "rounds": report.rounds, "num_tokens": c.num_tokens, "routing": c.routing,
            "config": cfg.model_dump(), "workers": info}, indent=1))
        if not report.passed:
            raise JobError(EXIT_CHECK_FAILED, f"check failed: max rel error {report.max_rel_error:.2e} above the "
                                              f"tolerance {report.tolerance:.0e}; benchmark skipped. "
                                              f"Wrote {check_path}")

        print(f"\nbenchmark: presets {b.presets}, tokens {b.tokens or 'preset default'}, {b.iters} iterations",
              flush=True)
        result = bench.run_bench(ep, presets=b.presets, backends=b.backends, tokens=b.tokens, routing=b.routing,
                                 iters=b.iters, warmup=b.warmup, num_sms=b.num_sms, layer=b.layer,
                                 baselines=b.baselines, progress=sys.stderr.isatty())
    print(result.table())
    written = [check_path, out / "ray_ep_bench.json"]
    result.to_json(str(written[-1]))
    if args.plot:
        written.append(out / "ray_ep_bench.png")
        result.plot(str(written[-1]))
    print(f"\nartifacts: {', '.join(map(str, written))} ({time.perf_counter() - t0:.1f} s in all)")
    if failed := result.failed_checks():
        raise JobError(EXIT_CHECK_FAILED, f"the benchmark's check failed on {len(failed)} run(s): {failed[0]}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """The job; returns its exit status (argparse exits 2 itself on bad arguments)."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except JobError as e:
        message, status = str(e), e.status
    except BrokenPipeError:  # the reader of stdout left (`| head`): no error of the job's
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's advice (signal docs)
        return 128 + 13  # what a shell reports for a process ended by SIGPIPE
    except EPError as e:  # EPClusterError, EPWorkerError, EPTimeoutError, EPStateError, ...
        message, status = _cluster_message(e), EXIT_CLUSTER
    except Exception as e:
        import ray.exceptions

        # Ray unreachable or refusing us (ray.init raises ConnectionError), an actor or node lost
        if isinstance(e, (ray.exceptions.RayError, ConnectionError)):
            message, status = _cluster_message(e), EXIT_CLUSTER
        else:
            traceback.print_exc()
            message, status = f"unexpected error (a bug): {type(e).__name__}: {one_line(e)}", EXIT_INTERNAL
    print(f"ray_job: {message}", file=sys.stderr, flush=True)
    return status


def _cluster_message(e: Exception) -> str:
    """A cluster error on one line; a longer text (a worker's traceback) goes out first."""
    text = str(e).strip()
    if "\n" in text:
        print(text, file=sys.stderr)
    first = text.splitlines()[0] if text else ""
    return f"cluster error: {type(e).__name__}: {first}"


if __name__ == "__main__":
    sys.exit(main())
