"""The public Python API: :class:`EPCluster` starts one worker per rank and drives them.

Legend: R ranks, T_r tokens on rank r, H hidden size, K top-k, E experts.

>>> from ray_ep import EPCluster, EPConfig
>>> cfg = EPConfig.preset("tiny", gpus_per_node=2)
>>> with EPCluster(cfg) as ep:                                   # doctest: +SKIP
...     ep.load_experts(seed=0)
...     report = ep.check(num_tokens=16)
...     report.passed
True

Inputs and outputs of the phase calls are lists with one CPU tensor per rank; the tensors of a
layer stay on the workers' devices between phases. The driver validates every input before
any worker is called (once: the workers are told not to check again), so a bad input raises
and leaves the cluster usable.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import ray
import torch

from .actors.group import EPWorkerGroup
from .actors.worker import DispatchSummary, EPWorker
from .config import EPConfig, format_bytes, plan_buffers, plan_memory
from .errors import EPClusterError, EPInputError, EPStateError
from .inputs import ROUTINGS
from .local_cluster import init_ray_bounded, start_local_ray
from .reference import check_tolerance
from .routing import route
from .transport.nvshmem import nvshmem_env
from .validation import validate_moe_inputs, validate_per_rank, validate_router_logits
from .weights import ExpertWeights, check_expert_weights

log = logging.getLogger(__name__)

OUT_DTYPES = ("bf16", "fp32")  # output dtypes of combine() and forward()
RESTART_WAIT_S = 15.0  # restart(): longest wait for the killed workers' processes to be gone
HOST_MEMORY_USABLE = 0.9  # share of a host's available memory the memory check plans with (require_memory)


@dataclass(frozen=True)
class CheckReport:
    """Result of :meth:`EPCluster.check`: error of every rank's output against the reference."""

    max_abs_error: float
    max_rel_error: float
    per_rank_rel_error: list[float]
    tolerance: float
    backend: str
    rounds: int

    @property
    def passed(self) -> bool:
        return self.max_rel_error <= self.tolerance

    def table(self) -> str:
        rows = [f"{'rank':>4}  {'rel error':>10}"]
        rows += [f"{r:>4}  {e:>10.2e}" for r, e in enumerate(self.per_rank_rel_error)]
        verdict = "PASS" if self.passed else "FAIL"
        rows.append(f"max rel error {self.max_rel_error:.2e} (abs {self.max_abs_error:.2e}), "
                    f"tolerance {self.tolerance:.0e}, backend {self.backend}, {self.rounds} round(s): {verdict}")
        return "\n".join(rows)


def _check_out_dtype(out_dtype: str) -> None:
    # checked here: a worker would only raise (a KeyError) after dispatch and compute
    if out_dtype not in OUT_DTYPES:
        raise EPInputError(f"out_dtype must be one of {list(OUT_DTYPES)}, got {out_dtype!r}")


def _as_config(config: EPConfig | str | dict) -> EPConfig:
    if isinstance(config, EPConfig):
        return config
    if isinstance(config, dict):
        return EPConfig.from_dict(config)
    if isinstance(config, str):
        if config.endswith((".yaml", ".yml", ".json")) or os.path.exists(config):
            return EPConfig.from_file(config)
        return EPConfig.preset(config)
    raise TypeError(f"config must be an EPConfig, a preset name, a YAML/JSON path or a dict, "
                    f"got {type(config).__name__}")


