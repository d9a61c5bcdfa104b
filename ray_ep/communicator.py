"""EPCommunicator: one rank's expert-parallel exchange, made inside any process that is a rank
of a torch.distributed process group (torchrun ranks, Ray Train workers, your own Ray
actors, an inference engine's workers, and ray_ep's own :class:`~ray_ep.actors.worker.EPWorker`).

Legend: T tokens on this rank, K top-k, E experts, R ranks, L = E / R local experts, H hidden
size, M expert-major rows received by this rank.

>>> import torch.distributed as dist                                    # doctest: +SKIP
>>> dist.init_process_group("gloo")            # or "nccl"; torchrun sets the rendezvous
>>> with EPCommunicator(cfg) as comm:         # collective: every rank of the group at once
...     handle = comm.dispatch(x_TH, topk_ids_TK, topk_weights_TK)
...     y_MH = comm.run_experts(handle, experts)
...     out_TH = comm.combine(y_MH, handle)

Creation is collective and fails with a clear error instead of hanging: every rank gathers a
summary of every other rank (config, resolved backend, host, device) through the process
group, waiting at most ``init_timeout_s``, and each rank then raises the same
:class:`~ray_ep.errors.EPConfigError` when the group's size is not the config's world size,
the ranks' configs differ (naming the fields and both values: a different
``max_tokens_per_rank`` is a known cause of hangs elsewhere), two ranks share a GPU, or ranks
of one configured node sit on different hosts. A rank that never arrives is an
:class:`~ray_ep.errors.EPTimeoutError`, one that crashes meanwhile an
:class:`~ray_ep.errors.EPWorkerError`. A second communicator on a device that already has one
in this process is refused at once (use :meth:`EPCommunicator.sibling` for another config
on the same ranks).

Backends (``config.backend``; ``auto`` picks ``nvshmem`` on a CUDA device, else ``torch``):
``nvshmem`` agrees on the NVSHMEM unique id through the process group (rank 0 makes it),
joins the NVSHMEM job and allocates the :class:`~ray_ep.config.BufferPlan` as symmetric
memory; ``torch`` exchanges rows with ``all_to_all_single`` over the process group itself
(gloo on CPU, NCCL on GPUs). With ``nvshmem`` the torch transport stays available as the
NCCL baseline (``backend="torch"`` in the calls below).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from .config import BufferPlan, EPConfig, micro_batch_config, plan_buffers
from .errors import EPConfigError, EPStateError, EPTimeoutError, EPWorkerError
from .kernels.experts import ExpertScratch, LocalExperts, run_experts
from .graphs import LayerGraphs
from .pipeline import moe_layer, moe_micro_batched
from .transport.base import Transport
from .transport.torch_dist import TorchTransport
from .types import DispatchHandle, DispatchLayout
from .validation import validate_moe_inputs

log = logging.getLogger(__name__)

SUMMARY_BYTES = 4096  # room for one rank's summary (a config as JSON is about 500 bytes)
UID_BYTES = 1024  # room for the NVSHMEM unique id (128 bytes in NVSHMEM 3.x)
SETUP_POLL_S = 0.001  # how often a set-up collective is checked: creation is rare, a peer's answer quick
# the dtype a dispatch sends, by dispatch dtype (fp8 quantises fp32 / bf16 / fp16 inside the send)
_SEND_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
_OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}

_live: dict[str, "EPCommunicator"] = {}  # device -> the communicator created on it by this process


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve_backend(cfg: EPConfig, device: torch.device) -> str:
    if cfg.backend == "auto":
        return "nvshmem" if device.type == "cuda" else "torch"
    if cfg.backend == "nvshmem" and device.type != "cuda":
        raise EPConfigError(f"backend 'nvshmem' needs a CUDA device, this rank has {device}; "
                            f"use backend='torch' (or 'auto') on CPU")
    return cfg.backend


def _physical_device(device: torch.device) -> str:
    """What identifies the device across processes: the GPU's UUID (processes see their GPUs
    under different indices), or "cpu" (CPU ranks may share a host)."""
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


def _wait(work: Any, timeout_s: float, what: str, rank: int) -> None:
    """Wait for a set-up collective on the host, at most ``timeout_s``. Polled: an NCCL wait
    only orders the stream, and a collective a peer never joins would block the next host
    sync until the process group's own (longer) timeout."""
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise EPTimeoutError(f"rank {rank}: {what} did not complete within init_timeout_s = {timeout_s:g} s: "
                                 f"a rank of the process group did not create its EPCommunicator")
        time.sleep(SETUP_POLL_S)
    try:
        work.wait()  # orders the stream after the collective; raises what it failed with
    except RuntimeError as e:  # gloo and NCCL: a peer crashed or left the group
        raise EPWorkerError(f"rank {rank}: {what} failed: a rank of the process group crashed or left ({e})") from e


