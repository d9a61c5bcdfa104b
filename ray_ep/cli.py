"""``ray-ep``: the command line.

    ray-ep plan  --preset deepseek-v3 [--gpus 4]     memory per rank: symmetric buffers, experts, host
    ray-ep check --preset tiny --world 4             layers on the cluster vs the reference
    ray-ep info                                      devices, versions, backends available
    ray-ep bench --preset deepseek-v3-prefill        benchmark table (see ray_ep.bench)
    ray-ep serve --workers 2 --port 8000             the example MoE server (see ray_ep.serving)
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .config import PRESETS, EPConfig, describe_config_error, parse_topology, plan_buffers, plan_memory
from .errors import EPError, EPInputError


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (0 or a negative count would be ignored or mean nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class UsageError(Exception):
    """A bad flag or config: ``main`` prints it on one line and exits with status 2."""


def topology_arg(text: str) -> tuple[int, int]:
    """--topology NODESxGPUS, or a usage error naming the flag."""
    try:
        return parse_topology(text)
    except ValueError as e:
        raise UsageError(f"--topology: {e}") from None


def _config_from(args: argparse.Namespace, default_world: int) -> EPConfig:
    overrides = {}
    if getattr(args, "topology", None):
        n_nodes, per_node = topology_arg(args.topology)
        overrides.update(n_nodes=n_nodes, gpus_per_node=per_node)
    elif args.gpus or args.world:
        overrides.update(n_nodes=1, gpus_per_node=args.gpus or args.world)
    for field in ("dispatch_dtype", "expert_dtype", "backend", "max_tokens_per_rank"):
        v = getattr(args, field, None)
        if v is not None:
            overrides[field] = v
    try:
        if args.config:
            return EPConfig.from_file(args.config, **overrides)
        if not overrides.get("gpus_per_node") and args.preset == "tiny":
            overrides.setdefault("gpus_per_node", default_world)
        return EPConfig.preset(args.preset, **overrides)
    except OSError as e:
        raise UsageError(f"--config {args.config}: {e.strerror or e}") from None
    except Exception as e:  # a ValidationError or a YAML/JSON syntax error: the config is wrong
        where = f"--config {args.config}" if args.config else f"--preset {args.preset}"
        raise UsageError(f"{where}: {describe_config_error(e)}") from None


def _topology_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model preset (default tiny)")
    p.add_argument("--config", help="YAML or JSON file of EPConfig fields (overrides --preset)")
    p.add_argument("--gpus", type=positive_int, help="ranks on one node (GPUs)")
    p.add_argument("--world", type=positive_int, help="ranks on one node (alias of --gpus, for CPU workers)")
    p.add_argument("--topology", help="NODESxGPUS, e.g. 2x4")
    p.add_argument("--dispatch-dtype", dest="dispatch_dtype", choices=["bf16", "fp8", "nvfp4"])
    p.add_argument("--expert-dtype", dest="expert_dtype", choices=["bf16", "fp8"],
                   help="routed expert weights: bf16 or fp8 with 128 x 128 block scales (default bf16)")
    p.add_argument("--max-tokens", dest="max_tokens_per_rank", type=int, help="max_tokens_per_rank (N_max)")


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = _config_from(args, default_world=2)
    plan = plan_buffers(cfg)
    print(f"{args.config or args.preset}: {cfg.n_nodes} node(s) x {cfg.gpus_per_node} GPU(s), H={cfg.hidden_size}, "
          f"E={cfg.n_experts}, K={cfg.top_k}, N_max={cfg.max_tokens_per_rank}, dispatch {cfg.dispatch_dtype}"
          + (f", {cfg.expert_dtype} experts" if cfg.expert_dtype != "bf16" else ""))
    print(plan.table())
    print(f"symmetric memory per GPU: {plan.total_bytes / 2**20:.1f} MiB ({plan.total_bytes} bytes)")
    print()
    print(plan_memory(cfg).table(cfg.world_size))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from .driver import EPCluster

    cfg = _config_from(args, default_world=2)
    with EPCluster(cfg, address=args.address, check_memory=not args.no_memory_check) as ep:
        report = ep.check(num_tokens=args.tokens, seed=args.seed, routing=args.routing, rounds=args.rounds,
                          fused=not args.split)
    print(f"check: {cfg.world_size} ranks, backend {report.backend}, routing {args.routing}, "
          f"{args.tokens or cfg.max_tokens_per_rank} tokens per rank")
    print(report.table())
    return 0 if report.passed else 1


def cmd_info(args: argparse.Namespace) -> int:
    import ray
    import torch
    import triton

    print(f"ray_ep {__import__('ray_ep').__version__}: torch {torch.__version__}, triton {triton.__version__}, "
          f"ray {ray.__version__}")
    n = torch.cuda.device_count()
    print(f"CUDA devices: {n}" + "".join(f"\n  {i}: {torch.cuda.get_device_name(i)}" for i in range(n)))
    try:
        import nvshmem.core  # noqa: F401

        print("nvshmem4py: available (backend nvshmem)")
    except ImportError:
        print("nvshmem4py: not installed (pip install 'ray-ep[gpu]' on GPU hosts); backend torch only")
    print(f"presets: {', '.join(sorted(PRESETS))}")
    if args.workers:
        from .driver import EPCluster

        cfg = EPConfig.preset("tiny", gpus_per_node=args.workers)
        with EPCluster(cfg, address=args.address) as ep:
            for row in ep.info():
                print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_from_args

    return run_from_args(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from .serving.server import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = OneLineParser(prog="ray-ep", description="Mixture-of-Experts dispatch/combine on Ray")
    parser.add_argument("--version", action="version", version=f"ray-ep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="print the symmetric-buffer bytes per GPU of a preset or YAML")
    _topology_args(p)
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("check", help="run MoE layers on the cluster and compare with the reference")
    _topology_args(p)
    p.add_argument("--backend", choices=["auto", "nvshmem", "torch"])
    p.add_argument("--tokens", type=positive_int, help="tokens per rank (default: max_tokens_per_rank)")
    p.add_argument("--routing", default="uniform", choices=["uniform", "skewed", "one-expert"])
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", action="store_true", help="split send/recv forms instead of fused")
    p.add_argument("--address", default=None, help="Ray address (default: start a local Ray)")
    p.add_argument("--no-memory-check", action="store_true",
                   help="start even when the memory plan exceeds the free GPU or host memory")
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("info", help="versions, devices and backends")
    p.add_argument("--workers", type=int, default=0, help="also start N workers and print what they see")
    p.add_argument("--address", default=None)
    p.set_defaults(fn=cmd_info)

    from .bench import add_arguments as bench_arguments

    p = sub.add_parser("bench", help="benchmark against the NCCL baselines (see ray_ep.bench)")
    bench_arguments(p)
    p.set_defaults(fn=cmd_bench)

    from .serving.server import add_arguments as serve_arguments  # argparse only: ray.serve loads when it runs

    p = sub.add_parser("serve", help="the example MoE server over HTTP (same flags as examples/serve_moe.py)")
    serve_arguments(p)
    p.set_defaults(fn=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Exit status: 0 done, 1 a check failed or the cluster failed (one line
    naming the error), 2 bad flags or config (one line), 130 interrupted."""
    args = build_parser().parse_args(argv)
    who = f"ray-ep {args.command}"
    try:
        return args.fn(args)
    except UsageError as e:
        print(f"{who}: {e}", file=sys.stderr)
        return 2
    except EPInputError as e:
        print(f"{who}: {e}", file=sys.stderr)
        return 2
    except EPError as e:
        print(f"{who}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{who}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
