"""Chaos run of the MoE server: load, SIGKILL one EP worker, watch the server rebuild and serve.

    python examples/serve_chaos.py                       # CPU workers or one per GPU, 64 in flight, kill at 5 s
    python examples/serve_chaos.py --workers 4 --concurrency 64 --kill-at 5 --duration 40 --json chaos.json

Starts Ray, Serve and the server (the flags of `ray-ep serve` apply: --workers, --cpu, model
sizes...), keeps ``--concurrency`` generate requests in flight, SIGKILLs the worker process
of rank ``--kill-rank`` ``--kill-at`` seconds in (the workers must run on this host; ``--signal
STOP`` stalls it instead, for ``--stop-for`` seconds: it is found after recv_timeout_s), stops
sending at ``--duration`` s and prints: requests ok / retried / failed, the time from the kill
to the first success of a request sent after it, the server's own rebuild time, and latency
percentiles. A client that gets 503 waits the answer's Retry-After and tries again, at most
``--client-retries`` times (1 by default): with one retry, no request should be lost. Exit
status 0 when every request succeeded and the server served again after the kill, else 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass

import requests


@dataclass
class Outcome:
    sent_s: float  # since the start of the run
    done_s: float
    status: int  # the last answer's status (0: no answer)
    client_retries: int


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0 for no values."""
    if not values:
        return 0.0
    v = sorted(values)
    return v[max(0, min(len(v) - 1, math.ceil(q / 100 * len(v)) - 1))]