def _config_differences(mine: dict, theirs: dict) -> list[str]:
    return [f"{k} = {mine.get(k)!r} here, {theirs.get(k)!r} there"
            for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]


def check_summaries(summaries: list[dict], cfg: EPConfig, rank: int) -> None:
    """Raise EPConfigError unless the ranks' summaries (config, backend, host, device; one per
    rank of the group, in rank order) describe one consistent group for ``cfg``."""
    R = len(summaries)
    for r, s in enumerate(summaries):
        if s.get("problem"):
            raise EPConfigError(f"rank {rank}: rank {r} cannot take part: {s['problem']}")
    if R != cfg.world_size:
        raise EPConfigError(f"rank {rank}: the process group has {R} ranks but the config's world size is "
                            f"n_nodes x gpus_per_node = {cfg.n_nodes} x {cfg.gpus_per_node} = {cfg.world_size}; "
                            f"make them match (one EPCommunicator per rank of the group)")
    for r, s in enumerate(summaries):
        diff = _config_differences(summaries[0]["config"], s["config"])
        if diff:
            raise EPConfigError(f"rank {rank}: ranks 0 and {r} were given different configs ({'; '.join(diff)}, "
                                f"'here' being rank 0); every rank must create its EPCommunicator from the same "
                                f"EPConfig")
        if s["backend"] != summaries[0]["backend"]:
            raise EPConfigError(f"rank {rank}: rank 0 resolved backend {summaries[0]['backend']!r} but rank {r} "
                                f"{s['backend']!r} (backend 'auto' follows each rank's device); give every rank "
                                f"the same kind of device or set backend explicitly")
    seen: dict[tuple[str, str], int] = {}
    for r, s in enumerate(summaries):
        if s["device"] == "cpu":
            continue
        key = (s["host"], s["device"])
        if key in seen:
            raise EPConfigError(f"rank {rank}: ranks {seen[key]} and {r} both use GPU {s['device']} on host "
                                f"{s['host']}; give each rank its own GPU (torch.cuda.set_device(local_rank) "
                                f"before creating the communicator)")
        seen[key] = r
    for r, s in enumerate(summaries):
        first = cfg.node_of(r) * cfg.gpus_per_node
        if s["host"] != summaries[first]["host"]:
            raise EPConfigError(f"rank {rank}: ranks {first} and {r} form node {cfg.node_of(r)} of the config "
                                f"(gpus_per_node = {cfg.gpus_per_node}) but run on hosts {summaries[first]['host']} "
                                f"and {s['host']}; fix n_nodes / gpus_per_node or the rank order (node-major)")


