"""EPWorker: one rank of the expert-parallel group, living in a Ray actor.

It owns its device, its transports and its experts. The driver calls it phase by phase
(``dispatch`` -> ``compute`` -> ``combine``) or for whole layers (``forward``); per-layer
tensors stay on the worker's device between phases.

Every rank always joins a torch.distributed group (gloo on CPU, NCCL on GPU): it is the
``torch`` backend, the NCCL baseline of the benchmarks, and a host barrier. With the
``nvshmem`` backend the worker also bootstraps NVSHMEM and runs the Triton kernels.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass, field, replace

import torch

from .. import reference
from ..config import EPConfig
from ..errors import EPInputError, EPStateError
from ..inputs import make_inputs
from ..kernels.experts import ExpertScratch, LocalExperts, run_experts, shared_experts
from ..transport.base import Transport
from ..transport.nvshmem import NO_MULTICAST_ENV
from ..types import DispatchHandle
from ..validation import validate_moe_inputs
from ..weights import ExpertWeights, init_expert_weights
from .group import WorkerContext

log = logging.getLogger(__name__)

CHECK_LAYER = -1  # the expert-layer slot that check() loads its seeded experts into



@dataclass(frozen=True)
class DispatchSummary:
    """What the driver learns from a dispatch (one host sync, debugging path only)."""

    rank: int
    tokens_per_expert: list[int]
    rows_from_rank: list[int]


def host_available_bytes() -> int:
    """Memory the host can still give (Linux MemAvailable; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class PhaseStats:
    """Wall time per phase of :meth:`EPWorker.moe` and tokens per local expert.

    Off by default (timing a phase synchronises the device); :meth:`EPWorker.set_profiling`
    turns it on. Token counts accumulate on the device without a sync.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = False
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.tokens = 0
        self.expert_tokens: torch.Tensor | None = None

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            self.calls[name] = self.calls.get(name, 0) + 1

    def count_tokens(self, num_tokens_L: torch.Tensor, num_local_tokens: int) -> None:
        if not self.enabled:
            return
        self.tokens += num_local_tokens
        n = num_tokens_L.to(torch.int64)
        self.expert_tokens = n.clone() if self.expert_tokens is None else self.expert_tokens + n

    def snapshot(self) -> dict:
        return {"seconds": dict(self.seconds), "calls": dict(self.calls), "tokens": self.tokens,
                "expert_tokens": [] if self.expert_tokens is None else self.expert_tokens.tolist()}


class EPWorker:
    """One rank. Constructed by :class:`~ray_ep.actors.group.EPWorkerGroup` with its context."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.rank = ctx.rank
        for k, v in NO_MULTICAST_ENV.items():  # before any GPU library starts
            os.environ.setdefault(k, v)
        if ctx.use_gpu:
            if not torch.cuda.is_available():
                raise EPStateError(f"rank {ctx.rank}: Ray granted a GPU but torch sees none "
                                   f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            # several workers share a CPU: one thread each avoids oversubscription
            torch.set_num_threads(max(1, int(os.environ.get("RAY_EP_CPU_THREADS", "1"))))
        self.groups: dict[str, EPGroupState] = {}  # "main" plus any extra configs (benchmarks)
        self.backend: str | None = None
        self._nvshmem = False
        self.state: dict = {}  # user state of code run through :meth:`run` (model weights, caches)
        self.stats = PhaseStats(self.device)
        self._handle: DispatchHandle | None = None
        self._pending = None
        self._y: torch.Tensor | None = None
        self._x: torch.Tensor | None = None
        self._layer = 0
        self._ref_weights: tuple = (None, None)

    @property
    def config(self) -> EPConfig:
        return self._cfg()

    # ---- set-up ------------------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """An address and free port on this node for the torch.distributed rendezvous."""
        return self.ctx.node_ip, free_port()

    def make_nvshmem_uid(self) -> bytes:
        """NVSHMEM unique id (rank 0); this process hosts the bootstrap root."""
        from ..transport.nvshmem import make_unique_id

        return make_unique_id()

    def device_info(self) -> dict:
        info = {"rank": self.rank, "device": str(self.device), "node_id": self.ctx.node_id,
                "local_rank": self.ctx.local_rank, "node_rank": self.ctx.node_rank}
        if self.device.type == "cuda":
            p = torch.cuda.get_device_properties(self.device)
            info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
        try:
            import nvshmem  # noqa: F401

            info["nvshmem4py"] = True
        except ImportError:
            info["nvshmem4py"] = False
        return info

    def free_memory(self) -> dict:
        """Bytes free now: on this rank's GPU (None on CPU workers) and on its host
        (MemAvailable: what the host can give without swapping)."""
        device = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        return {"rank": self.rank, "node_id": self.ctx.node_id, "device": device, "host": host_available_bytes()}

    def init_torch(self, cfg: EPConfig, master_addr: str, master_port: int) -> None:
        """Join the torch.distributed group (collective: every rank at once)."""
        from ..transport.torch_dist import TorchTransport

        self.ctx = replace(self.ctx, master_addr=master_addr, master_port=master_port)
        main = EPGroupState(cfg)
        main.transports["torch"] = TorchTransport(cfg, self.rank, self.device, f"tcp://{master_addr}:{master_port}")
        self.groups["main"] = main
        self.backend = "torch"

    def init_nvshmem(self, unique_id: bytes) -> None:
        """Bootstrap NVSHMEM and allocate the main group's symmetric buffers (collective)."""
        from ..transport import nvshmem

        if self.device.type != "cuda":
            raise EPStateError(f"rank {self.rank}: the nvshmem backend needs a GPU; use backend='torch'")
        cfg = self._cfg()
        nvshmem.runtime_init(self.rank, cfg.world_size, self.device, unique_id, n_nodes=cfg.n_nodes)
        self._nvshmem = True
        self.groups["main"].transports["nvshmem"] = nvshmem.NvshmemTransport(cfg, self.rank, self.device)
        self.backend = "nvshmem"

    def add_group(self, name: str, cfg: EPConfig) -> None:
        """Transports for another config on the same ranks (collective: same order everywhere).
        Benchmarks use this to run several presets and dtypes without restarting."""
        from ..transport.torch_dist import TorchTransport

        main = self._cfg()
        if cfg.world_size != main.world_size or cfg.n_nodes != main.n_nodes:
            raise EPInputError(f"group {name!r} must keep the topology {main.n_nodes}x{main.gpus_per_node}")
        if name in self.groups:
            raise EPStateError(f"group {name!r} exists already")
        g = EPGroupState(cfg)
        g.transports["torch"] = TorchTransport(cfg, self.rank, self.device)
        if self._nvshmem:
            from ..transport.nvshmem import NvshmemTransport

            g.transports["nvshmem"] = NvshmemTransport(cfg, self.rank, self.device)
        self.groups[name] = g

    def drop_group(self, name: str) -> None:
        """Free an extra group's buffers (collective)."""
        if name == "main":
            raise EPInputError("the main group lives until shutdown")
        g = self.groups.pop(name, None)
        if g is not None:
            g.close()

    def load_experts(self, seed: int | None = 0, weights: ExpertWeights | None = None,
                     layer: int = 0, group: str = "main", draw_on_device: bool = False) -> int:
        """Experts of MoE layer ``layer``: seeded random (this rank's slice of the world's), or
        given :class:`ExpertWeights` already sharded to this rank (L routed experts; bf16 or
        fp8 with block scales, converted to the config's ``expert_dtype``). Returns the bytes
        loaded."""
        g = self.group_state(group)
        cfg = g.cfg
        if weights is None:
            weights = init_expert_weights(cfg, seed=seed, experts=self._local_expert_ids(cfg), device=self.device,
                                          draw_on_device=draw_on_device)
        experts = LocalExperts.build(cfg, weights, self.device)
        experts.check(cfg)
        g.experts[layer] = experts
        if g.scratch is None:
            g.scratch = ExpertScratch.allocate(cfg, self.device)
        return sum(t.numel() * t.element_size() for t in vars(experts).values() if t is not None)

    def _local_expert_ids(self, cfg: EPConfig) -> range:
        L = cfg.experts_per_rank
        return range(self.rank * L, (self.rank + 1) * L)

    def group_state(self, name: str = "main") -> "EPGroupState":
        """The transports, experts and scratch of a config on this rank ("main", or a name
        given to :meth:`add_group`)."""
        if name not in self.groups:
            if name == "main":
                raise EPStateError(f"rank {self.rank}: not initialised; start the cluster first")
            raise EPStateError(f"rank {self.rank}: no group {name!r} (have {sorted(self.groups)})")
        return self.groups[name]

    def _cfg(self) -> EPConfig:
        return self.group_state().cfg

    def transport(self, backend: str | None = None, group: str = "main") -> Transport:
        """This rank's end of ``backend`` (default: the cluster's) for ``group``: the object whose
        dispatch / combine code run through :meth:`run` (benchmarks, custom loops) calls."""
        g = self.group_state(group)
        name = backend or self.backend
        if name not in g.transports:
            raise EPStateError(f"rank {self.rank}: backend {name!r} is not initialised here "
                               f"(have {sorted(g.transports)})")
        return g.transports[name]

    def _inputs(self, x_TH, topk_ids_TK, topk_weights_TK, validate: bool = True, group: str = "main"):
        cfg = self.group_state(group).cfg
        if validate:
            validate_moe_inputs(cfg, x_TH, topk_ids_TK, topk_weights_TK, self.rank)
        x = x_TH.to(self.device)
        if cfg.dispatch_dtype == "bf16":
            x = x.to(torch.bfloat16)
        return (x.contiguous(), topk_ids_TK.to(self.device, torch.int32).contiguous(),
                topk_weights_TK.to(self.device, torch.float32).contiguous())

    # ---- phases (debugging and jobs) -----------------------------------------------------------
    def dispatch(self, x_TH, topk_ids_TK, topk_weights_TK, fused: bool = True, backend: str | None = None,
                 validate: bool = True) -> DispatchSummary:
        """Dispatch this rank's tokens; keeps the handle for :meth:`compute` and :meth:`combine`.
        ``validate=False``: the caller (the driver) has checked the inputs already."""
        t = self.transport(backend)
        x, ids, w = self._inputs(x_TH, topk_ids_TK, topk_weights_TK, validate=validate)
        self._x, self._y = x, None
        self._handle = t.dispatch(x, ids, w, fused=fused)
        r = self._handle.recv
        return DispatchSummary(self.rank, r.num_tokens_L.tolist(), r.recv_counts_R.tolist())

    def dispatch_send(self, x_TH, topk_ids_TK, topk_weights_TK, backend: str | None = None,
                      validate: bool = True) -> None:
        """Split form, first half: returns once the sends are queued."""
        t = self.transport(backend)
        x, ids, w = self._inputs(x_TH, topk_ids_TK, topk_weights_TK, validate=validate)
        self._x, self._y, self._handle = x, None, None
        self._pending = (t, t.dispatch_send(x, ids, w))

    def dispatch_recv(self) -> DispatchSummary:
        if self._pending is None:
            raise EPStateError(f"rank {self.rank}: dispatch_recv without dispatch_send")
        t, pending = self._pending
        self._pending = None
        self._handle = t.dispatch_recv(pending)
        r = self._handle.recv
        return DispatchSummary(self.rank, r.num_tokens_L.tolist(), r.recv_counts_R.tolist())

    def dispatched(self) -> dict[str, torch.Tensor]:
        """The expert-major rows this rank received (materialised, on CPU) and their layout."""
        h = self._need_handle("dispatched")
        r = h.recv
        rows = h.expert_major_rows(int(r.row_offsets_L1[-1]))
        return {"x": rows.cpu(), "row_offsets": r.row_offsets_L1.cpu(), "num_tokens": r.num_tokens_L.cpu()}

    def _need_handle(self, what: str) -> DispatchHandle:
        if self._handle is None:
            raise EPStateError(f"rank {self.rank}: {what} needs a completed dispatch first")
        return self._handle

    def _experts_of(self, layer: int, group: str = "main") -> LocalExperts:
        g = self.group_state(group)
        if layer not in g.experts:
            raise EPStateError(f"rank {self.rank}: no experts loaded for layer {layer}; call load_experts first")
        return g.experts[layer]

    def compute(self, layer: int = 0) -> None:
        """Run this rank's experts (of MoE layer ``layer``) over the last dispatch."""
        h = self._need_handle("compute")
        self._layer = layer
        self._y = run_experts(handle=h, experts=self._experts_of(layer), scratch=self.group_state().scratch)

    def combine(self, fused: bool = True, backend: str | None = None, out_dtype: str = "bf16") -> torch.Tensor:
        """Return expert outputs to their tokens; out [T, H] on CPU (shared experts included)."""
        out = self._combine(fused, backend, out_dtype)
        return out.cpu()

    def _combine(self, fused: bool, backend: str | None, out_dtype: str) -> torch.Tensor:
        h = self._need_handle("combine")
        if self._y is None:
            raise EPStateError(f"rank {self.rank}: combine needs compute() after dispatch")
        t = self.transport(backend)
        add = shared_experts(self._x, self._experts_of(self._layer))
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[out_dtype]
        out = t.combine(self._y, h, dt, add, fused=fused)
        self._handle, self._y = None, None
        return out

    def forward(self, x_TH, topk_ids_TK, topk_weights_TK, fused: bool = True, backend: str | None = None,
                out_dtype: str = "bf16", layer: int = 0, validate: bool = True) -> torch.Tensor:
        """One whole MoE layer on this rank's tokens; out [T, H] on CPU."""
        out = self.moe(x_TH, topk_ids_TK, topk_weights_TK, fused=fused, backend=backend,
                       out_dtype=out_dtype, layer=layer, validate=validate)
        return out.cpu()

    def moe(self, x_TH, topk_ids_TK, topk_weights_TK, fused: bool = True, backend: str | None = None,
            out_dtype: str = "bf16", layer: int = 0, validate: bool = True, group: str = "main") -> torch.Tensor:
        """One MoE layer (dispatch, experts of ``layer``, combine, shared experts), output on this
        rank's device. Collective: every rank calls it (with 0 tokens if it has none), in the
        same order."""
        t = self.transport(backend, group)
        g = self.group_state(group)
        experts = self._experts_of(layer, group)
        x, ids, w = self._inputs(x_TH, topk_ids_TK, topk_weights_TK, validate=validate, group=group)
        self._handle = self._y = None  # the phase-by-phase state does not survive a whole layer
        with self.stats.phase("dispatch"):
            h = t.dispatch(x, ids, w, fused=fused)
        self.stats.count_tokens(h.recv.num_tokens_L, x.shape[0])
        with self.stats.phase("experts"):
            y = run_experts(handle=h, experts=experts, scratch=g.scratch)
            add = shared_experts(x, experts)
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[out_dtype]
        with self.stats.phase("combine"):
            return t.combine(y, h, dt, add, fused=fused)

    def check(self, *, group: str = "main", backend: str | None = None, num_tokens, seed: int = 0,
              routing: str = "uniform", rounds: int = 1, fused: bool = True, expert_seed: int = 0) -> dict:
        """Run ``rounds`` layers on seeded inputs and compare this rank's output with
        :func:`ray_ep.reference.moe_forward` computed here for the whole world (every rank
        rebuilds all inputs from the seed). Returns {"max_abs": .., "rel": ..} (collective)."""
        g = self.group_state(group)
        cfg = g.cfg
        self.load_experts(seed=expert_seed, layer=CHECK_LAYER, group=group)
        key = (cfg.hidden_size, cfg.intermediate_size, cfg.n_experts, cfg.n_shared_experts, cfg.expert_dtype,
               expert_seed)
        if self._ref_weights[0] != key:  # the whole world's experts, for the reference (CPU)
            self._ref_weights = (key, init_expert_weights(cfg, seed=expert_seed))
        weights = self._ref_weights[1]
        max_abs = rel = 0.0
        try:
            max_abs, rel = self._check_rounds(group, backend, cfg, weights, num_tokens, seed, routing, rounds, fused)
        finally:
            del g.experts[CHECK_LAYER]
        return {"max_abs": max_abs, "rel": rel}

    def _check_rounds(self, group, backend, cfg, weights, num_tokens, seed, routing, rounds, fused):
        max_abs = rel = 0.0
        for i in range(rounds):
            xs, ids, ws = make_inputs(cfg, num_tokens, seed=seed + i, routing=routing)
            out = self.moe(xs[self.rank], ids[self.rank], ws[self.rank], fused=fused, backend=backend,
                           out_dtype=cfg.combine_dtype, layer=CHECK_LAYER, group=group, validate=False)
            ref = reference.moe_forward(cfg, xs, ids, ws, weights)[self.rank]
            if ref.numel():
                diff = (out.float().cpu() - ref.float()).abs().max().item()
                max_abs = max(max_abs, diff)
                rel = max(rel, diff / max(ref.float().abs().max().item(), 1e-6))
        return max_abs, rel

    def run(self, fn, *args, **kwargs):
        """Call ``fn(worker, *args, **kwargs)`` in this actor: user code (a model's forward, a
        custom loop) that runs on the rank's device and calls :meth:`moe` collectively."""
        return fn(self, *args, **kwargs)

    def set_profiling(self, enabled: bool) -> None:
        """Time each phase of :meth:`moe` (synchronises the device) and count tokens per expert."""
        self.stats.enabled = enabled
        self.stats.reset()

    def phase_stats(self) -> dict:
        """Seconds and calls per phase, tokens seen, tokens per local expert since the last reset."""
        return self.stats.snapshot()

    def barrier(self) -> None:
        self.transport("torch").barrier()

    def ping(self) -> float:
        return time.time()

    def shutdown(self) -> None:
        """Free symmetric memory and leave the process groups (collective for nvshmem)."""
        self._handle = self._y = self._x = self._pending = None
        for name in [n for n in self.groups if n != "main"] + ["main"]:  # same order on every rank
            g = self.groups.pop(name, None)
            if g is not None:
                g.close()
        if self._nvshmem:
            from ..transport import nvshmem

            nvshmem.runtime_finalize()
            self._nvshmem = False


@dataclass
class EPGroupState:
    """One config's transports, experts (per layer) and expert scratch on this rank."""

    cfg: EPConfig
    transports: dict[str, Transport] = field(default_factory=dict)
    experts: dict[int, LocalExperts] = field(default_factory=dict)
    scratch: ExpertScratch | None = None

    def close(self) -> None:
        # nvshmem first (collective free), the process group last
        for name in ("nvshmem", "torch"):
            t = self.transports.pop(name, None)
            if t is not None:
                t.shutdown()