class EPCluster:
    """An expert-parallel group of R workers on a Ray cluster, and the driver's handle on it.

    Args:
        config: an :class:`EPConfig`, a preset name, a YAML/JSON path or a dict of fields.
        address: Ray address to connect to ("auto" for an existing cluster); None starts a
            local Ray (the embedded default) unless one is already connected; with
            ``n_nodes > 1`` that local Ray has n_nodes raylets on this host, each owning its
            share of the GPUs (:mod:`ray_ep.local_cluster`), so one host plays a multi-node job.
        use_gpu: one GPU per worker; None decides from the cluster (GPUs for every rank).
        runtime_env: extra Ray runtime_env for the workers (env vars are merged with the
            ones NVSHMEM/NCCL need: NVLink multicast stays off).
        num_cpus_per_worker: CPU slots per worker (default 1 with GPUs, 0.5 without).
        placement_strategy: see :class:`~ray_ep.actors.group.EPWorkerGroup`.
        auto_restart: rebuild a failed group (a dead rank, a call past its timeout, a silent peer,
            a broken collective) at the next call, as :meth:`restart` does; the call that saw
            the failure still raises (its data is lost). False: every call raises EPStateError
            until :meth:`restart` (or shutdown() and start()).
        check_memory: before allocating (start: symmetric buffers; load_experts: weights and
            scratch; check: the reference's world weights), compare the plan
            (:func:`~ray_ep.config.plan_memory`) with the memory the workers' GPUs and hosts
            have free, and raise EPClusterError naming both when it does not fit. False tries
            anyway.
    """

    def __init__(self, config: EPConfig | str | dict, *, address: str | None = None, use_gpu: bool | None = None,
                 runtime_env: dict | None = None, num_cpus_per_worker: float | None = None,
                 placement_strategy: str | None = None, check_memory: bool = True, auto_restart: bool = False):
        self.config = _as_config(config)
        self._address = address
        self._use_gpu = use_gpu
        self._runtime_env = runtime_env or {}
        self._num_cpus = num_cpus_per_worker
        self._strategy = placement_strategy
        self._group: EPWorkerGroup | None = None
        self._owns_ray = False
        self._local_cluster = None
        self._phase: str | None = None
        self.backend: str | None = None
        self._layers_loaded: set[int] = set()
        # what load_experts loaded, per layer (the last load wins): replayed by restart()
        self._expert_loads: dict[int, tuple[ExpertWeights | None, int]] = {}
        self.auto_restart = auto_restart
        self._started = False  # start() succeeded and no shutdown() since (a failed restart leaves no group)
        self.restarts = 0
        """How many times the group was rebuilt (:meth:`restart`, or ``auto_restart``)."""
        self._check_memory = check_memory
        self._use_gpu_resolved = False  # what start() decided

    @property
    def use_gpu(self) -> bool:
        """Whether the workers hold GPUs (what :meth:`start` decided; False before it)."""
        return self._use_gpu_resolved

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> "EPCluster":
        """Start Ray if needed, the workers, the rendezvous and the backend."""
        if self._group is not None:
            raise EPStateError("the cluster is already started")
        cfg = self.config
        if not ray.is_initialized() and self._address is None and cfg.n_nodes > 1:
            self._start_local_cluster()
        elif not ray.is_initialized():
            if self._address is None:
                # a fresh local Ray, quiet; logical CPU slots for every worker even on a 2-core laptop
                start_local_ray(max(os.cpu_count() or 1, cfg.world_size))
            else:
                init_ray_bounded(self._address, cfg.init_timeout_s)
            self._owns_ray = True
        try:
            self._start_group()
        except BaseException:
            self._teardown()
            raise
        self._started = True
        return self

    def _start_group(self) -> None:
        """The workers, their rendezvous (a new port) and backend (a new NVSHMEM unique id) on
        the connected Ray; a failure kills what was started and raises."""
        cfg = self.config
        gpus = ray.cluster_resources().get("GPU", 0)
        use_gpu = self._use_gpu if self._use_gpu is not None else gpus >= cfg.world_size
        backend = cfg.backend
        if backend == "auto":
            backend = "nvshmem" if use_gpu else "torch"
        if backend == "nvshmem" and not use_gpu:
            raise EPStateError(f"backend 'nvshmem' needs one GPU per rank ({cfg.world_size}); the cluster has "
                               f"{gpus:g} GPUs. Use backend='torch' (CPU workers) or add GPUs")
        env = dict(self._runtime_env)
        # TORCH_CPP_LOG_LEVEL: torch's C++ warnings (c10d's "hostname of the client socket cannot be
        # retrieved" on every start in containers) stay out of the driver's console; yours wins
        # NVSHMEM's options (nvshmem_env) from the start: its first call in a worker reads them
        env["env_vars"] = {**nvshmem_env(cfg.n_nodes), "TORCH_CPP_LOG_LEVEL": "ERROR", **env.get("env_vars", {})}
        self._use_gpu_resolved = use_gpu
        num_cpus = self._num_cpus if self._num_cpus is not None else (1.0 if use_gpu else 0.5)
        group = EPWorkerGroup(EPWorker, cfg, use_gpu=use_gpu, runtime_env=env, num_cpus_per_worker=num_cpus,
                              placement_strategy=self._strategy)
        self._group = group
        try:
            group.start()
            self.require_memory(cfg, what="the symmetric buffers", symmetric=True)
            addr, port = group.execute_single(0, "rendezvous_address")
            # the workers' communicators resolve backend 'auto' from their devices as the driver did
            group.execute("start_communicator", cfg, addr, port, call_timeout_s=cfg.init_timeout_s)
        except BaseException:
            group.shutdown()
            self._group = None
            raise
        self.backend = backend
        self._phase = None
        log.info("ray_ep: %d workers up, backend %s", cfg.world_size, backend)

    def restart(self) -> "EPCluster":
        """Rebuild the group in place: kill every worker (a failed group cannot be patched:
        NVSHMEM state, epochs and process groups are shared by all ranks), start new ones with
        the same config on the same Ray (a new rendezvous and NVSHMEM unique id), and load
        every expert layer again from what :meth:`load_experts` was given (the same seed, or
        the same ExpertWeights). State installed through :meth:`run` (``worker.state``) is
        not replayed: install it again. Works on a healthy group too.

        Raises what :meth:`start` raises when the new group cannot start (the cluster is then
        not running: call restart() again or start())."""
        if not self._started:
            raise EPStateError("the cluster is not running: call start() (or use `with EPCluster(...)`) first")
        if not ray.is_initialized():
            raise EPStateError("Ray is gone (shut down or the driver lost it): call shutdown(), then start()")
        failure = self.failure
        t0 = time.perf_counter()
        if self._group is not None:
            # kills (no collective on a group that may be out of step) and waits for the processes
            # to go: the new workers need their GPU memory
            self._group.shutdown(wait_s=RESTART_WAIT_S)
            self._group = None
        self._phase = None
        self._layers_loaded.clear()
        self._start_group()
        loads = list(self._expert_loads.items())
        for layer, (weights, seed) in loads:
            self.load_experts(weights, seed=seed, layer=layer)
        self.restarts += 1
        log.warning("ray_ep: group rebuilt in %.1f s (%d expert layer(s) reloaded)%s", time.perf_counter() - t0,
                    len(loads), f" after: {failure}" if failure else "")
        return self

    def _start_local_cluster(self) -> None:
        import torch

        from .local_cluster import LocalCluster

        cfg = self.config
        use_gpu = self._use_gpu if self._use_gpu is not None else torch.cuda.device_count() >= cfg.world_size
        # the default (2 slots per rank) holds the workers; more only if the user asked for more
        cpus = self._num_cpus * cfg.gpus_per_node + 1 if self._num_cpus else None
        self._local_cluster = LocalCluster(cfg.n_nodes, cfg.gpus_per_node, use_gpu=use_gpu,
                                           num_cpus_per_node=cpus).start()
        try:
            ray.init(address=self._local_cluster.address)
        except BaseException:
            self._local_cluster.shutdown()
            self._local_cluster = None
            raise
        self._owns_ray = True

    def shutdown(self, timeout_s: float = 60.0, kill: bool = False) -> None:
        """Free every worker's buffers, stop the workers; idempotent. Stops Ray if it started it.

        A clean shutdown (collective: every rank frees its symmetric memory) gets ``timeout_s``;
        ``kill=True`` (or a clean shutdown that fails, times out or is interrupted) kills the
        workers instead."""
        try:
            if not kill and self._group is not None and self._group.alive:
                try:
                    self._group.execute("shutdown", call_timeout_s=timeout_s)
                except Exception as e:  # a dead worker: still kill everything
                    log.warning("ray_ep: clean worker shutdown failed (%s); killing the workers", e)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        if self._group is not None:
            self._group.shutdown()
            self._group = None
        self._phase = None
        self._expert_loads.clear()
        self._layers_loaded.clear()
        self._started = False
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
        if self._local_cluster is not None:
            self._local_cluster.shutdown()
            self._local_cluster = None

    def __enter__(self) -> "EPCluster":
        return self.start() if self._group is None else self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.shutdown(kill=exc_type is KeyboardInterrupt)  # interrupted: stop now, no collective

    def _need_group(self, restart: bool = True) -> EPWorkerGroup:
        """The running group; with ``auto_restart`` (and ``restart``) a failed one is rebuilt first."""
        if self._group is None:
            if restart and self.auto_restart and self._started and ray.is_initialized():
                self.restart()  # a previous restart failed half-way: try again
            else:
                raise EPStateError("the cluster is not running: call start() (or use `with EPCluster(...)`) first")
        elif restart and self.auto_restart and not self._group.alive:
            log.warning("ray_ep: auto_restart: rebuilding the failed group (%s)", self._group.failure)
            self.restart()
        return self._group

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def actors(self) -> list:
        """The workers' Ray actor handles in rank order (advanced: health probes, fault tests)."""
        return list(self._need_group(restart=False).actors)

    def info(self) -> list[dict]:
        """One dict per rank: device, GPU name and SMs, node, whether nvshmem4py is there."""
        return self._need_group().execute("device_info")

    def health(self) -> list[bool]:
        """Whether each rank can serve: it answers a ping and the group has not failed (a dead
        rank, a call past its timeout, a silent peer or a broken collective leave the ranks out
        of step: then every rank reports False until the group is rebuilt)."""
        group = self._need_group(restart=False)
        ok = group.health()
        return ok if group.alive else [False] * len(ok)

    @property
    def alive(self) -> bool:
        """Started, and the group has not failed (no remote call: see :meth:`health`)."""
        return self._group is not None and self._group.alive

    @property
    def failure(self) -> str | None:
        """Why the group failed and must be rebuilt (see :meth:`health`), else None."""
        return self._group.failure if self._group is not None else None

    def mark_failed(self, reason: str) -> None:
        """Declare the group failed (e.g. a health check found a rank that stopped answering):
        a call waiting on it from another thread stops within 0.5 s with EPTimeoutError instead of
        waiting out call_timeout_s, and the group reports ``failure`` until :meth:`restart`."""
        if self._group is not None:
            self._group.mark_failed(reason)

    def buffer_plan(self):
        return plan_buffers(self.config)

    # ---- experts -----------------------------------------------------------------------------
    def load_experts(self, weights: ExpertWeights | None = None, seed: int = 0, layer: int = 0) -> None:
        """Experts of MoE layer ``layer``: seeded random (each worker builds its own slice), or
        the given world weights (sharded here: rank r gets routed experts [r * L, (r + 1) * L)
        and every shared expert). Weights may be bf16 (fp16 / fp32) or fp8 e4m3 with one fp32
        scale per 128 x 128 block (:func:`ray_ep.load_deepseek_experts` reads a DeepSeek-V3
        checkpoint); the workers convert them to ``EPConfig.expert_dtype``. Bad weights (shape,
        dtype, block scales of the wrong shape or not finite and positive, NaN in fp8 values,
        fp8 with H or F not a multiple of 128) raise EPInputError here, before any worker sees
        them. The cluster keeps the seed, or a reference to ``weights``, for :meth:`restart`."""
        g = self._need_group()
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise EPInputError(f"layer must be an int >= 0 (negative slots are ray_ep's own), got {layer!r}")
        if layer not in self._layers_loaded:
            self.require_memory(self.config, what=f"expert layer {layer}", layers=1,
                                scratch=not self._layers_loaded)
        if weights is None:
            g.execute("load_experts", seed=seed, layer=layer)
        else:
            if not isinstance(weights, ExpertWeights):
                raise EPInputError(f"weights must be an ExpertWeights, got {type(weights).__name__}")
            check_expert_weights(self.config, weights)  # before anything is shipped
            L = self.config.experts_per_rank
            per_rank = [{"layer": layer, "weights": weights.local(r, L)} for r in range(self.world_size)]
            g.execute_per_rank("load_experts", [(None,)] * self.world_size, per_rank)
        self._layers_loaded.add(layer)
        self._expert_loads.pop(layer, None)  # replayed in the order of the last loads
        self._expert_loads[layer] = (weights, seed)

    def require_memory(self, cfg: EPConfig, *, what: str, symmetric: bool = False, layers: int = 0,
                       scratch: bool = False, reference: bool = False) -> None:
        """Raise EPClusterError unless every rank's GPU (or host, for CPU workers) and every
        host has the free memory that ``cfg``'s plan asks for (:class:`~ray_ep.config.MemoryPlan`):
        symmetric buffers, ``layers`` expert layers, the expert scratch, and ``reference`` the
        host copy of the whole world's weights that :meth:`check` builds. A no-op with
        ``check_memory=False``."""
        if not self._check_memory:
            return
        plan = plan_memory(cfg)
        # CPU workers allocate the expert scratch by the rows that arrive (ExpertScratch), not at capacity
        need = layers * plan.experts_per_layer + (plan.scratch if scratch and self._use_gpu_resolved else 0)
        need += plan.symmetric + plan.workspace if symmetric else 0
        on_gpu = self._use_gpu_resolved
        device_need = need if on_gpu else 0
        host_need = (0 if on_gpu else need) + (plan.host_build if on_gpu and layers else 0)
        host_need += plan.check_reference if reference else 0
        free = self._need_group().execute("free_memory")
        short = []
        for f in free:
            if f["device"] is not None and device_need > f["device"]:
                short.append(f"rank {f['rank']} needs {format_bytes(device_need)} on its GPU, "
                             f"{format_bytes(f['device'])} is free")
        per_node: dict[str, list[dict]] = {}
        for f in free:
            per_node.setdefault(f["node_id"], []).append(f)
        for ranks in per_node.values():
            total = host_need * len(ranks)
            # 90% of what is available: Ray's memory monitor kills workers once the node passes
            # 95% use, and the workers' own Python and torch take a share (deepseek-v3's 2 x 11.4 GB
            # of experts passed against 22.9 GB available on a 24 GB host, then Ray killed a worker)
            avail = int(HOST_MEMORY_USABLE * min(f["host"] for f in ranks))
            if total > avail:
                short.append(f"ranks {[f['rank'] for f in ranks]} need {format_bytes(total)} of host memory "
                             f"({format_bytes(host_need)} each), {format_bytes(avail)} is usable "
                             f"({HOST_MEMORY_USABLE:.0%} of what is available)")
        if short:
            raise EPClusterError(
                f"not enough memory for {what}: " + "; ".join(short) + ". Use a smaller preset or "
                "max_tokens_per_rank, fewer ranks per host, or GPUs (`ray-ep plan` shows the plan); "
                "check_memory=False (CLI: --no-memory-check) tries anyway")

    def call_workers(self, method: str, *args: Any, call_timeout_s: float | None = None, **kwargs: Any) -> list:
        """Advanced: call an :class:`~ray_ep.actors.worker.EPWorker` method on every rank
        (e.g. ``add_group``, ``bench``); results in rank order."""
        self._phase = None
        return self._need_group().execute(method, *args, call_timeout_s=call_timeout_s, **kwargs)

    def run(self, fn, *args: Any, args_per_rank: Sequence[tuple] | None = None, **kwargs: Any) -> list:
        """Run ``fn(worker, *args, **kwargs)`` inside every worker (per-rank positional args
        with ``args_per_rank``); results in rank order.

        ``worker`` is the rank's :class:`~ray_ep.actors.worker.EPWorker`: ``worker.rank``,
        ``worker.device``, ``worker.config``, ``worker.state`` (a dict kept between calls) and
        ``worker.moe(x, topk_ids, topk_weights, layer=i)``, a collective MoE layer returning the
        output on the device. This is how a whole model runs inside the actors (serving)."""
        g = self._need_group()
        self._phase = None
        if args_per_rank is None:
            return g.execute("run", fn, *args, **kwargs)
        if len(args_per_rank) != self.world_size:
            raise EPInputError(f"args_per_rank needs one tuple per rank ({self.world_size})")
        return g.execute_per_rank("run", [(fn, *a) for a in args_per_rank], [kwargs] * self.world_size)

    # ---- phases ------------------------------------------------------------------------------
    def _validate(self, xs: Sequence[torch.Tensor], topk_ids: Sequence[torch.Tensor],
                  topk_weights: Sequence[torch.Tensor]) -> None:
        validate_per_rank(self.world_size, xs=xs, topk_ids=topk_ids, topk_weights=topk_weights)
        for r in range(self.world_size):
            validate_moe_inputs(self.config, xs[r], topk_ids[r], topk_weights[r], rank=r)

    def dispatch(self, xs: Sequence[torch.Tensor], topk_ids: Sequence[torch.Tensor],
                 topk_weights: Sequence[torch.Tensor], fused: bool = True) -> list[DispatchSummary]:
        """Dispatch every rank's tokens.

        Args: per rank r, ``xs[r]`` [T_r, H] bf16 (fp16/fp32 accepted), ``topk_ids[r]``
        [T_r, K] int32 global expert ids (-1 = unused slot), ``topk_weights[r]`` [T_r, K] fp32.
        Returns per rank the rows received per local expert and per source rank.
        """
        g = self._need_group()
        self._validate(xs, topk_ids, topk_weights)
        self._phase = None
        out = g.execute_per_rank("dispatch", [(x, i, w) for x, i, w in zip(xs, topk_ids, topk_weights)],
                                 [{"fused": fused, "validate": False}] * self.world_size)
        self._phase = "dispatched"
        return out

    def dispatch_send(self, xs, topk_ids, topk_weights) -> None:
        """Split dispatch, first half (returns once every rank queued its sends)."""
        g = self._need_group()
        self._validate(xs, topk_ids, topk_weights)
        self._phase = None
        g.execute_per_rank("dispatch_send", [(x, i, w) for x, i, w in zip(xs, topk_ids, topk_weights)],
                           [{"validate": False}] * self.world_size)
        self._phase = "sent"

    def dispatch_recv(self) -> list[DispatchSummary]:
        """Split dispatch, second half."""
        self._expect("sent", "dispatch_recv", "dispatch_send")
        out = self._need_group().execute("dispatch_recv")
        self._phase = "dispatched"
        return out

    def dispatched(self, rank: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s received rows, expert-major (fp32, dequantised), with row_offsets
        [L + 1] and num_tokens [L]."""
        if self._phase not in ("dispatched", "computed"):
            raise EPStateError("dispatched() needs a completed dispatch")
        return self._need_group().execute_single(rank, "dispatched")

    def compute(self, layer: int = 0) -> None:
        """Every rank runs its experts (of MoE layer ``layer``) over what it received."""
        self._expect("dispatched", "compute", "dispatch")
        if layer not in self._layers_loaded:
            raise EPStateError(f"no experts loaded for layer {layer}: call load_experts(layer={layer}) first")
        self._need_group().execute("compute", layer=layer)
        self._phase = "computed"

    def combine(self, fused: bool = True, out_dtype: str = "bf16") -> list[torch.Tensor]:
        """Return expert outputs to their tokens; per rank out [T_r, H] (shared experts added)."""
        _check_out_dtype(out_dtype)
        self._expect("computed", "combine", "compute")
        out = self._need_group().execute("combine", fused=fused, out_dtype=out_dtype)
        self._phase = None
        return out

    def _expect(self, phase: str, call: str, before: str) -> None:
        self._need_group()
        if self._phase != phase:
            raise EPStateError(f"{call}() must follow {before}() (current phase: {self._phase or 'none'})")

    def forward(self, xs: Sequence[torch.Tensor], topk_ids: Sequence[torch.Tensor] | None = None,
                topk_weights: Sequence[torch.Tensor] | None = None,
                router_logits: Sequence[torch.Tensor] | None = None, fused: bool = True,
                out_dtype: str = "bf16", layer: int = 0, micro_batches: int | None = None,
                cuda_graph: bool = False) -> list[torch.Tensor]:
        """A whole MoE layer on every rank. Give topk ids and weights, or router logits
        ([T_r, E] per rank, softmax top-k with renormalised weights). ``micro_batches`` (default:
        the config's) > 1 overlaps the micro-batches' communication with their experts;
        ``cuda_graph`` (GPU workers) replays the layer from CUDA graphs captured per token bucket."""
        g = self._need_group()
        _check_out_dtype(out_dtype)
        if cuda_graph and self.backend != "nvshmem":
            raise EPInputError(f"cuda_graph replays the GPU kernels: it needs GPU workers (backend nvshmem), this "
                               f"cluster runs backend {self.backend!r}")
        if micro_batches is not None and (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                                          or not 1 <= micro_batches <= 8):
            raise EPInputError(f"micro_batches must be an int from 1 to 8 (or None for the config's "
                               f"{self.config.micro_batches}), got {micro_batches!r}")
        if router_logits is not None:
            if topk_ids is not None or topk_weights is not None:
                raise EPInputError("give either router_logits or topk_ids + topk_weights, not both")
            validate_per_rank(self.world_size, xs=xs, router_logits=router_logits)
            for r, (x, lg) in enumerate(zip(xs, router_logits)):
                validate_router_logits(self.config, x, lg, rank=r)
            routed = [route(lg, self.config.top_k) for lg in router_logits]
            topk_ids, topk_weights = [r[0] for r in routed], [r[1] for r in routed]
        if topk_ids is None or topk_weights is None:
            raise EPInputError("forward needs topk_ids and topk_weights (or router_logits)")
        if layer not in self._layers_loaded:
            raise EPStateError(f"no experts loaded for layer {layer}: call load_experts(layer={layer}) first")
        self._validate(xs, topk_ids, topk_weights)
        self._phase = None
        return g.execute_per_rank("forward", [(x, i, w) for x, i, w in zip(xs, topk_ids, topk_weights)],
                                  [{"fused": fused, "out_dtype": out_dtype, "layer": layer, "validate": False,
                                    "micro_batches": micro_batches, "cuda_graph": bool(cuda_graph)}]
                                  * self.world_size)

    # ---- checks ------------------------------------------------------------------------------
    def check(self, num_tokens: int | Sequence[int] | None = None, seed: int = 0, routing: str = "uniform",
              rounds: int = 1, fused: bool = True, expert_seed: int = 0) -> CheckReport:
        """Run ``rounds`` layers on fresh seeded inputs and compare every rank's output with
        :func:`ray_ep.reference.moe_forward` (the oracle). Every worker rebuilds the whole world's inputs
        and seeded experts from the seeds and checks its own part (nothing large crosses the
        driver); the user's expert layers stay untouched."""
        cfg = self.config
        g = self._need_group()
        n = cfg.max_tokens_per_rank if num_tokens is None else num_tokens
        counts = [n] * self.world_size if isinstance(n, int) else list(n)
        if len(counts) != self.world_size or not all(isinstance(c, int) and 0 <= c <= cfg.max_tokens_per_rank
                                                     for c in counts):
            raise EPInputError(f"num_tokens must be an int or one int per rank ({self.world_size}), each in "
                               f"0..max_tokens_per_rank = {cfg.max_tokens_per_rank}, got {num_tokens!r}")
        if not any(counts):
            raise EPInputError("num_tokens are 0 on every rank: the check would compare nothing; give at least 1")
        if routing not in ROUTINGS:
            raise EPInputError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        if rounds < 1:
            raise EPInputError(f"rounds must be at least 1, got {rounds}")
        self.require_memory(cfg, what="check (its expert layer and the reference's world weights)", layers=1,
                            scratch=not self._layers_loaded, reference=True)
        results = g.execute("check", num_tokens=n, seed=seed, routing=routing, rounds=rounds,
                                             fused=fused, expert_seed=expert_seed)
        self._phase = None
        per_rank = [r["rel"] for r in results]
        max_abs = max(r["max_abs"] for r in results)
        return CheckReport(max_abs, max(per_rank), per_rank, check_tolerance(cfg), self.backend or "?", rounds)
