"""Load a running MoE server (examples/serve_moe.py / `ray-ep serve`) and print its figures.

    python examples/serve_load.py --url http://127.0.0.1:8000 --requests 200 --concurrency 16 --new-tokens 8

Sends seeded random prompts (ids below the server's vocabulary) from a thread pool with a
bounded number of requests in flight; prints requests/s, generated tokens/s and latency
percentiles seen by the client, then the server's steps during the timed requests alone (from
its /stats before and after them: steps, sequences per step, ms per step and per phase, so that
warm-up, compiles and graph captures before them do not blur the figures), then its cumulative
/stats (tokens per expert, CUDA graphs: whether the MoE layers replay them, captures and
replays). Needs only `requests`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import requests


def run(url: str, n_requests: int, concurrency: int, new_tokens: int, prompt_len: tuple[int, int], vocab: int,
        seed: int = 0) -> dict:
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(vocab) for _ in range(rnd.randint(*prompt_len))] for _ in range(n_requests)]

    def one(prompt: list[int]) -> tuple[int, float]:
        t = time.perf_counter()
        r = requests.post(url + "/v1/generate", json={"prompt_ids": prompt, "max_new_tokens": new_tokens},
                          timeout=600)
        return r.status_code, time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        replies = list(ex.map(one, prompts))
    wall = time.perf_counter() - t0
    lat = sorted(dt for _, dt in replies)
    ok = sum(code == 200 for code, _ in replies)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, max(0, int(round(q * len(lat))) - 1))]

    return {"requests": n_requests, "concurrency": concurrency, "new_tokens": new_tokens, "ok": ok, "wall_s": wall,
            "requests_per_s": n_requests / wall, "tokens_per_s": ok * new_tokens / wall,
            "p50_ms": pct(0.5) * 1e3, "p90_ms": pct(0.9) * 1e3, "p99_ms": pct(0.99) * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--prompt-len", default="4,16", help="MIN,MAX prompt tokens")
    p.add_argument("--vocab", type=int, default=64, help="prompt ids are drawn below this")
    p.add_argument("--warmup", type=int, default=10, help="requests sent (one at a time) before timing")
    args = p.parse_args()
    lo, hi = (int(v) for v in args.prompt_len.split(","))
    if args.warmup:
        run(args.url, args.warmup, 1, 1, (lo, hi), args.vocab, seed=1)
    before = requests.get(args.url + "/stats", timeout=60).json()
    r = run(args.url, args.requests, args.concurrency, args.new_tokens, (lo, hi), args.vocab)
    print(f"{r['requests']} requests x {r['new_tokens']} new tokens, {r['concurrency']} in flight: {r['ok']} ok in "
          f"{r['wall_s']:.1f} s; {r['requests_per_s']:.1f} requests/s, {r['tokens_per_s']:.0f} tokens/s; latency "
          f"p50 {r['p50_ms']:.0f} ms, p90 {r['p90_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms")
    stats = requests.get(args.url + "/stats", timeout=60).json()
    print(window_line(before, stats))
    print(json.dumps({k: stats.get(k) for k in ("tokens_per_s", "latency_s", "batches", "phases", "tokens_per_expert")},
                     indent=1))
    print(graph_line(stats.get("cuda_graph")))
    return 0 if r["ok"] == r["requests"] else 1


def window_line(before: dict, after: dict) -> str:
    """The server's steps between two /stats snapshots: their count, sequences per step, ms per
    step and per phase per step (the slowest rank's, summed over the MoE layers).

    >>> window_line({"batches": {"steps": 10, "step_seconds": 1.0, "mean_sequences": 2.0},
    ...              "phases": {"dense": {"seconds": 0.5}}},
    ...             {"batches": {"steps": 30, "step_seconds": 1.4, "mean_sequences": 11.0},
    ...              "phases": {"dense": {"seconds": 0.7}, "layer": {"seconds": 0.1}}})
    'server, timed requests only: 20 steps, 15.5 sequences per step, 20.0 ms per step (dense 10.0, layer 5.0)'
    """
    b0, b1 = before.get("batches") or {}, after.get("batches") or {}
    steps = b1.get("steps", 0) - b0.get("steps", 0)
    if steps <= 0:
        return "server, timed requests only: no steps"
    seqs = b1["mean_sequences"] * b1["steps"] - b0.get("mean_sequences", 0.0) * b0.get("steps", 0)
    ms = (b1["step_seconds"] - b0.get("step_seconds", 0.0)) / steps * 1e3
    p0, p1 = before.get("phases") or {}, after.get("phases") or {}
    phases = ", ".join(f"{name} {(p1[name]['seconds'] - p0.get(name, {}).get('seconds', 0.0)) / steps * 1e3:.1f}"
                       for name in p1)
    return (f"server, timed requests only: {steps} steps, {seqs / steps:.1f} sequences per step, {ms:.1f} ms per step"
            + (f" ({phases})" if phases else ""))


def graph_line(g: dict | None) -> str:
    """One line on the server's CUDA graphs (its /stats ``cuda_graph`` entry).

    >>> graph_line({"status": "on", "graphs_per_rank": [9, 9], "captures": 18, "replays": 1100})
    'CUDA graphs: on; 1100 replays, 18 captures (counted since the workers started), graphs per rank [9, 9]'
    >>> graph_line({"status": "off (CPU workers)"})
    'CUDA graphs: off (CPU workers)'
    """
    if not g:
        return "CUDA graphs: not reported (a server without the cuda_graph option)"
    line = f"CUDA graphs: {g['status']}"
    if "replays" in g:
        line += (f"; {g['replays']} replays, {g['captures']} captures (counted since the workers started), "
                 f"graphs per rank {g['graphs_per_rank']}")
    return line


if __name__ == "__main__":
    raise SystemExit(main())