class EPCommunicator:
    """One rank's end of the expert-parallel exchange (see the module docstring).

    Args:
        config: the layer group's :class:`EPConfig`, the same on every rank.
        group: the torch.distributed process group whose ranks are the EP ranks, in EP rank
            order (default: the WORLD group). Its backend must reach ``device`` (gloo for CPU
            tensors, NCCL for CUDA tensors).
        device: this rank's device (default: the current CUDA device, else CPU).
    """

    def __init__(self, config: EPConfig, *, group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None):
        if not dist.is_initialized():
            raise EPStateError("EPCommunicator needs a torch.distributed process group: call "
                               "torch.distributed.init_process_group first (torchrun and Ray Train do)")
        self._group = group if group is not None else dist.group.WORLD
        self.device = torch.device(device) if device is not None else _default_device()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank = dist.get_rank(self._group)
        key = _device_key(self.device)
        if key in _live:
            raise EPConfigError(f"rank {self.rank}: this process already has an EPCommunicator on {key}; close() "
                                f"it first, or use its sibling(config) for another config on the same ranks")
        self.config = config
        try:
            self.backend, problem = _resolve_backend(config, self.device), None
        except EPConfigError as e:  # told to every rank through the config check, so none waits
            self.backend, problem = "none", str(e)
        self._parent: EPCommunicator | None = None
        self._children: list[EPCommunicator] = []
        self._micro: dict[int, list[EPCommunicator]] = {}
        self._graphs: dict[str, LayerGraphs] = {}
        self._transports: dict[str, Transport] = {}
        self._scratch: ExpertScratch | None = None
        self._last_send: str | None = None
        self._owns_nvshmem = False
        self._agree(problem)
        _live[key] = self
        try:
            if self.backend == "nvshmem":
                self._start_nvshmem()
            else:
                self.transport("torch")
        except BaseException:
            self.close()
            raise
        log.info("rank %d: EPCommunicator ready (backend %s, %s)", self.rank, self.backend, self.device)

    # ---- creation ------------------------------------------------------------------------------
    def _collective_device(self) -> torch.device:
        """Where the small set-up tensors live: CPU over gloo, this rank's GPU over NCCL."""
        backend = str(dist.get_backend(self._group))
        return torch.device("cpu") if "gloo" in backend or self.device.type != "cuda" else self.device

    def _agree(self, problem: str | None = None) -> None:
        """Gather every rank's summary and check them (collective; see check_summaries)."""
        cfg = self.config
        summary = {"config": cfg.model_dump(mode="json"), "backend": self.backend, "host": socket.gethostname(),
                   "device": _physical_device(self.device), "pid": os.getpid(), "problem": problem}
        raw = json.dumps(summary, sort_keys=True).encode()
        if len(raw) > SUMMARY_BYTES - 4:
            raise EPConfigError(f"rank {self.rank}: the config summary is {len(raw)} bytes, more than "
                                f"{SUMMARY_BYTES - 4}")
        dev = self._collective_device()
        mine = torch.zeros(SUMMARY_BYTES, dtype=torch.uint8)
        mine[:4] = torch.tensor(list(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
        mine[4:4 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        mine = mine.to(dev)
        world = dist.get_world_size(self._group)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        _wait(dist.all_gather(gathered, mine, group=self._group, async_op=True), cfg.init_timeout_s,
              "the config check (an all_gather)", self.rank)
        summaries = []
        for t in gathered:
            b = bytes(t.cpu().tolist())
            n = int.from_bytes(b[:4], "little")
            summaries.append(json.loads(b[4:4 + n]))
        check_summaries(summaries, cfg, self.rank)

    def _broadcast_uid(self, uid: bytes | None) -> bytes:
        buf = torch.zeros(UID_BYTES, dtype=torch.uint8)
        if uid is not None:
            buf[:2] = torch.tensor(list(len(uid).to_bytes(2, "little")), dtype=torch.uint8)
            buf[2:2 + len(uid)] = torch.frombuffer(bytearray(uid), dtype=torch.uint8)
        buf = buf.to(self._collective_device())
        src = dist.get_global_rank(self._group, 0)
        _wait(dist.broadcast(buf, src=src, group=self._group, async_op=True), self.config.init_timeout_s,
              "the NVSHMEM unique id broadcast", self.rank)
        b = bytes(buf.cpu().tolist())
        return b[2:2 + int.from_bytes(b[:2], "little")]

    def _start_nvshmem(self) -> None:
        from .transport import nvshmem

        cfg = self.config
        uid = self._broadcast_uid(nvshmem.make_unique_id(cfg.n_nodes) if self.rank == 0 else None)
        nvshmem.runtime_init(self.rank, cfg.world_size, self.device, uid, n_nodes=cfg.n_nodes)
        self._owns_nvshmem = True
        self._transports["nvshmem"] = nvshmem.NvshmemTransport(cfg, self.rank, self.device)

    def sibling(self, config: EPConfig) -> "EPCommunicator":
        """Another communicator on the same ranks, process group and NVSHMEM job, with its own
        buffers for ``config`` (benchmarks run several presets without restarting). Collective:
        every rank creates its siblings in the same order; ranks and nodes must stay the same."""
        self._check_open()
        if config.world_size != self.config.world_size or config.n_nodes != self.config.n_nodes:
            raise EPConfigError(f"a sibling keeps the topology {self.config.n_nodes} x {self.config.gpus_per_node}, "
                                f"got {config.n_nodes} x {config.gpus_per_node}")
        child = object.__new__(EPCommunicator)
        child._group, child.device, child.rank = self._group, self.device, self.rank
        child.config, child.backend = config, _resolve_backend(config, self.device)
        child._parent, child._children, child._transports, child._micro, child._graphs = self, [], {}, {}, {}
        child._scratch, child._last_send, child._owns_nvshmem = None, None, False
        child._agree()
        if child.backend == "nvshmem":
            from .transport.nvshmem import NvshmemTransport

            if self._transports.get("nvshmem") is None:
                raise EPConfigError("a sibling on the nvshmem backend needs a parent on the nvshmem backend")
            child._transports["nvshmem"] = NvshmemTransport(config, self.rank, self.device)
        self._children.append(child)
        return child

    # ---- what it holds -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group the communicator runs over."""
        return self._group

    @property
    def plan(self) -> BufferPlan:
        """The symmetric buffers of this config (allocated with the nvshmem backend)."""
        return plan_buffers(self.config)

    @property
    def local_expert_ids(self) -> range:
        """The global ids of the L experts this rank holds."""
        L = self.config.experts_per_rank
        return range(self.rank * L, (self.rank + 1) * L)

    def transport(self, backend: str | None = None) -> Transport:
        """This rank's end of ``backend`` (default: the communicator's): ``nvshmem`` or
        ``torch`` (over the process group; with nvshmem it is the NCCL baseline)."""
        self._check_open()
        name = backend or self.backend
        if name == "torch" and "torch" not in self._transports:
            backend_name = str(dist.get_backend(self._group))
            need = "nccl" if self.device.type == "cuda" else "gloo"
            if need not in backend_name:
                raise EPConfigError(f"rank {self.rank}: the torch backend on {self.device} needs a {need} process "
                                    f"group, this one is {backend_name!r}")
            self._transports["torch"] = TorchTransport(self.config, self.rank, self.device, group=self._group)
        if name not in self._transports:
            raise EPStateError(f"rank {self.rank}: backend {name!r} is not running here "
                               f"(have {sorted(self._transports)})")
        return self._transports[name]

    # ---- the exchange --------------------------------------------------------------------------
    def prepare_inputs(self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                       validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensors a dispatch sends: on this device, x in the wire dtype (bf16 / fp32 / fp64;
        fp8 quantises inside the send), ids int32, weights fp32 (fp64 beside fp64 rows).
        ``validate`` checks values too (a host sync), as at every entry a user calls."""
        cfg = self.config
        if validate:
            validate_moe_inputs(cfg, x_TH, topk_ids_TK, topk_weights_TK, self.rank)
        x = x_TH.to(self.device)
        if cfg.dispatch_dtype in _SEND_DTYPES:
            x = x.to(_SEND_DTYPES[cfg.dispatch_dtype])
        w_dtype = torch.float64 if cfg.dispatch_dtype == "fp64" else torch.float32
        return (x.contiguous(), topk_ids_TK.to(self.device, torch.int32).contiguous(),
                topk_weights_TK.to(self.device, w_dtype).contiguous())

    def _sending(self, phase: str, backend: str | None) -> Transport:
        """The transport for a send of ``phase``. The symmetric buffers are reused without
        clearing on the promise that dispatch and combine alternate (docs/design.md,
        "Signals"); backward passes run two combines in a row, so then a device barrier keeps
        a fast rank from writing the next combine's rows over ones a peer is still reading."""
        t = self.transport(backend)
        if t.name == "nvshmem" and self._last_send == phase:
            t.device_barrier()
        self._last_send = phase if t.name == "nvshmem" else None
        return t

    def dispatch(self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, *,
                 fused: bool = True, validate: bool = True, layout: DispatchLayout | None = None,
                 backend: str | None = None) -> DispatchHandle:
        """Send each token to every rank holding one of its experts and lay the arrivals out
        expert-major (collective). x_TH [T, H], topk_ids_TK [T, K] (-1 = unused),
        topk_weights_TK [T, K]. ``layout``: reuse the send-side layout of an earlier dispatch of
        the same ids (backward passes). On nvshmem the handle's rows stay valid until the next
        dispatch of any rank, which a peer may start once this rank's combine has sent: read
        them before the combine (:meth:`DispatchHandle.kept` keeps the layouts longer)."""
        x, ids, w = self.prepare_inputs(x_TH, topk_ids_TK, topk_weights_TK, validate)
        return self._sending("dispatch", backend).dispatch(x, ids, w, fused=fused, layout=layout)

    def dispatch_send(self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, *,
                      validate: bool = True, layout: DispatchLayout | None = None, backend: str | None = None) -> Any:
        """Split form, first half: returns a pending dispatch at once (compute may run while
        rows travel); pass it to :meth:`dispatch_recv`."""
        x, ids, w = self.prepare_inputs(x_TH, topk_ids_TK, topk_weights_TK, validate)
        t = self._sending("dispatch", backend)
        return t, t.dispatch_send(x, ids, w, layout)

    def dispatch_recv(self, pending: Any) -> DispatchHandle:
        """Split form, second half: wait for every source; returns the handle."""
        t, inner = pending
        return t.dispatch_recv(inner)

    def _out_dtype(self, out_dtype: torch.dtype | None) -> torch.dtype:
        return out_dtype if out_dtype is not None else _OUT_DTYPES[self.config.combine_dtype]

    def combine(self, y_MH: torch.Tensor, handle: DispatchHandle, *, out_dtype: torch.dtype | None = None,
                add_TH: torch.Tensor | None = None, fused: bool = True, backend: str | None = None) -> torch.Tensor:
        """Return the expert outputs y_MH (expert-major rows of ``handle``; the nvshmem kernels
        want at least ``max_recv_rows`` rows) to their tokens, weighted by the router weights:
        out_TH [T, H] in ``out_dtype`` (default: the combine dtype), plus ``add_TH`` if given."""
        return self._sending("combine", backend).combine(y_MH, handle, self._out_dtype(out_dtype), add_TH, fused=fused)

    def combine_send(self, y_MH: torch.Tensor, handle: DispatchHandle, *, backend: str | None = None) -> Any:
        """Split form, first half: returns a pending combine at once."""
        t = self._sending("combine", backend)
        return t, t.combine_send(y_MH, handle)

    def combine_recv(self, pending: Any, *, out_dtype: torch.dtype | None = None,
                     add_TH: torch.Tensor | None = None) -> torch.Tensor:
        """Split form, second half: wait for every rank's partial rows; out_TH [T, H]."""
        t, inner = pending
        return t.combine_recv(inner, self._out_dtype(out_dtype), add_TH)

    def expert_major(self, handle: DispatchHandle, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The rows this rank received, expert-major: [M, H] in ``dtype`` (dequantised for fp8;
        alignment padding rows are 0), M = ``handle.recv.row_offsets_L1[-1]`` (one host sync).
        Local expert i owns rows ``row_offsets_L1[i]`` .. ``+ num_tokens_L[i]``."""
        return handle.expert_major_rows(int(handle.recv.row_offsets_L1[-1]), dtype=dtype)

    def run_experts(self, handle: DispatchHandle, experts: LocalExperts) -> torch.Tensor:
        """The built-in SwiGLU experts (bf16 weights, grouped GEMMs) over a dispatch: y_MH
        [max_recv_rows, H] bf16, ready for :meth:`combine`. The rows live in scratch that the
        next call reuses. Inference only (no autograd: see :mod:`ray_ep.nn`)."""
        return run_experts(handle=handle, experts=experts, scratch=self.scratch)

    @property
    def scratch(self) -> ExpertScratch:
        """The intermediates of :meth:`run_experts` (``max_recv_rows`` rows on GPUs, the rows that
        arrived on CPUs), allocated on first use."""
        self._check_open()
        if self._scratch is None:
            # GPUs: capacity rows (the kernels read counts on the device, no host sync); CPU: grown
            # to the rows that arrive (run_experts_torch), so a large max_tokens_per_rank costs nothing
            self._scratch = ExpertScratch.allocate(self.config, self.device,
                                                   rows=None if self.device.type == "cuda" else 0)
        return self._scratch

    def moe(self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
            experts: LocalExperts, *, out_dtype: torch.dtype | None = None, fused: bool = True,
            validate: bool = True, backend: str | None = None, micro_batches: int | None = None,
            cuda_graph: bool = False) -> torch.Tensor:
        """One MoE layer (dispatch, built-in experts, combine, shared experts); collective:
        every rank calls it, with 0 tokens if it has none. On GPUs the shared experts run on a
        side stream beside the dispatch, and the dispatch's error (timeout, overflow) is raised
        once the routed experts are launched, before the combine. ``micro_batches`` (default:
        the config's) > 1 overlaps one micro-batch's communication with another's experts
        (:mod:`ray_ep.pipeline`; the same output). ``cuda_graph`` (GPUs): the layer, micro-batched
        or not, is captured once per token bucket and replayed (:mod:`ray_ep.graphs`; the same
        output, and no launch from the host: a micro-batched layer launched from Python waits
        on the host, whose launches take longer than its kernels)."""
        x, ids, w = self.prepare_inputs(x_TH, topk_ids_TK, topk_weights_TK, validate)
        n = micro_batches or self.config.micro_batches
        if cuda_graph:
            if self.device.type != "cuda":
                raise EPConfigError(f"rank {self.rank}: cuda_graph needs a CUDA device, this rank has {self.device}")
            od = self._out_dtype(out_dtype)
            # a micro-batched layer's receives are its micro-batches' (checked after each replay)
            used = [c.transport(backend) for c in self.micro_batch_communicators(n)] if n > 1 else None

            def layer(xg, idsg, wg):
                return self.moe(xg, idsg, wg, experts, out_dtype=od, fused=fused, validate=False, backend=backend,
                                micro_batches=n)

            key = (id(experts), od, fused, backend, n)
            return self.graphs(backend).moe(key, layer, x, ids, w, keep=experts, transports=used)
        if n > 1:
            parts = self.micro_batch_communicators(n)
            return moe_micro_batched([c.transport(backend) for c in parts], [c.scratch for c in parts], experts,
                                     x, ids, w, self._out_dtype(out_dtype), fused=fused)
        t = self._sending("dispatch", backend)
        out, _ = moe_layer(t, self.scratch, experts, x, ids, w, self._out_dtype(out_dtype), fused=fused)
        self._last_send = "combine" if t.name == "nvshmem" else None  # the layer's last send (see _sending)
        return out

    def graphs(self, backend: str | None = None) -> LayerGraphs:
        """The CUDA graphs of whole layers this communicator captured (:meth:`moe` with
        ``cuda_graph=True``): ``graphs().stats()`` counts captures and replays."""
        self._check_open()
        name = backend or self.backend
        if name not in self._graphs:
            self._graphs[name] = LayerGraphs(self.transport(name), self.config.max_tokens_per_rank)
        return self._graphs[name]

    def micro_batch_communicators(self, n: int) -> list["EPCommunicator"]:
        """``n`` siblings with buffers for ``ceil(max_tokens_per_rank / n)`` tokens each, made on
        first use (collective: every rank asks for the same ``n`` in the same call)."""
        self._check_open()
        if not 1 < n <= 8:
            raise EPConfigError(f"micro_batches must be 2 .. 8 here, got {n}")
        if n not in self._micro:
            cfg = micro_batch_config(self.config.model_copy(update={"micro_batches": n}))
            self._micro[n] = [self.sibling(cfg) for _ in range(n)]
        return self._micro[n]

    def barrier(self) -> None:
        """Block the host until every rank got here."""
        self.transport().barrier()

    # ---- teardown ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._transports is None

    def _check_open(self) -> None:
        if self._transports is None:
            raise EPStateError(f"rank {self.rank}: the EPCommunicator is closed")

    def close(self) -> None:
        """Free the symmetric buffers (collective on nvshmem: every rank at once), siblings
        first, and leave the NVSHMEM job. The process group stays the caller's. Idempotent."""
        if self._transports is None:
            return
        for child in reversed(self._children):
            child.close()
        self._children, self._micro, self._graphs = [], {}, {}
        transports, self._transports = self._transports, None
        self._scratch = None
        try:
            for name in ("nvshmem", "torch"):  # nvshmem first: its free is collective
                t = transports.pop(name, None)
                if t is not None:
                    t.shutdown()
            if self._owns_nvshmem:
                from .transport import nvshmem

                nvshmem.runtime_finalize()
                self._owns_nvshmem = False
        finally:
            if self._parent is not None:
                if self in self._parent._children:
                    self._parent._children.remove(self)
            elif _live.get(_device_key(self.device)) is self:
                del _live[_device_key(self.device)]

    def __enter__(self) -> "EPCommunicator":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.backend
        return f"EPCommunicator(rank {self.rank} of {self.config.world_size}, {self.device}, {state})"
