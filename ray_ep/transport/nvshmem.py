"""The ``nvshmem`` backend: symmetric buffers from nvshmem4py and the Triton kernels.

Bootstrap (docs/design.md): rank 0's worker makes the unique id (:func:`make_unique_id`, 128
picklable bytes; that process hosts the bootstrap root, so it must live until every rank
has joined), the driver hands it to every worker and all call :class:`NvshmemTransport`
at once (init is collective and blocking). Every rank then allocates the BufferPlan's block
with one collective ``nvshmem.core.tensor``, maps its peers' blocks through NVLink
(``get_peer_tensor``) and builds the device table of peer base addresses the kernels read.

Ranks of other nodes (``n_nodes > 1``) are not mapped: their base address in the table is 0
and the kernels reach them by NVSHMEM puts from Triton. Those kernels link NVSHMEM's device
bitcode and each of their modules must be registered with ``nvshmemx_cumodule_init`` before
its first launch: :func:`runtime_init` adds a Triton kernel-load hook that does it.

Environment the worker sets before init (never changed behind the user's back elsewhere):
:func:`nvshmem_env`.
"""

from __future__ import annotations

import logging
import os

import torch

from ..config import EPConfig, plan_buffers
from ..errors import EPWorkerError
from ..kernels import combine as combine_k
from ..kernels import dispatch as dispatch_k
from ..kernels.buffers import SymmetricBuffers, Workspace, check_status, typed_views
from ..types import DispatchHandle, RecvLayout
from .base import Transport

log = logging.getLogger(__name__)

# NVLink multicast (NVLS) stays off in NVSHMEM, NCCL and torch's symmetric memory: set in
# every worker process before a GPU library starts (also listed in the README)
NO_MULTICAST_ENV = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}


def nvshmem_env(n_nodes: int) -> dict[str, str]:
    """What a worker sets in its environment before NVSHMEM starts, each variable only where
    it is unset (a ``runtime_env`` of yours wins): NVLink multicast off everywhere; on one node
    no network transport (``NVSHMEM_REMOTE_TRANSPORT=none``) and no proxy thread
    (``NVSHMEM_DISABLE_LOCAL_ONLY_PROXY=1``).

    The proxy thread serves network transports, NVSHMEM's device-side global exit and its own
    device-side wait timeouts; one node's kernels use none of them (they reach their peers
    through NVLink addresses and time out by themselves). Left running it spins a CPU core
    per worker whether or not anything runs (one H200, an idle worker: 101% of a core with
    it, 1% without)."""
    env = dict(NO_MULTICAST_ENV)
    if n_nodes == 1:
        env.update(NVSHMEM_REMOTE_TRANSPORT="none", NVSHMEM_DISABLE_LOCAL_ONLY_PROXY="1")
    return env


def apply_nvshmem_env(n_nodes: int) -> None:
    """:func:`nvshmem_env` into this process's environment where unset, before its first NVSHMEM
    call reads the options: at a worker's start, and again in :func:`make_unique_id` (rank 0's
    first call) and :func:`runtime_init` for processes that are not ray_ep workers."""
    for k, v in nvshmem_env(n_nodes).items():
        os.environ.setdefault(k, v)


def make_unique_id(n_nodes: int) -> bytes:
    """A fresh NVSHMEM unique id as bytes (starts the bootstrap root in this process, a rank of
    an ``n_nodes`` topology)."""
    apply_nvshmem_env(n_nodes)
    import nvshmem.core as nvc

    return nvc.get_unique_id()._data.tobytes()


def _uid_from_bytes(raw: bytes):
    import numpy as np
    import nvshmem.bindings as nvb
    import nvshmem.core as nvc

    uid = nvc.get_unique_id(empty=True)
    uid._data[:] = np.frombuffer(raw, dtype=nvb.uniqueid_dtype)
    return uid


_runtime: dict = {}  # the process's NVSHMEM runtime: one init per process, many transports


def _uses_nvshmem(module: int) -> bool:
    """True when a loaded CUDA module holds NVSHMEM's device state (it linked the library)."""
    from cuda.bindings import driver

    err, _, _ = driver.cuModuleGetGlobal(driver.CUmodule(module), b"nvshmemi_device_state_d")
    return err == driver.CUresult.CUDA_SUCCESS


