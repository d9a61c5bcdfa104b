"""Serve the MoE transformer of :mod:`ray_ep.serving.model` over HTTP with Ray Serve.

One Serve replica (:class:`MoEServer`) owns an :class:`~ray_ep.EPCluster` (one worker per GPU,
or CPU workers when there is none) and the :class:`~ray_ep.serving.model.EPModel` on it. Requests
are batched continuously: every generation step forwards all active sequences at once
(data-parallel attention over the workers, expert-parallel MoE), and a request that arrives
while others are generating joins at the next step.

HTTP API (JSON)
    ``POST /v1/generate`` ``{"prompt_ids": [int, ...], "max_new_tokens": int = 1,
    "top_logits": int = 5}`` -> ``{"output_ids": [int, ...], "top_logits": [{"ids": [...],
    "logits": [...]}, ... one per new token], "prompt_tokens": int, "latency_s": float}``.
    Greedy decoding; ``output_ids[0]`` is the next token of the prompt. A bad request (bad
    JSON, JSON nested too deeply, empty, too long, ids out of the vocabulary, unknown fields)
    gets a 400 with ``{"error": message}``; a body over ``max_body_bytes`` 413, one not
    received within ``body_timeout_s`` 408; with a token configured, a request without it
    401. More than ``max_requests_in_flight`` generate requests at once: 503 with
    ``Retry-After: 1``. An unexpected error: 500 with ``{"error": "internal error",
    "request_id": ...}`` (the traceback is in the replica's log under that id).

    ``GET /health``: 200 while every worker answers and the EP group has not failed; 503 with
    ``Retry-After`` and ``"status": "recovering"`` while a failed group is being rebuilt
    (``"failed"`` once max_recovery_attempts rebuilds failed in a row; Serve then replaces
    the replica, see :meth:`MoEServer.check_health`).

    ``GET /stats``: tokens/s, request latency percentiles, per-phase time of the workers
    (dense, dispatch, experts, combine; one "layer" phase per MoE layer under CUDA graphs),
    tokens per expert, CUDA graphs (status, captures and replays per rank), requests
    retried, rebuilds.

Started by ``ray-ep serve`` or ``python examples/serve_moe.py`` (the same flags: see
:func:`add_arguments`); ``ray.serve`` is imported only when a server is built, so ray_ep
imports without ``ray[serve]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from ..errors import EPInputError
from ..local_cluster import init_ray_bounded, plain_console, start_local_ray
from .model import (EPModel, MoEModelConfig, check_checkpoint, init_model_weights, load_checkpoint,
                    read_checkpoint_config)

log = logging.getLogger(__name__)
access_log = logging.getLogger("ray_ep.serving.access")  # the replica's own access log (--access-log)

MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused (413)
LATENCY_WINDOW = 10_000  # requests kept for the latency percentiles
RATE_WINDOW_S = 60.0  # span of the "recent" tokens/s figures


class ServeOptions(BaseModel):
    """Everything a server needs; built from flags and/or a YAML file (keys: the field names,
    ``model:`` with :class:`MoEModelConfig` fields, ``ep:`` with extra EPConfig fields)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: MoEModelConfig = MoEModelConfig()
    """Model sizes (a checkpoint's stored config fills the fields not given)."""
    ep: dict[str, Any] = {}
    """Extra EPConfig fields: backend, dispatch_dtype, combine_dtype, timeouts..."""
    workers: int = Field(default=2, gt=0)
    """EP ranks (one per GPU; CPU workers when use_gpu is False or there are too few GPUs)."""
    nodes: int = Field(default=1, gt=0)
    """Nodes the workers spread over (workers must be divisible by nodes)."""
    use_gpu: bool | None = None
    """None: GPUs when the cluster has one per worker."""
    host: str = "127.0.0.1"
    """HTTP host (0.0.0.0 to listen on every interface)."""
    port: int = Field(default=8000, ge=0, lt=65536)
    """HTTP port."""
    seed: int = 0
    """Seed of the weights when there is no checkpoint."""
    checkpoint: str | None = None
    """A safetensors checkpoint (layout: ray_ep.serving.model); an absolute path visible to the replica."""
    max_batch_size: int = Field(default=32, gt=0)
    """Most sequences forwarded per step."""
    batch_wait_ms: float = Field(default=2.0, ge=0)
    """How long an idle server waits for more requests before starting a step."""
    max_tokens_per_rank: int | None = Field(default=None, gt=0)
    """EP buffer size per rank; None: max_seq_len * ceil(max_batch_size / workers)."""
    max_top_logits: int = Field(default=20, gt=0)
    """Largest top_logits a request may ask for."""
    profile: bool = True
    """Per-phase timing in the workers for /stats (synchronises the GPU after each phase)."""
    cuda_graph: bool = True
    """Replay each MoE layer from CUDA graphs, one per layer and token bucket (a power of two
    up to max_tokens_per_rank; the tokens of a step vary, the buckets absorb that). Active on
    GPU workers with the nvshmem backend (micro-batched layers too); elsewhere inactive (/stats says
    why), never an error. Flag ``--no-cuda-graph`` turns it off."""
    app_name: str = "ray-ep"
    """Serve application name."""
    route_prefix: str = "/"
    """Serve route prefix of the application."""
    replica_cpus: float = Field(default=0.0, ge=0)
    """CPU slots reserved by the replica (it mostly waits on the workers)."""
    max_ongoing_requests: int = Field(default=1024, gt=0)
    """Requests Serve hands the replica at once (Serve's own limit; beyond it they queue in
    Serve's proxy, up to max_queued_requests). Must exceed max_requests_in_flight, so that
    /health and /stats still reach a replica full of generate requests."""
    max_queued_requests: int = Field(default=1024, gt=0)
    """Requests Serve's proxy queues for the replica beyond max_ongoing_requests; more get
    Serve's 503."""
    max_requests_in_flight: int = Field(default=256, gt=0)
    """Generate requests the replica admits at once (reading their body, waiting or
    generating); more are answered 503 with Retry-After at once (backpressure)."""
    max_body_bytes: int = Field(default=1 << 20, gt=0)
    """Largest request body (413 beyond)."""
    body_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Longest time to receive a whole request body (408 beyond): a stalled upload does not
    hold a slot for longer."""
    api_token_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """SHA-256 (hex) of the bearer token that /v1/* requests must send (``Authorization:
    Bearer TOKEN``); None: no token. Only the hash travels to the replica
    (:func:`hash_token`; flag ``--api-token-env``)."""
    recovery_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    """How long a request waits for the EP group to be rebuilt after a failure (then 503
    with Retry-After)."""
    max_recovery_attempts: int = Field(default=3, gt=0)
    """Rebuilds that may fail in a row before the replica reports itself unhealthy to Serve
    (check_health raises), which then replaces it."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"
    """Log level of Serve's controller, proxy and replica (INFO: their start-up chatter).
    Serve's own access log stays off: it names every request ``POST /`` (see access_log)."""
    access_log: bool = False
    """One line per HTTP request from the replica, naming the route: ``POST /v1/generate 200 12.3 ms``."""

    @model_validator(mode="after")
    def _check(self) -> "ServeOptions":
        self.ep_config()  # fails early on a topology or EP field problem
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank < self.model.max_seq_len:
            raise ValueError(f"max_tokens_per_rank = {self.max_tokens_per_rank} must be >= max_seq_len = "
                             f"{self.model.max_seq_len}, so that any one sequence fits a rank")
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {self.route_prefix!r}")
        if self.max_ongoing_requests <= self.max_requests_in_flight:
            raise ValueError(f"max_ongoing_requests = {self.max_ongoing_requests} must exceed max_requests_in_flight = "
                             f"{self.max_requests_in_flight}, so that /health and /stats reach a busy replica")
        return self

    def tokens_per_rank(self) -> int:
        if self.max_tokens_per_rank is not None:
            return self.max_tokens_per_rank
        return self.model.max_seq_len * math.ceil(self.max_batch_size / self.workers)

    def ep_config(self):
        return self.model.ep_config(world_size=self.workers, max_tokens_per_rank=self.tokens_per_rank(),
                                    n_nodes=self.nodes, **self.ep)


class GenerateRequest(BaseModel):
    """Body of ``POST /v1/generate``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_ids: list[StrictInt] = Field(min_length=1)
    """Token ids of the prompt (at least one)."""
    max_new_tokens: StrictInt = Field(default=1, ge=1)
    """Tokens to generate greedily."""
    top_logits: StrictInt = Field(default=5, ge=0)
    """How many of the best logits to return per new token."""


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and a message for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def validate_request(body: bytes, config: MoEModelConfig, max_top_logits: int,
                     max_body_bytes: int = MAX_BODY_BYTES) -> GenerateRequest:
    """Parse and check a generate body; raise RequestError(400/413) with a message."""
    if len(body) > max_body_bytes:
        raise RequestError(413, f"request body of {len(body)} bytes exceeds {max_body_bytes}")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"body is not valid JSON: {e}") from None
    except RecursionError:  # json nests one Python call per level: [[[[...]]]]
        raise RequestError(400, "body nests too deeply (JSON arrays or objects inside each other); "
                                "a generate request is one flat object") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"body must be a JSON object, got {type(data).__name__}")
    try:
        req = GenerateRequest.model_validate(data)
    except RecursionError:
        raise RequestError(400, "body nests too deeply; a generate request is one flat object") from None
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors())
        raise RequestError(400, f"invalid request: {msgs}") from None
    n, V = len(req.prompt_ids), config.vocab_size
    lo, hi = min(req.prompt_ids), max(req.prompt_ids)
    if lo < 0 or hi >= V:
        raise RequestError(400, f"prompt_ids must lie in [0, vocab_size = {V}); found values in [{lo}, {hi}]")
    # every new token but the last is fed back
    if n + req.max_new_tokens - 1 > config.max_seq_len:
        raise RequestError(400, f"prompt of {n} tokens + max_new_tokens = {req.max_new_tokens} is too long: "
                                f"prompt + max_new_tokens - 1 must be <= max_seq_len = {config.max_seq_len}")
    if req.top_logits > max_top_logits:
        raise RequestError(400, f"top_logits = {req.top_logits} exceeds the server's limit of {max_top_logits}")
    return req


# ---- stats ---------------------------------------------------------------------------------
def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an ascending list; 0 for an empty one."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


class ServerStats:
    """Request and step counters of one server (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.ok = self.client_errors = self.server_errors = 0
        self.retried = 0  # requests whose step failed with the EP group and that were run again
        self.recoveries = 0
        self.last_recovery_s: float | None = None
        self.latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self.prompt_tokens = self.generated_tokens = self.forward_tokens = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.max_sequences = 0
        self.sequences = 0
        self._recent: collections.deque[tuple[float, int, int]] = collections.deque()  # (t, generated, forwarded)

    def request(self, status: int, latency_s: float | None = None, prompt_tokens: int = 0) -> None:
        with self._lock:
            if status < 400:
                self.ok += 1
                self.prompt_tokens += prompt_tokens
                if latency_s is not None:
                    self.latencies.append(latency_s)
            elif status < 500:
                self.client_errors += 1
            else:
                self.server_errors += 1

    def retry(self) -> None:
        with self._lock:
            self.retried += 1

    def recovered(self, seconds: float) -> None:
        with self._lock:
            self.recoveries += 1
            self.last_recovery_s = seconds

    def step(self, seconds: float, sequences: int, generated: int, forwarded: int) -> None:
        with self._lock:
            now = time.time()
            self.steps += 1
            self.step_seconds += seconds
            self.sequences += sequences
            self.max_sequences = max(self.max_sequences, sequences)
            self.generated_tokens += generated
            self.forward_tokens += forwarded
            self._recent.append((now, generated, forwarded))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def snapshot(self) -> dict:
        with self._lock:
            lat = sorted(self.latencies)
            now = time.time()
            recent = [r for r in self._recent if r[0] >= now - RATE_WINDOW_S]
            span = min(RATE_WINDOW_S, now - self.started)
            busy = self.step_seconds
            return {
                "uptime_s": round(now - self.started, 3),
                "requests": {"ok": self.ok, "client_errors": self.client_errors, "server_errors": self.server_errors,
                             "retried": self.retried},
                "recoveries": {"count": self.recoveries, "last_s": self.last_recovery_s},
                "tokens": {"prompt": self.prompt_tokens, "generated": self.generated_tokens,
                           "forwarded": self.forward_tokens},
                "tokens_per_s": {
                    # while steps run (the engine's speed) and over the last RATE_WINDOW_S (the load)
                    "generated_busy": self.generated_tokens / busy if busy else 0.0,
                    "forwarded_busy": self.forward_tokens / busy if busy else 0.0,
                    "generated_recent": sum(r[1] for r in recent) / span if span > 0 else 0.0,
                    "forwarded_recent": sum(r[2] for r in recent) / span if span > 0 else 0.0,
                    "window_s": RATE_WINDOW_S,
                },
                "latency_s": {"count": len(lat), "mean": sum(lat) / len(lat) if lat else 0.0,
                              "p50": percentile(lat, 50), "p90": percentile(lat, 90), "p99": percentile(lat, 99),
                              "max": lat[-1] if lat else 0.0},
                "batches": {"steps": self.steps, "step_seconds": round(busy, 6),
                            "mean_sequences": self.sequences / self.steps if self.steps else 0.0,
                            "max_sequences": self.max_sequences},
            }


def summarize_phases(per_rank: list[dict]) -> dict:
    """Worker phase stats -> per phase the slowest rank's seconds, every rank's seconds and
    calls; tokens per expert in global expert order (rank r holds experts r*L..(r+1)*L-1)."""
    names = sorted({k for s in per_rank for k in s["seconds"]})
    phases = {n: {"seconds": max(s["seconds"].get(n, 0.0) for s in per_rank),
                  "per_rank_seconds": [s["seconds"].get(n, 0.0) for s in per_rank],
                  "calls": max(s["calls"].get(n, 0) for s in per_rank)} for n in names}
    experts = [c for s in per_rank for c in s["expert_tokens"]]
    return {"phases": phases, "tokens_per_expert": experts, "tokens_per_rank": [s["tokens"] for s in per_rank]}


def summarize_graphs(status: str, per_rank: list[dict] | None) -> dict:
    """The ``cuda_graph`` entry of /stats: ``status`` ("on", or "off" and why) and, from the
    workers' phase stats (None: not asked), per rank the graphs held, captures and replays
    (each MoE layer of a step is one replay once its token bucket was captured) and their sums.

    >>> summarize_graphs("on", [{"graphs": {"graphs": 2, "captures": 2, "replays": 6}},
    ...                         {"graphs": {"graphs": 1, "captures": 1, "replays": 7}}])["replays"]
    13
    >>> summarize_graphs("off (CPU workers)", [{"seconds": {}}])
    {'status': 'off (CPU workers)'}
    """
    out: dict[str, Any] = {"status": status}
    stats = [s.get("graphs") for s in per_rank or []]
    if stats and all(g is not None for g in stats):  # CPU workers report none
        for k in ("graphs", "captures", "replays"):
            out[k + "_per_rank"] = [g[k] for g in stats]
        out["captures"] = sum(g["captures"] for g in stats)
        out["replays"] = sum(g["replays"] for g in stats)
    return out


# ---- continuous batching -------------------------------------------------------------------
@dataclass
class _Sequence:
    tokens: list[int]
    remaining: int
    top_n: int
    future: asyncio.Future
    output: list[int] = field(default_factory=list)
    top: list[dict] = field(default_factory=list)


class ContinuousBatcher:
    """Runs generation steps over every active sequence; new requests join at the next step.

    ``step_fn(sequences, top_n) -> NextTokens`` runs in a thread (it blocks on the workers).
    An idle batcher waits ``wait_s`` after the first arrival so that concurrent requests
    share the first step. A failed step fails every active request.
    """

    def __init__(self, step_fn, max_batch_size: int, wait_s: float, stats: ServerStats):
        self._step_fn = step_fn
        self._max = max_batch_size
        self._wait_s = wait_s
        self._stats = stats
        self._queue: collections.deque[_Sequence] = collections.deque()
        self._active: list[_Sequence] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def submit(self, prompt: list[int], max_new_tokens: int, top_n: int) -> _Sequence:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        seq = _Sequence(list(prompt), max_new_tokens, top_n, asyncio.get_running_loop().create_future())
        self._queue.append(seq)
        self._wake.set()
        return await seq.future

    async def _loop(self) -> None:
        while True:
            if not self._active and not self._queue:
                self._wake.clear()
                await self._wake.wait()
                if self._wait_s:
                    await asyncio.sleep(self._wait_s)
            while self._queue and len(self._active) < self._max:
                seq = self._queue.popleft()
                if not seq.future.done():  # a client that went away is dropped
                    self._active.append(seq)
            batch = [s for s in self._active if not s.future.done()]
            self._active = batch
            if not batch:
                continue
            top_n = max(1, max(s.top_n for s in batch))
            t0 = time.perf_counter()
            try:
                nxt = await asyncio.to_thread(self._step_fn, [s.tokens for s in batch], top_n)
            except Exception as e:  # noqa: BLE001 - every waiting client gets the error
                for s in batch:
                    if not s.future.done():
                        s.future.set_exception(e)
                self._active = []
                continue
            dt = time.perf_counter() - t0
            self._stats.step(dt, len(batch), len(batch), sum(len(s.tokens) for s in batch))
            ids, vals = nxt.top_ids.tolist(), nxt.top_logits.tolist()
            for s, i_row, v_row in zip(batch, ids, vals):
                s.output.append(i_row[0])
                s.tokens.append(i_row[0])
                if s.top_n:
                    s.top.append({"ids": i_row[:s.top_n], "logits": v_row[:s.top_n]})
                s.remaining -= 1
                if s.remaining == 0 and not s.future.done():
                    s.future.set_result(s)
            self._active = [s for s in batch if s.remaining > 0]


# ---- the deployment --------------------------------------------------------------------------
DEFAULT_RECOVERY_S = 10.0  # Retry-After before any rebuild was timed (CPU: 3-10 s measured)


def hash_token(token: str) -> str:
    """The SHA-256 hex digest that :attr:`ServeOptions.api_token_sha256` holds for ``token``."""
    import hashlib

    return hashlib.sha256(token.encode()).hexdigest()


class MoEServer:
    """The Serve deployment (made one by :func:`build_app`): owns the EP workers and the model,
    batches requests, answers HTTP. Plain class, so ray_ep imports without ray[serve].

    Recovery: a step that fails because the EP group failed (a dead worker, a call past its
    timeout, a silent peer) starts one rebuild (:meth:`EPCluster.restart`: new workers,
    experts reloaded; then the dense weights); the requests of that step wait for it and are
    retried once; requests arriving meanwhile wait too. A request that cannot be served
    within ``recovery_timeout_s``, or whose retry fails, gets 503 with Retry-After.
    ``/health`` says "recovering" meanwhile; :meth:`check_health` (Serve's replica health
    check) raises once ``max_recovery_attempts`` rebuilds failed in a row, so that Serve
    replaces the replica."""

    def __init__(self, options: ServeOptions):
        from ..driver import EPCluster

        self.options = options
        cfg = options.model
        if options.checkpoint:
            weights = load_checkpoint(options.checkpoint, cfg)
        else:
            weights = init_model_weights(cfg, seed=options.seed)
        self.cluster = EPCluster(options.ep_config(), use_gpu=options.use_gpu)
        self.cluster.start()
        try:
            self.model = EPModel(self.cluster, weights, cuda_graph=options.cuda_graph).load()
            if options.profile:
                self.model.set_profiling(True)
        except BaseException:
            self.cluster.shutdown()
            raise
        self._lock = threading.Lock()  # one driver call at a time (steps are collective)
        self.stats = ServerStats()
        self.batcher = ContinuousBatcher(self._step, options.max_batch_size, options.batch_wait_ms / 1000, self.stats)
        self._in_flight = 0  # generate requests admitted (max_requests_in_flight)
        self._generation = 0  # rebuilds done; a failure seen at generation g needs a rebuild only once
        self._recovery: asyncio.Task | None = None
        self._recovery_started = 0.0
        self._recovery_reason: str | None = None
        self._recovery_failures = 0  # in a row
        self._recovery_error: str | None = None
        self._last_recovery_s: float | None = None
        if options.access_log:
            _enable_access_log()
        log.info("ray_ep.serving.server: %d workers (%s), CUDA graphs %s, model %s", self.cluster.world_size,
                 self.cluster.backend, self.model.cuda_graph_status, cfg.model_dump())

    def _step(self, sequences: list[list[int]], top_n: int):
        with self._lock:
            return self.model.next_tokens(sequences, top_n=top_n)

    def _phase_stats(self) -> list[dict]:
        with self._lock:
            return self.model.phase_stats()

    # -- recovery --
    @property
    def recovering(self) -> bool:
        return self._recovery is not None and not self._recovery.done()

    @property
    def gave_up(self) -> bool:
        """max_recovery_attempts rebuilds failed in a row: only a new replica can serve."""
        return self._recovery_failures >= self.options.max_recovery_attempts

    def _retry_after_s(self) -> int:
        """Seconds a client should wait: what is left of a rebuild as long as the last one."""
        expected = self._last_recovery_s or DEFAULT_RECOVERY_S
        if self.recovering:
            expected -= time.monotonic() - self._recovery_started
        return max(1, math.ceil(expected))

    def _start_recovery(self, generation: int, reason: str) -> None:
        """Rebuild the group unless a rebuild since ``generation`` ran, one runs, or the
        replica gave up."""
        if generation != self._generation or self.recovering or self.gave_up:
            return
        self._recovery_started = time.monotonic()
        self._recovery_reason = reason
        self._recovery = asyncio.get_running_loop().create_task(self._recover(reason))

    async def _recover(self, reason: str) -> bool:
        log.warning("ray_ep.serving.server: %s; rebuilding the EP group", reason)
        try:
            took = await asyncio.to_thread(self._rebuild)
        except Exception as e:  # noqa: BLE001 - reported by /health and check_health
            self._recovery_failures += 1
            self._recovery_error = _cause_line(e)
            log.exception("ray_ep.serving.server: rebuilding the EP group failed (%d of %d attempts)",
                          self._recovery_failures, self.options.max_recovery_attempts)
            return False
        if took is None:
            log.warning("ray_ep.serving.server: the EP group answers again and has not failed: no rebuild")
            return True
        self._last_recovery_s = took
        self._generation += 1
        self._recovery_failures = 0
        self._recovery_error = None
        self.stats.recovered(self._last_recovery_s)
        log.warning("ray_ep.serving.server: EP group rebuilt in %.1f s; serving again", self._last_recovery_s)
        return True

    def _rebuild(self) -> float | None:
        """Restart the group and return the seconds it took, or None when the group turned
        out fine: a rank that missed a health ping (a stall) is only rebuilt once the step it
        holds up has ended (its peers' recv_timeout_s bounds that), and it may be back by then."""
        with self._lock:  # no step runs meanwhile
            if self.cluster.alive and all(self.cluster.health()):
                return None
            t0 = time.perf_counter()
            self.cluster.restart()  # new workers, new rendezvous, the experts reloaded
            self.model.install_dense()
            if self.options.profile:
                self.model.set_profiling(True)
            return time.perf_counter() - t0

    async def _wait_for_recovery(self, deadline: float) -> bool:
        """Wait (until ``deadline``, monotonic) for a running rebuild; True when the group serves."""
        while self.recovering:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(asyncio.shield(self._recovery), left)
            except asyncio.TimeoutError:
                return False
        return self.cluster.alive

    # -- introspection through a DeploymentHandle (tests, operators) --
    def info(self) -> dict:
        """Workers, backend, CUDA graphs ("on", or "off" and why), model and EP config."""
        return {"workers": self.cluster.world_size, "backend": self.cluster.backend,
                "cuda_graph": self.model.cuda_graph_status,
                "model": self.options.model.model_dump(), "ep": self.cluster.config.model_dump(),
                "checkpoint": self.options.checkpoint, "seed": None if self.options.checkpoint else self.options.seed,
                "restarts": self.cluster.restarts}

    def worker_actors(self) -> list:
        """Ray actor handles of the EP workers, in rank order."""
        return self.cluster.actors

    def worker_pids(self) -> list[dict]:
        """Per rank: its node id and process id (fault tests, chaos runs)."""
        return [{"rank": i["rank"], "node_id": i["node_id"], "pid": i["pid"]} for i in self.cluster.info()]

    async def check_health(self) -> None:
        """Serve's replica health check: raises once the replica cannot recover (its rebuilds
        failed max_recovery_attempts times in a row, or one runs past recovery_timeout_s), so
        Serve replaces it; a failed group found here starts a rebuild."""
        if self.gave_up:
            raise RuntimeError(f"the EP group failed and {self._recovery_failures} rebuilds in a row failed "
                               f"(last: {self._recovery_error}); the replica cannot serve")
        if self.recovering:
            took = time.monotonic() - self._recovery_started
            if took > self.options.recovery_timeout_s:
                raise RuntimeError(f"rebuilding the EP group takes {took:.0f} s, more than recovery_timeout_s = "
                                   f"{self.options.recovery_timeout_s:g} s")
            return
        generation = self._generation
        if not self.cluster.alive:  # failed, or a rebuild failed half-way
            self._start_recovery(generation, _why_unhealthy(self.cluster, [], "Serve's health check"))
            return
        try:
            ok = await asyncio.to_thread(self.cluster.health)
        except Exception:  # noqa: BLE001 - a rebuild that started meanwhile took the group away
            return
        if not all(ok):
            reason = _why_unhealthy(self.cluster, ok, "Serve's health check")
            # a step stuck on the silent rank holds the lock the rebuild needs: let it go now
            # instead of after call_timeout_s (its requests are retried on the rebuilt group)
            self.cluster.mark_failed(reason)
            self._start_recovery(generation, reason)

    # -- HTTP --
    async def __call__(self, request):
        if not self.options.access_log:
            return await self._route(request)
        t0 = time.perf_counter()
        response = await self._route(request)
        client = request.client.host if request.client else "-"
        access_log.info("%s %s %s %d %.1f ms", client, request.method, self._path(request), response.status_code,
                        (time.perf_counter() - t0) * 1e3)
        return response

    @staticmethod
    def _path(request) -> str:
        """The route inside the app (the request's path less the app's route prefix)."""
        path = request.scope.get("path", "/")
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        return "/" + path.strip("/")

    async def _route(self, request):
        from starlette.responses import JSONResponse

        path = self._path(request)
        routes = {"/v1/generate": ("POST", self._generate), "/health": ("GET", self._health),
                  "/stats": ("GET", self._stats)}
        if path not in routes:
            self.stats.request(404)
            return JSONResponse({"error": f"no route {path}; use POST /v1/generate, GET /health, GET /stats"},
                                status_code=404)
        method, handler = routes[path]
        if request.method != method:
            self.stats.request(405)
            return JSONResponse({"error": f"{path} takes {method}, not {request.method}"}, status_code=405,
                                headers={"Allow": method})
        if path.startswith("/v1/") and not self._authorized(request):
            self.stats.request(401)
            return JSONResponse({"error": "this server needs a bearer token: send 'Authorization: Bearer TOKEN'"},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except Exception:  # noqa: BLE001 - the details stay in the replica's log
            return self._internal_error(request, "internal error")

    def _authorized(self, request) -> bool:
        want = self.options.api_token_sha256
        if want is None:
            return True
        import hmac

        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(hash_token(token.strip()), want)

    def _internal_error(self, request, what: str, status: int = 500, headers: dict | None = None):
        """A short answer naming a request id; the traceback goes to the replica's log."""
        import uuid

        from starlette.responses import JSONResponse

        rid = request.headers.get("x-request-id") or uuid.uuid4().hex[:16]
        log.error("ray_ep.serving.server: request %s: %s", rid, what, exc_info=sys.exc_info()[0] is not None)
        self.stats.request(status)
        return JSONResponse({"error": what, "request_id": rid}, status_code=status, headers=headers)

    def _unavailable(self, request, why: str):
        s = self._retry_after_s()
        return self._internal_error(request, f"{why}; retry after {s} s", status=503, headers={"Retry-After": str(s)})

    async def _read_body(self, request) -> bytes:
        """The body, at most max_body_bytes (413) and within body_timeout_s (408)."""
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise RequestError(413, f"request body of {declared} bytes exceeds {limit}")

        async def read() -> bytes:
            chunks, n = [], 0
            async for chunk in request.stream():
                n += len(chunk)
                if n > limit:
                    raise RequestError(413, f"request body exceeds {limit} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            return await asyncio.wait_for(read(), self.options.body_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(408, f"request body not received within {self.options.body_timeout_s:g} s") from None

    async def _generate(self, request):
        from starlette.responses import JSONResponse

        if self._in_flight >= self.options.max_requests_in_flight:  # backpressure, before reading the body
            self.stats.request(503)
            return JSONResponse({"error": f"busy: {self._in_flight} requests in flight (max_requests_in_flight); "
                                          f"retry after 1 s"}, status_code=503, headers={"Retry-After": "1"})
        self._in_flight += 1
        try:
            return await self._generate_admitted(request)
        finally:
            self._in_flight -= 1

    async def _generate_admitted(self, request):
        from starlette.responses import JSONResponse

        t0 = time.perf_counter()
        try:
            req = validate_request(await self._read_body(request), self.options.model, self.options.max_top_logits,
                                   self.options.max_body_bytes)
        except RequestError as e:
            self.stats.request(e.status)
            return JSONResponse({"error": e.message}, status_code=e.status)
        deadline = time.monotonic() + self.options.recovery_timeout_s
        retried = False
        while True:
            if self.gave_up:
                return self._unavailable(request, "the EP workers failed and could not be rebuilt")
            if not self.cluster.alive and not self.recovering:
                self._start_recovery(self._generation, _why_unhealthy(self.cluster, [], "a request"))
            if not await self._wait_for_recovery(deadline):
                return self._unavailable(request, "the EP workers failed and are being rebuilt")
            generation = self._generation
            try:
                seq = await self.batcher.submit(req.prompt_ids, req.max_new_tokens, req.top_logits)
                break
            except EPInputError as e:  # refused by the model's own checks
                self.stats.request(400)
                cause = getattr(e, "cause", None)  # raised in a worker: its own message, not Ray's traceback
                return JSONResponse({"error": str(cause if isinstance(cause, EPInputError) else e)}, status_code=400)
            except Exception:  # noqa: BLE001
                if self.cluster.alive:  # not a failure of the group: a bug, logged with its id
                    return self._internal_error(request, "internal error")
                log.debug("ray_ep.serving.server: a step failed with the EP group (%s)", self.cluster.failure)
                self._start_recovery(generation, f"a step failed with the EP group ({self.cluster.failure})")
                if retried:
                    return self._unavailable(request, "the EP workers failed again after a rebuild")
                retried = True
                self.stats.retry()
        latency = time.perf_counter() - t0
        self.stats.request(200, latency, len(req.prompt_ids))
        return JSONResponse({"output_ids": seq.output, "top_logits": seq.top, "prompt_tokens": len(req.prompt_ids),
                             "latency_s": round(latency, 6)})

    async def _health(self, request):
        from starlette.responses import JSONResponse

        backend = self.cluster.backend
        if self.gave_up or self.recovering:
            s = self._retry_after_s()
            body = {"status": "failed" if self.gave_up else "recovering", "backend": backend,
                    "error": self._recovery_error or self.cluster.failure or self._recovery_reason, "retry_after_s": s,
                    "restarts": self.cluster.restarts}
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(s)})
        generation = self._generation
        try:
            ok = await asyncio.to_thread(self.cluster.health)
        except Exception as e:  # noqa: BLE001 - e.g. a rebuild took the group away meanwhile
            ok, error = [], _cause_line(e)
        else:
            error = self.cluster.failure
        if ok and all(ok):
            return JSONResponse({"status": "ok", "workers": ok, "backend": backend,
                                 "restarts": self.cluster.restarts})
        self._start_recovery(generation, _why_unhealthy(self.cluster, ok, "/health"))
        s = self._retry_after_s()
        status = "recovering" if self.recovering else "unhealthy"
        body = {"status": status, "workers": ok, "backend": backend, "error": error, "retry_after_s": s,
                "restarts": self.cluster.restarts}
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(s)})

    async def _stats(self, request):
        from starlette.responses import JSONResponse

        out = self.stats.snapshot()
        out.update(workers=self.cluster.world_size, backend=self.cluster.backend, profiling=self.options.profile,
                   in_flight=self._in_flight, restarts=self.cluster.restarts)
        graphs = self.model.cuda_graph
        per_rank = None
        # the graph counters need no profiling (no GPU sync), only a call to the workers
        if (self.options.profile or graphs) and self.cluster.alive and not self.recovering:
            try:
                per_rank = await asyncio.to_thread(self._phase_stats)
                if self.options.profile:
                    out.update(summarize_phases(per_rank))
            except Exception as e:  # noqa: BLE001 - a dead worker: the rest of the stats still help
                out["phases_error"] = _cause_line(e)
        out["cuda_graph"] = summarize_graphs(self.model.cuda_graph_status, per_rank if graphs else None)
        return JSONResponse(out)

    def __del__(self) -> None:
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            try:
                cluster.shutdown()
            except Exception as e:  # noqa: BLE001
                log.warning("ray_ep.serving.server: shutdown: %s", e)


def _why_unhealthy(cluster, ok: list[bool], who: str) -> str:
    """Why ``who`` (a health probe) found the group unfit to serve."""
    if cluster.failure:
        return f"{who} found the EP group failed ({cluster.failure})"
    if not cluster.alive:
        return f"{who} found the EP group not running (a rebuild failed)"
    silent = [r for r, answered in enumerate(ok) if not answered]
    return f"{who}: rank(s) {silent} did not answer a ping (stalled or dead)"


def _cause_line(e: BaseException) -> str:
    """One line for a client or /health: the error's type and first line, no traceback."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first[:300]}"


def _enable_access_log() -> None:
    """Send :data:`access_log` to the replica's stderr, which Ray forwards to the driver's
    console (prefixed ``(ServeReplica:APP:MoEServer pid=N)``); once per process."""
    if not any(getattr(h, "_ray_ep_access", False) for h in access_log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._ray_ep_access = True  # type: ignore[attr-defined]
        access_log.addHandler(handler)
    access_log.setLevel(logging.INFO)
    access_log.propagate = False


def build_app(options: ServeOptions):
    """The Serve application (one replica of :class:`MoEServer`); run it with ``serve.run``."""
    from ray import serve

    dep = serve.deployment(MoEServer, name="MoEServer", num_replicas=1,
                           max_ongoing_requests=options.max_ongoing_requests,
                           max_queued_requests=options.max_queued_requests,
                           ray_actor_options={"num_cpus": options.replica_cpus},
                           # a constructor that fails (bad checkpoint, too few GPUs) fails the deploy
                           max_constructor_retry_count=1)
    return dep.bind(options)


# ---- command line ----------------------------------------------------------------------------
_MODEL_FLAGS = {"vocab_size": "V: token ids 0..V-1", "hidden_size": "H", "n_layers": "decoder layers",
                "n_heads": "attention heads", "max_seq_len": "longest prompt + generated sequence",
                "n_experts": "E: routed experts per layer", "top_k": "K: experts per token",
                "intermediate_size": "F: width of each SwiGLU expert", "n_shared_experts": "shared experts per layer"}
_EP_FLAGS = ("backend", "dispatch_dtype", "combine_dtype", "expert_dtype")
_SERVE_FLAGS = ("workers", "nodes", "host", "port", "seed", "checkpoint", "max_batch_size", "batch_wait_ms",
                "max_tokens_per_rank", "log_level", "max_requests_in_flight")
API_TOKEN_ENV = "RAY_EP_API_TOKEN"
"""Environment variable with the bearer token of /v1/* (``--api-token-env`` names another)."""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``ray-ep serve`` and ``examples/serve_moe.py``. Unset flags fall back to the
    YAML file (``--config``), then to a checkpoint's stored config, then to the defaults."""
    g = parser.add_argument_group("server")
    g.add_argument("--config", metavar="YAML", help="YAML with ServeOptions fields (model:, ep:, workers, port...)")
    g.add_argument("--workers", type=int,
                   help="EP workers, one per GPU (default: the GPUs of the cluster, else 2 CPU workers)")
    g.add_argument("--nodes", type=int, help="nodes the workers spread over (default 1)")
    g.add_argument("--cpu", action="store_true", help="CPU workers even when GPUs are there")
    g.add_argument("--host", help="HTTP host (default 127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, help="HTTP port (default 8000)")
    g.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS, else a new local Ray)")
    g.add_argument("--max-batch-size", type=int, help="most sequences per generation step (default 32)")
    g.add_argument("--batch-wait-ms", type=float, help="wait for more requests before a step when idle (default 2)")
    g.add_argument("--max-tokens-per-rank", type=int,
                   help="EP buffer per rank (default max_seq_len * ceil(max_batch_size / workers))")
    g.add_argument("--max-requests-in-flight", type=int,
                   help="generate requests admitted at once; more get 503 with Retry-After (default 256)")
    g.add_argument("--api-token-env", metavar="VAR",
                   help=f"require 'Authorization: Bearer TOKEN' on /v1/*, TOKEN read from the environment variable "
                        f"VAR (default: {API_TOKEN_ENV} when it is set; otherwise no token)")
    g.add_argument("--no-profile", action="store_true",
                   help="no per-phase timing in /stats (saves a GPU sync per phase)")
    g.add_argument("--no-cuda-graph", action="store_true",
                   help="run the MoE layers eagerly, not replayed from CUDA graphs per token bucket (graphs are on "
                        "by default on GPU workers with the nvshmem backend; CPU workers never use them)")
    g.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level of Ray and Serve (controller, proxy, replica) and of this command "
                        "(default WARNING)")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="Ray's and Serve's INFO lines: start-up, deployment, shutdown (= --log-level INFO)")
    g.add_argument("--access-log", action="store_true",
                   help="one line per HTTP request from the replica: client, method, route, status, time")
    m = parser.add_argument_group("model")
    m.add_argument("--checkpoint", metavar="SAFETENSORS",
                   help="weights in the layout of ray_ep.serving.model (default: seeded)")
    m.add_argument("--seed", type=int, help="seed of the weights without a checkpoint (default 0)")
    for name, text in _MODEL_FLAGS.items():
        m.add_argument("--" + name.replace("_", "-"), type=int, dest=name,
                       help=f"{text} (default {MoEModelConfig.model_fields[name].default})")
    e = parser.add_argument_group("expert parallelism")
    e.add_argument("--backend", choices=["auto", "nvshmem", "torch"], help="EP backend (default auto)")
    e.add_argument("--dispatch-dtype", choices=["bf16", "fp8", "nvfp4"], help="dispatch wire format (default bf16)")
    e.add_argument("--combine-dtype", choices=["bf16", "fp32"], help="combine wire format (default bf16)")
    e.add_argument("--expert-dtype", choices=["bf16", "fp8"],
                   help="routed expert weights on the workers: bf16, or fp8 e4m3 with one scale per 128 x 128 "
                        "block (H and F multiples of 128); a checkpoint's experts are converted (default bf16)")
    return parser


def options_from_args(args: argparse.Namespace, gpus: int | None = None) -> ServeOptions:
    """ServeOptions from parsed flags: defaults < checkpoint config < YAML < flags.
    ``gpus`` (the cluster's) sets the default worker count."""
    data: dict[str, Any] = {}
    if getattr(args, "config", None):
        import yaml

        loaded = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.config}: expected a mapping of serve options, got {type(loaded).__name__}")
        data = loaded
    model = dict(data.get("model") or {})
    ep = dict(data.get("ep") or {})
    for name in _SERVE_FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            data[name] = v
    if data.get("checkpoint"):
        data["checkpoint"] = str(Path(data["checkpoint"]).expanduser().resolve())
        stored = read_checkpoint_config(data["checkpoint"])
        if stored is not None:
            model = {**stored.model_dump(), **model}
    for name in _MODEL_FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            model[name] = v
    for name in _EP_FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            ep[name] = v
    if getattr(args, "cpu", False):
        data["use_gpu"] = False
    if getattr(args, "no_profile", False):
        data["profile"] = False
    if getattr(args, "no_cuda_graph", False):
        data["cuda_graph"] = False
    if getattr(args, "verbose", False) and getattr(args, "log_level", None) is None:
        data["log_level"] = "INFO"
    if getattr(args, "access_log", False):
        data["access_log"] = True
    token_env = getattr(args, "api_token_env", None)
    token = os.environ.get(token_env or API_TOKEN_ENV)
    if token_env and not token:
        raise ValueError(f"--api-token-env {token_env}: the environment variable {token_env} is unset or empty")
    if token:
        data["api_token_sha256"] = hash_token(token)
    if "workers" not in data:
        data["workers"] = gpus if gpus and data.get("use_gpu") is not False else 2
    data["model"], data["ep"] = model, ep
    options = ServeOptions(**data)
    if options.checkpoint:
        check_checkpoint(options.checkpoint, options.model)
    return options


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def serve_logging_config(options: ServeOptions) -> dict:
    """Serve's LoggingConfig of the controller, the proxy and the replica: ``log_level``, and
    Serve's access log off (it names every request of this app ``POST /``, the route prefix;
    ``options.access_log`` turns on the replica's own, which names the route)."""
    return {"log_level": options.log_level, "enable_access_log": False}


def start_server(options: ServeOptions):
    """Start Serve's HTTP proxy on options.host:port in the connected Ray (a running Serve
    keeps its own proxy and logging) and deploy the app; returns its DeploymentHandle once the
    replica is up (workers started, model loaded). Raises if the replica cannot start."""
    from ray import serve

    logging_config = serve_logging_config(options)
    serve.start(http_options={"host": options.host, "port": options.port}, logging_config=logging_config)
    return serve.run(build_app(options), name=options.app_name, route_prefix=options.route_prefix, blocking=False,
                     logging_config=logging_config)


DESCRIPTION = ("Serve a small MoE transformer whose MoE layers run expert-parallel on ray_ep workers "
               "(Ray Serve, JSON over HTTP).")

# Exit statuses of ``ray-ep serve`` (docs/serving.md)
EXIT_OK = 0  # stopped by SIGINT / SIGTERM after serving
EXIT_START_FAILED = 1  # Ray, Serve or the replica (workers, model) failed to start
EXIT_USAGE = 2  # refused before anything started: a missing package, a bad flag or config, a taken port

SERVE_EXTRA_MODULES = ("ray.serve", "starlette", "uvicorn", "safetensors")
"""What ``pip install 'ray-ep[serve]'`` (ray[serve], safetensors) brings and the server imports."""

def missing_serve_module() -> str | None:
    """The first module of the serve extra that cannot be imported, or None when all import:
    the missing package (``starlette`` for ``starlette.types``), else the module asked for."""
    import importlib

    for name in SERVE_EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing = getattr(e, "name", None) or name
            return missing if missing.startswith("ray.") else missing.split(".")[0]
    return None


def _command_started() -> tuple[float, str]:
    """(time.perf_counter() at the start of this process, its label); from /proc on Linux,
    else the import of this module (after Python and torch started)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age = float(Path("/proc/uptime").read_text().split()[0]) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        if 0 <= age < 24 * 3600:
            return time.perf_counter() - age, "after the command started"
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    return _IMPORTED, "after ray_ep.serving.server was imported"


_IMPORTED = time.perf_counter()


def _init_ray(address: str | None, num_cpus: int, level: int, timeout_s: float) -> bool:
    """Connect to ``address`` (within ``timeout_s``: init_timeout_s) or start a local Ray;
    True when it started one (ours to stop)."""
    if address:
        init_ray_bounded(address, timeout_s, logging_level=level)
        return False
    start_local_ray(num_cpus, logging_level=level)
    return True


def main(argv: list[str] | None = None) -> int:
    """``ray-ep serve``: start the server, print its address once ready, serve until SIGINT or
    SIGTERM. Returns the exit status (EXIT_OK, EXIT_START_FAILED, EXIT_USAGE)."""
    parser = argparse.ArgumentParser(prog="ray-ep serve", description=DESCRIPTION)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def run_from_args(args: argparse.Namespace) -> int:
    """:func:`main` after parsing: for a CLI whose ``serve`` subparser took
    :func:`add_arguments`."""
    t_command, since = _command_started()
    missing = missing_serve_module()
    if missing:  # before anything starts
        print(f"ray-ep serve: needs the serve extra (ray[serve], safetensors), missing module {missing!r}: "
              f"pip install 'ray-ep[serve]' (in a clone: pip install -e '.[serve]')", file=sys.stderr)
        return EXIT_USAGE
    try:
        options = options_from_args(args)  # validated before Ray starts; workers resolved below
    except (ValueError, OSError, ValidationError) as e:
        print(f"ray-ep serve: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not _port_free(options.host, options.port):
        print(f"ray-ep serve: {options.host}:{options.port} is in use; pick another --port", file=sys.stderr)
        return EXIT_USAGE

    import ray

    level = getattr(logging, options.log_level)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ray.serve").setLevel(level)  # the driver's Serve lines ("Started Serve", "is ready at")
    plain_console()

    owns_ray = False
    t_ray = time.perf_counter()
    if not ray.is_initialized():
        address = getattr(args, "address", None) or os.environ.get("RAY_ADDRESS")
        try:
            owns_ray = _init_ray(address, max(os.cpu_count() or 1, options.workers + 1), level,
                                 options.ep_config().init_timeout_s)
        except Exception as e:  # noqa: BLE001 - an address that does not answer: one line
            print(f"ray-ep serve: could not start: {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_START_FAILED
    t_ray = time.perf_counter() - t_ray
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if getattr(args, "workers", None) is None and gpus and not getattr(args, "cpu", False) \
            and "workers" not in _yaml_keys(args):
        options = options_from_args(args, gpus=gpus)
    stop = threading.Event()
    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    except ValueError:  # not the main thread: Ctrl-C still raises KeyboardInterrupt
        pass
    status = EXIT_OK
    try:
        t_serve = time.perf_counter()
        handle = start_server(options)
        info = handle.info.remote().result()
        now = time.perf_counter()
        url = f"http://{options.host}:{options.port}{options.route_prefix.rstrip('/')}"
        print(f"ray-ep serve: ready at {url} ({info['workers']} workers, backend {info['backend']}), "
              f"{now - t_command:.1f} s {since} (Ray {'start' if owns_ray else 'connect'} {t_ray:.1f} s; "
              f"Serve, workers and model {now - t_serve:.1f} s); routes: POST /v1/generate, GET /health, "
              f"GET /stats", flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    except Exception as e:  # noqa: BLE001 - a failed start: say why, exit non-zero
        print(f"ray-ep serve: could not start: {type(e).__name__}: {e}", file=sys.stderr)
        status = EXIT_START_FAILED
    finally:
        print("ray-ep serve: shutting down", flush=True)
        try:
            _shutdown(options.app_name, owns_ray)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if status == EXIT_OK:
        print("ray-ep serve: stopped", flush=True)
    return status


def _shutdown(app_name: str, owns_ray: bool) -> None:
    """Delete the app (its replica stops and shuts its EP workers down), then stop a Ray we
    started. Not serve.shutdown() before ray.shutdown(): the controller kills itself while
    the driver still calls it (graceful_shutdown, the handle's long poll, both retried
    forever), and Ray prints "(raylet) Task ServeController... failed. There are infinite
    retries remaining" for each; ray.shutdown() takes the controller and the proxy with the
    rest of our Ray."""
    import ray
    from ray import serve

    try:
        serve.delete(app_name)
    except Exception as e:  # noqa: BLE001 - nothing deployed (a failed start) or Serve gone
        if not owns_ray:
            print(f"ray-ep serve: could not delete the app {app_name!r}: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        if owns_ray:
            ray.shutdown()


def _yaml_keys(args: argparse.Namespace) -> set[str]:
    if not getattr(args, "config", None):
        return set()
    import yaml

    return set((yaml.safe_load(Path(args.config).read_text()) or {}).keys())


if __name__ == "__main__":
    sys.exit(main())
