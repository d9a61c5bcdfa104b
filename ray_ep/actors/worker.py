"""EPWorker: one rank of the expert-parallel group, living in a Ray actor.

A thin actor around :class:`~ray_ep.communicator.EPCommunicator`: it joins the
torch.distributed group (gloo on CPU, NCCL on GPU), creates the rank's communicator (which
bootstraps NVSHMEM through that group on the ``nvshmem`` backend) and keeps what the driver's
calls need between them: the experts of each layer and the tensors of a layer in flight. The
driver calls it phase by phase (``dispatch`` -> ``compute`` -> ``combine``) or for whole
layers (``forward``); per-layer tensors stay on the worker's device between phases.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import datetime
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from .. import reference
from ..communicator import EPCommunicator
from ..config import EPConfig
from ..errors import EPInputError, EPStateError
from ..inputs import make_inputs
from ..kernels.experts import LocalExperts, shared_experts
from ..transport.base import Transport
from ..transport.nvshmem import apply_nvshmem_env
from ..types import DispatchHandle
from ..weights import ExpertWeights, init_expert_weights
from .group import WorkerContext

log = logging.getLogger(__name__)

CHECK_LAYER = -1  # the expert-layer slot that check() loads its seeded experts into
OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}



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
        apply_nvshmem_env(ctx.n_nodes)  # before any GPU library starts
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

    @property
    def comm(self) -> EPCommunicator:
        """The main group's communicator."""
        return self.group_state().comm

    @property
    def backend(self) -> str | None:
        return self.groups["main"].comm.backend if "main" in self.groups else None

    # ---- set-up ------------------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """An address and free port on this node for the torch.distributed rendezvous."""
        return self.ctx.node_ip, free_port()

    def device_info(self) -> dict:
        info = {"rank": self.rank, "device": str(self.device), "node_id": self.ctx.node_id,
                "local_rank": self.ctx.local_rank, "node_rank": self.ctx.node_rank, "pid": os.getpid()}
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

    def start_communicator(self, cfg: EPConfig, master_addr: str, master_port: int) -> str:
        """Join the torch.distributed group and create the rank's communicator (collective:
        every rank at once; NVSHMEM bootstraps through the group). Returns the backend."""
        self.ctx = replace(self.ctx, master_addr=master_addr, master_port=master_port)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo",
                                    init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                    world_size=cfg.world_size,
                                    timeout=datetime.timedelta(seconds=cfg.init_timeout_s),
                                    **({"device_id": self.device} if self.device.type == "cuda" else {}))
        self.groups["main"] = EPGroupState(EPCommunicator(cfg, device=self.device))
        if self.device.type != "cuda":
            # gloo: from here on every collective waits recv_timeout_s, not the rendezvous's
            # init_timeout_s (transport/torch_dist.py); a private torch function, checked
            set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
            if set_timeout is None:
                raise EPStateError(f"torch {torch.__version__} has no torch.distributed.distributed_c10d."
                                   f"_set_pg_timeout: recv_timeout_s cannot bound the gloo backend; use torch >= 2.2")
            set_timeout(datetime.timedelta(seconds=cfg.recv_timeout_s), dist.group.WORLD)
        return self.backend

    def add_group(self, name: str, cfg: EPConfig) -> None:
        """A communicator for another config on the same ranks (collective: same order
        everywhere). Benchmarks use this to run several presets and dtypes without restarting."""
        if name in self.groups:
            raise EPStateError(f"group {name!r} exists already")
        main = self.comm
        if cfg.world_size != main.config.world_size or cfg.n_nodes != main.config.n_nodes:
            raise EPInputError(f"group {name!r} must keep the topology {main.config.n_nodes}x"
                               f"{main.config.gpus_per_node}")
        self.groups[name] = EPGroupState(main.sibling(cfg))

    def drop_group(self, name: str) -> None:
        """Free an extra group's buffers (collective)."""
        if name == "main":
            raise EPInputError("the main group lives until shutdown")
        g = self.groups.pop(name, None)
        if g is not None:
            g.comm.close()

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
        g.comm.scratch  # noqa: B018 - allocated now, beside the weights, not in the first forward
        return sum(t.numel() * t.element_size() for t in vars(experts).values() if t is not None)

    def _local_expert_ids(self, cfg: EPConfig) -> range:
        L = cfg.experts_per_rank
        return range(self.rank * L, (self.rank + 1) * L)

    def group_state(self, name: str = "main") -> "EPGroupState":
        """The communicator and experts of a config on this rank ("main", or a name
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
        return self.group_state(group).comm.transport(backend)

    # ---- phases (debugging and jobs) -----------------------------------------------------------
    def dispatch(self, x_TH, topk_ids_TK, topk_weights_TK, fused: bool = True, backend: str | None = None,
                 validate: bool = True) -> DispatchSummary:
        """Dispatch this rank's tokens; keeps the handle for :meth:`compute` and :meth:`combine`.
        ``validate=False``: the caller (the driver) has checked the inputs already."""
        x, ids, w = self.comm.prepare_inputs(x_TH, topk_ids_TK, topk_weights_TK, validate=validate)
        self._x, self._y = x, None
        self._handle = self.comm.dispatch(x, ids, w, fused=fused, validate=False, backend=backend)
        r = self._handle.recv
        return DispatchSummary(self.rank, r.num_tokens_L.tolist(), r.recv_counts_R.tolist())

    def dispatch_send(self, x_TH, topk_ids_TK, topk_weights_TK, backend: str | None = None,
                      validate: bool = True) -> None:
        """Split form, first half: returns once the sends are queued."""
        x, ids, w = self.comm.prepare_inputs(x_TH, topk_ids_TK, topk_weights_TK, validate=validate)
        self._x, self._y, self._handle = x, None, None
        self._pending = self.comm.dispatch_send(x, ids, w, validate=False, backend=backend)

    def dispatch_recv(self) -> DispatchSummary:
        if self._pending is None:
            raise EPStateError(f"rank {self.rank}: dispatch_recv without dispatch_send")
        pending, self._pending = self._pending, None
        self._handle = self.comm.dispatch_recv(pending)
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
        self._y = self.comm.run_experts(h, self._experts_of(layer))

    def combine(self, fused: bool = True, backend: str | None = None, out_dtype: str = "bf16") -> torch.Tensor:
        """Return expert outputs to their tokens; out [T, H] on CPU (shared experts included)."""
        out = self._combine(fused, backend, out_dtype)
        return out.cpu()

    def _combine(self, fused: bool, backend: str | None, out_dtype: str) -> torch.Tensor:
        h = self._need_handle("combine")
        if self._y is None:
            raise EPStateError(f"rank {self.rank}: combine needs compute() after dispatch")
        add = shared_experts(self._x, self._experts_of(self._layer))
        out = self.comm.combine(self._y, h, out_dtype=OUT_DTYPES[out_dtype], add_TH=add, fused=fused, backend=backend)
        self._handle, self._y = None, None
        return out

    def forward(self, x_TH, topk_ids_TK, topk_weights_TK, fused: bool = True, backend: str | None = None,
                out_dtype: str = "bf16", layer: int = 0, validate: bool = True,
                micro_batches: int | None = None, cuda_graph: bool = False) -> torch.Tensor:
        """One whole MoE layer on this rank's tokens; out [T, H] on CPU."""
        out = self.moe(x_TH, topk_ids_TK, topk_weights_TK, fused=fused, backend=backend,
                       out_dtype=out_dtype, layer=layer, validate=validate, micro_batches=micro_batches,
                       cuda_graph=cuda_graph)
        return out.cpu()

    def moe(self, x_TH, topk_ids_TK, topk_weights_TK, fused: bool = True, backend: str | None = None,
            out_dtype: str = "bf16", layer: int = 0, validate: bool = True, group: str = "main",
            micro_batches: int | None = None, cuda_graph: bool = False) -> torch.Tensor:
        """One MoE layer (dispatch, experts of ``layer``, combine, shared experts), output on this
        rank's device. Collective: every rank calls it (with 0 tokens if it has none), in the
        same order. The layer is :meth:`EPCommunicator.moe`'s (on GPUs the shared experts run
        beside the dispatch); ``micro_batches`` (default: the config's) > 1 overlaps the
        micro-batches' communication with their experts; ``cuda_graph`` (GPUs) replays the
        layer from a CUDA graph captured per token bucket (one "layer" phase in the stats).
        With profiling on (:meth:`set_profiling`) an eager layer runs its phases one after
        another instead, each timed (dispatch, experts, combine) and the tokens per expert
        counted."""
        comm = self.group_state(group).comm
        experts = self._experts_of(layer, group)
        x, ids, w = comm.prepare_inputs(x_TH, topk_ids_TK, topk_weights_TK, validate=validate)
        self._handle = self._y = None  # the phase-by-phase state does not survive a whole layer
        if cuda_graph or (micro_batches or comm.config.micro_batches) > 1 or not self.stats.enabled:
            with self.stats.phase("layer"):
                return comm.moe(x, ids, w, experts, out_dtype=OUT_DTYPES[out_dtype], fused=fused, validate=False,
                                backend=backend, micro_batches=micro_batches, cuda_graph=cuda_graph)
        with self.stats.phase("dispatch"):
            h = comm.dispatch(x, ids, w, fused=fused, validate=False, backend=backend)
        self.stats.count_tokens(h.recv.num_tokens_L, x.shape[0])
        with self.stats.phase("experts"):
            y = comm.run_experts(h, experts)
            add = shared_experts(x, experts)
        with self.stats.phase("combine"):
            return comm.combine(y, h, out_dtype=OUT_DTYPES[out_dtype], add_TH=add, fused=fused, backend=backend)

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
        """Seconds and calls per phase, tokens seen, tokens per local expert since the last reset;
        ``graphs``: CUDA graphs of whole layers captured and replayed (main group)."""
        snap = self.stats.snapshot()
        comm = self.groups["main"].comm if "main" in self.groups else None
        if comm is not None and not comm.closed and comm.device.type == "cuda":
            snap["graphs"] = comm.graphs().stats()
        return snap

    def barrier(self) -> None:
        self.transport("torch").barrier()

    def ping(self) -> float:
        return time.time()

    def shutdown(self) -> None:
        """Free symmetric memory and leave the process group (collective for nvshmem)."""
        self._handle = self._y = self._x = self._pending = None
        main = self.groups.pop("main", None)
        self.groups.clear()
        if main is not None:
            main.comm.close()  # its siblings (the extra groups) first
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class EPGroupState:
    """One config's communicator and its experts (per layer) on this rank."""

    comm: EPCommunicator
    experts: dict[int, LocalExperts] = field(default_factory=dict)

    @property
    def cfg(self) -> EPConfig:
        return self.comm.config