def _register_module(module, function, name, metadata_group, hash) -> None:
    """Triton kernel-load hook: hand NVSHMEM every module that links its device library,
    before the module's first launch (a module without it would read a zeroed device state)."""
    if not _runtime or not _uses_nvshmem(module):
        return
    import nvshmem.bindings as nvb

    rc = nvb.cumodule_init(module)
    if rc != 0:
        raise EPWorkerError(f"rank {_runtime['rank']}: nvshmemx_cumodule_init failed ({rc}) for kernel {name}")


def runtime_init(rank: int, world_size: int, device: torch.device, unique_id: bytes, n_nodes: int = 1) -> None:
    """Join the NVSHMEM job (collective and blocking: every rank at once)."""
    if _runtime:
        raise EPWorkerError(f"rank {rank}: NVSHMEM is already initialised in this process")
    apply_nvshmem_env(n_nodes)
    import nvshmem.core as nvc
    from cuda.core import Device

    torch.cuda.set_device(device)
    dev = Device(device.index or 0)
    dev.set_current()
    nvc.init(device=dev, uid=_uid_from_bytes(unique_id), rank=rank, nranks=world_size, initializer_method="uid")
    _runtime.update(nvc=nvc, rank=rank, world_size=world_size, transports=0)
    import triton

    # a chain: hooks installed by others (profilers) keep running
    triton.knobs.runtime.kernel_load_end_hook.add(_register_module)


def runtime_finalize() -> None:
    """Leave the NVSHMEM job; every transport must have been shut down first."""
    if not _runtime:
        return
    if _runtime["transports"]:
        raise EPWorkerError(f"{_runtime['transports']} NVSHMEM transport(s) still hold symmetric memory")
    nvc = _runtime.pop("nvc")
    _runtime.clear()
    import triton

    triton.knobs.runtime.kernel_load_end_hook.remove(_register_module)
    torch.cuda.synchronize()
    nvc.finalize()