def run_chaos(url: str, kill, *, concurrency: int = 64, kill_at_s: float = 5.0, duration_s: float = 30.0,
              new_tokens: int = 4, client_retries: int = 1, max_retry_wait_s: float = 30.0, vocab: int = 64,
              request_timeout_s: float = 300.0, settle_s: float | None = None, headers: dict | None = None,
              seed: int = 0) -> dict:
    """Load ``url`` from ``concurrency`` threads for ``duration_s`` seconds and call ``kill()``
    at ``kill_at_s``; returns the figures (see the module docstring). ``settle_s``: stop
    earlier, that long after the first success of a request sent after the kill. ``headers``:
    sent with every generate request (e.g. the bearer token)."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    stop = threading.Event()
    killed: dict = {}

    def client(i: int) -> None:
        rnd = random.Random(seed * 1000 + i)
        session = requests.Session()
        session.headers.update(headers or {})
        while not stop.is_set():
            prompt = [rnd.randrange(vocab) for _ in range(rnd.randint(2, 12))]
            sent = time.monotonic() - t0
            status, tries = 0, 0
            while True:
                try:
                    r = session.post(url + "/v1/generate", json={"prompt_ids": prompt, "max_new_tokens": new_tokens},
                                     timeout=request_timeout_s)
                    status = r.status_code
                except requests.RequestException:
                    status, r = 0, None
                if status == 503 and tries < client_retries:
                    tries += 1
                    wait = float(r.headers.get("Retry-After", "1")) if r is not None else 1.0
                    time.sleep(min(max(wait, 0.1), max_retry_wait_s))
                    continue
                break
            with lock:
                outcomes.append(Outcome(sent, time.monotonic() - t0, status, tries))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(kill_at_s)
    killed["at_s"] = time.monotonic() - t0
    killed["what"] = kill() or "a worker"
    kill_s = killed["at_s"]
    while (left := duration_s - (time.monotonic() - t0)) > 0:
        if settle_s is not None:
            with lock:
                first = min((o.done_s for o in outcomes if o.status == 200 and o.sent_s >= kill_s), default=None)
            if first is not None and time.monotonic() - t0 >= first + settle_s:
                break
        time.sleep(min(left, 0.2))
    stop.set()
    for t in threads:
        t.join(request_timeout_s * (client_retries + 1))
    ok = [o for o in outcomes if o.status == 200]
    after = [o.done_s - kill_s for o in ok if o.sent_s >= kill_s]
    failed = [o for o in outcomes if o.status != 200]
    latencies = [o.done_s - o.sent_s for o in ok]
    stats = requests.get(url + "/stats", timeout=60).json()
    health = requests.get(url + "/health", timeout=60)
    return {
        "concurrency": concurrency, "killed": killed["what"], "kill_at_s": round(kill_s, 3),
        "duration_s": round(time.monotonic() - t0, 3),
        "requests": len(outcomes), "ok": len(ok), "failed": len(failed),
        "failed_statuses": sorted({o.status for o in failed}),
        "client_retried": sum(o.client_retries > 0 for o in outcomes),
        "client_retried_ok": sum(o.client_retries > 0 for o in ok),
        "server_retried": stats["requests"].get("retried", 0),
        "in_flight_at_kill": sum(o.sent_s < kill_s < o.done_s for o in outcomes),
        "first_success_after_kill_s": round(min(after), 3) if after else None,
        "server_rebuild_s": stats.get("recoveries", {}).get("last_s"),
        "restarts": stats.get("restarts"),
        "latency_s": {"p50": percentile(latencies, 50), "p90": percentile(latencies, 90),
                      "p99": percentile(latencies, 99), "max": max(latencies, default=0.0)},
        "health_after": health.status_code,
    }


def report(r: dict) -> str:
    lat = r["latency_s"]
    first = r["first_success_after_kill_s"]
    rebuild = r["server_rebuild_s"]
    return (f"{r['requests']} requests at {r['concurrency']} in flight over {r['duration_s']:.1f} s; killed "
            f"{r['killed']} at {r['kill_at_s']:.1f} s ({r['in_flight_at_kill']} requests in flight)\n"
            f"ok {r['ok']}, failed {r['failed']}{' (statuses %s)' % r['failed_statuses'] if r['failed'] else ''}, "
            f"retried by the client after a 503 "
            f"{r['client_retried']} ({r['client_retried_ok']} then ok), retried by the server on the rebuilt group "
            f"{r['server_retried']}\n"
            f"first success of a request sent after the kill: "
            f"{'none' if first is None else f'{first:.1f} s after it'}; server rebuild "
            f"{'-' if rebuild is None else f'{rebuild:.1f} s'} ({r['restarts']} restart(s)); /health after: "
            f"{r['health_after']}\n"
            f"latency of ok requests: p50 {lat['p50'] * 1e3:.0f} ms, p90 {lat['p90'] * 1e3:.0f} ms, "
            f"p99 {lat['p99'] * 1e3:.0f} ms, max {lat['max'] * 1e3:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    from ray_ep.serving import server

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    server.add_arguments(p)
    c = p.add_argument_group("chaos")
    c.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")
    c.add_argument("--kill-at", type=float, default=5.0, help="seconds into the run to SIGKILL a worker (default 5)")
    c.add_argument("--kill-rank", type=int, default=1, help="rank whose worker is killed (default 1)")
    c.add_argument("--signal", choices=["KILL", "STOP"], default="KILL",
                   help="KILL (default), or STOP: stall the worker (SIGSTOP), SIGCONT after --stop-for seconds")
    c.add_argument("--stop-for", type=float, default=25.0, help="with --signal STOP: seconds stopped (default 25)")
    c.add_argument("--duration", type=float, default=30.0, help="seconds of load (default 30)")
    c.add_argument("--new-tokens", type=int, default=4, help="tokens generated per request (default 4)")
    c.add_argument("--client-retries", type=int, default=1, help="retries after a 503 (default 1)")
    c.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.port is None:
        args.port = 8000
    import ray
    from ray import serve

    from ray_ep.local_cluster import plain_console, start_local_ray

    options = server.options_from_args(args)
    plain_console()
    logging.getLogger("ray.serve").setLevel(options.log_level)  # the driver's Serve lines
    owns_ray = False
    if not ray.is_initialized():
        address = args.address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, logging_level="WARNING")
        else:
            start_local_ray(max(os.cpu_count() or 1, options.workers + 1))
            owns_ray = True
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if args.workers is None and gpus and not args.cpu:
        options = server.options_from_args(args, gpus=gpus)
    handle = server.start_server(options)
    try:
        info = handle.info.remote().result()
        url = f"http://{options.host}:{options.port}{options.route_prefix.rstrip('/')}"
        print(f"serve_chaos: {info['workers']} workers, backend {info['backend']}, at {url}", flush=True)
        pids = handle.worker_pids.remote().result()
        victim = pids[args.kill_rank]

        def kill() -> str:
            pid = victim["pid"]
            if args.signal == "KILL":
                os.kill(pid, signal.SIGKILL)
                return f"rank {args.kill_rank} (pid {pid}, SIGKILL)"
            os.kill(pid, signal.SIGSTOP)

            def resume() -> None:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:  # the rebuild killed it
                    pass

            threading.Timer(args.stop_for, resume).start()
            return f"rank {args.kill_rank} (pid {pid}, SIGSTOP for {args.stop_for:g} s)"

        requests.post(url + "/v1/generate", json={"prompt_ids": [1, 2, 3]}, timeout=300)  # warm
        result = run_chaos(url, kill, concurrency=args.concurrency, kill_at_s=args.kill_at, duration_s=args.duration,
                           new_tokens=args.new_tokens, client_retries=args.client_retries,
                           vocab=options.model.vocab_size)
        result.update(workers=info["workers"], backend=info["backend"])
    finally:
        serve.delete(options.app_name)
        if owns_ray:
            ray.shutdown()
    print(report(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["failed"] == 0 and result["first_success_after_kill_s"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
