"""Benchmarks of ray_ep beside the baselines, in one run (``ray-ep bench``, ``python -m ray_ep.bench``).

- :mod:`ray_ep.bench.runner`: the driver side: presets, the run plan, aggregation over ranks,
  the table, JSON (written and read back) and plot, the command-line flags, Ctrl-C.
- :mod:`ray_ep.bench.loops`: the per-rank loops that run inside the workers (correctness
  check, warm-up, timed iterations).
- :mod:`ray_ep.bench.experts_world`: one rank's experts of an R-rank world, timed on one device
  (``python -m ray_ep.bench.experts_world``).

The protocol and how to read the table: docs/benchmarking.md.
"""

from .runner import BENCH_PRESETS, BenchResult, BenchRow, add_arguments, main, run_bench, run_from_args

__all__ = ["BENCH_PRESETS", "BenchResult", "BenchRow", "add_arguments", "main", "run_bench", "run_from_args"]