class NvshmemTransport(Transport):
    """Dispatch / combine through NVSHMEM symmetric memory and the Triton kernels.

    Allocating (and freeing) the symmetric block is collective: every rank creates its
    transports for the same configs in the same order."""

    name = "nvshmem"

    def __init__(self, cfg: EPConfig, rank: int, device: torch.device):
        super().__init__(cfg, rank, device)
        if not _runtime:
            raise EPWorkerError(f"rank {rank}: call runtime_init before creating an NVSHMEM transport")
        nvc = self._nvc = _runtime["nvc"]
        self._alive = True
        _runtime["transports"] += 1
        plan = plan_buffers(cfg)
        self._block = nvc.tensor((plan.total_bytes,), dtype=torch.uint8)
        self._block.zero_()
        blocks = []
        for p in range(cfg.world_size):
            if p == rank:  # never get_peer_tensor on oneself (it would skip the collective free)
                blocks.append(self._block)
            elif cfg.node_of(p) != cfg.node_of(rank):
                blocks.append(None)  # another node: NVSHMEM puts only, even where NVLink could reach it
            else:
                try:
                    blocks.append(nvc.get_peer_tensor(self._block, p))
                except Exception as e:
                    raise EPWorkerError(f"rank {rank}: rank {p} is on this node (gpus_per_node = "
                                        f"{cfg.gpus_per_node}) but its buffers are not reachable over NVLink "
                                        f"({e}); check the topology: n_nodes x gpus_per_node must match the "
                                        f"hosts") from e
        views = [typed_views(b, plan) if b is not None else None for b in blocks]
        bases = torch.tensor([b.data_ptr() if b is not None else 0 for b in blocks], dtype=torch.int64,
                             device=device)
        self.bufs = SymmetricBuffers(plan, rank, views[rank], views, bases)
        self.ws = Workspace.allocate(cfg, device)
        self._recv_out = RecvLayout.allocate(cfg, device)
        torch.cuda.synchronize()
        nvc.barrier_all(torch.cuda.current_stream())
        torch.cuda.synchronize()
        try:
            self._warm_up()
        except BaseException:
            self.shutdown()  # collective free: the peers fail the same warm-up
            raise
        log.info("rank %d: nvshmem ready, %.1f MiB symmetric", rank, plan.total_bytes / 2**20)

    def _warm_up(self) -> None:
        """One round of every kernel form (collective), so the first real call is no compile.

        Why it matters beyond latency: loading a module can wait for kernels running on the
        device, and a kernel spinning for a peer that is still loading would never see it."""
        cfg = self.cfg
        # peers may still be compiling: wait as long as start-up may take, whatever recv_timeout_s says
        self.cfg = cfg.model_copy(update={"recv_timeout_s": max(cfg.recv_timeout_s, cfg.init_timeout_s)})
        try:
            x = torch.randn(1, cfg.hidden_size, device=self.device).to(torch.bfloat16)
            ids = torch.arange(cfg.top_k, dtype=torch.int32, device=self.device)[None, :]
            w = torch.full((1, cfg.top_k), 1.0 / cfg.top_k, device=self.device)
            y = torch.zeros(cfg.max_recv_rows, cfg.hidden_size, dtype=torch.bfloat16, device=self.device)
            for fused in (True, False):
                self.combine(y, self.dispatch(x, ids, w, fused=fused), torch.bfloat16, fused=fused)
            torch.cuda.synchronize()
        finally:
            self.cfg = cfg

    # split forms ----------------------------------------------------------------------------
    def dispatch_send(self, x_TH, topk_ids_TK, topk_weights_TK, layout=None):
        layout = dispatch_k.dispatch_send(cfg=self.cfg, x_TH=x_TH, topk_ids_TK=topk_ids_TK,
                                          topk_weights_TK=topk_weights_TK, bufs=self.bufs, ws=self.ws, layout=layout)
        return layout, x_TH.shape[0]

    def dispatch_recv(self, pending) -> DispatchHandle:
        layout, T = pending
        return dispatch_k.dispatch_recv(cfg=self.cfg, layout=layout, bufs=self.bufs, ws=self.ws, num_tokens=T,
                                        out=self._recv_out, check=self.check)

    def dispatch_fused(self, x_TH, topk_ids_TK, topk_weights_TK, layout=None) -> DispatchHandle:
        return dispatch_k.dispatch_fused(cfg=self.cfg, x_TH=x_TH, topk_ids_TK=topk_ids_TK,
                                         topk_weights_TK=topk_weights_TK, bufs=self.bufs, ws=self.ws,
                                         out=self._recv_out, check=self.check, layout=layout)

    def combine_send(self, y_MH, handle):
        combine_k.combine_send(cfg=self.cfg, y_MH=y_MH, handle=handle, bufs=self.bufs, ws=self.ws)
        return handle

    def combine_recv(self, pending, out_dtype, add_TH=None):
        return combine_k.combine_recv(cfg=self.cfg, handle=pending, bufs=self.bufs, ws=self.ws,
                                      out_dtype=out_dtype, add_TH=add_TH, check=self.check)

    def combine_fused(self, y_MH, handle, out_dtype, add_TH=None):
        return combine_k.combine_fused(cfg=self.cfg, y_MH=y_MH, handle=handle, bufs=self.bufs, ws=self.ws,
                                 out_dtype=out_dtype, add_TH=add_TH, check=self.check)

    def check_status(self, what: str = "last round") -> None:
        check_status(self.ws, self.rank, what)

    def barrier(self) -> None:
        self._nvc.barrier_all(torch.cuda.current_stream())
        torch.cuda.synchronize()

    def device_barrier(self) -> None:
        self._nvc.sync_all(torch.cuda.current_stream())

    def shutdown(self) -> None:
        if not self._alive:
            return
        self._alive = False
        torch.cuda.synchronize()
        self.bufs = None  # drop the peer views before the memory goes
        self._nvc.barrier_all(torch.cuda.current_stream())
        torch.cuda.synchronize()
        self._nvc.free_tensor(self._block)
        self._block = None
        _runtime["transports"] -= 1
