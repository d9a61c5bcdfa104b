"""Symmetric buffers and per-rank scratch as the kernels see them.

A rank's symmetric buffers live in one byte block laid out by :class:`~ray_ep.config.BufferPlan`
(identical on every rank). Kernels reach rank d's copy of a buffer at
``peer_bases[d] + plan[name].offset``; torch twins use typed views of the same bytes.
Who allocates the block (NVSHMEM on GPUs, plain tensors for the simulated world and the
CPU backend) is the transport's business, not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..config import BufferPlan, EPConfig
from ..errors import EPOverflowError, EPTimeoutError

TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp32": torch.float32,
    "int32": torch.int32,
    "int64": torch.int64,
    "u8": torch.uint8,  # nvfp4 wire rows: packed codes and block scales (ray_ep.nvfp4)
}

# status[0] bits written by the receive kernels; status[1 + s] = 1 when source s never signalled
STATUS_TIMEOUT = 1
STATUS_OVERFLOW = 2

# done-counter slots (one per kernel kind, so split kernels never share one)
COUNTER_DISPATCH_SEND, COUNTER_DISPATCH_RECV, COUNTER_COMBINE_SEND, COUNTER_COMBINE_RECV = range(4)
EPOCH_DISPATCH, EPOCH_COMBINE = 0, 1

# programs per SM a receive launch may have: each needs a private scratch row. The receive
# kernels spin on signals, so all their programs must be resident at once; at the 4 warps of
# a comm program an SM holds more, but 4 per SM already covers every SM several times over
# and keeps the scratch small (4 x 132 SMs x E int32)
RECV_PROGRAMS_PER_SM = 4


def typed_views(block: torch.Tensor, plan: BufferPlan) -> dict[str, torch.Tensor]:
    """Typed tensors over a rank's uint8 block, one per buffer of the plan."""
    if block.dtype != torch.uint8 or block.dim() != 1 or block.numel() < plan.total_bytes:
        raise ValueError(f"need a 1-D uint8 block of >= {plan.total_bytes} bytes, got "
                         f"{block.dtype} {tuple(block.shape)}")
    views = {}
    for b in plan.buffers:
        raw = block[b.offset:b.offset + b.nbytes]
        views[b.name] = raw.view(TORCH_DTYPES[b.dtype]).view(b.shape)
    return views


@dataclass(frozen=True)
class SymmetricBuffers:
    """One rank's handle on the symmetric buffers of the whole group.

    ``local``: typed views of this rank's own block. ``peers[d]``: typed views of rank d's
    block where this process can load/store it directly (same node), else None.
    ``peer_bases`` [R] int64 on the rank's device: base address of each rank's block for the
    kernels (0 where unreachable by stores).
    """

    plan: BufferPlan
    rank: int
    local: dict[str, torch.Tensor]
    peers: list[dict[str, torch.Tensor] | None]
    peer_bases: torch.Tensor

    @property
    def world_size(self) -> int:
        return len(self.peers)

    @property
    def device(self) -> torch.device:
        return self.peer_bases.device

    def offset(self, name: str) -> int:
        return self.plan[name].offset

    @cached_property
    def dispatch(self) -> "DispatchBuffers":
        return DispatchBuffers.of(self)

    @cached_property
    def combine(self) -> "CombineBuffers":
        return CombineBuffers.of(self)


@dataclass(frozen=True)
class DispatchBuffers:
    """The dispatch buffers as the kernels take them, by parameter name.

    Send side: the peer table and the byte offset of each buffer inside a rank's block
    (``off_*``: rows, fp8 scales, meta rows, per-source counts and signals of every
    destination; ``off_s*``: this rank's staging rows for puts to other nodes). Receive side:
    this rank's own signals, counts and meta rows.
    """

    peer_bases_ptr: torch.Tensor
    off_x: int
    off_scales: int  # 0 without fp8 (never read)
    off_meta: int
    off_counts: int
    off_signal: int
    off_sx: int
    off_ss: int  # 0 without fp8 (never read)
    off_sm: int
    off_scounts: int
    signal_ptr: torch.Tensor
    counts_ptr: torch.Tensor
    meta_ptr: torch.Tensor

    @classmethod
    def of(cls, bufs: SymmetricBuffers) -> "DispatchBuffers":
        fp8 = "dispatch.send.scales" in bufs.plan
        v = bufs.local
        return cls(peer_bases_ptr=bufs.peer_bases,
                   off_x=bufs.offset("dispatch.recv.x"),
                   off_scales=bufs.offset("dispatch.recv.scales") if fp8 else 0,
                   off_meta=bufs.offset("dispatch.recv.meta"),
                   off_counts=bufs.offset("dispatch.recv_count.counts"),
                   off_signal=bufs.offset("dispatch.recv_count.signal"),
                   off_sx=bufs.offset("dispatch.send.x"),
                   off_ss=bufs.offset("dispatch.send.scales") if fp8 else 0,
                   off_sm=bufs.offset("dispatch.send.meta"),
                   off_scounts=bufs.offset("dispatch.send.counts"),
                   signal_ptr=v["dispatch.recv_count.signal"], counts_ptr=v["dispatch.recv_count.counts"],
                   meta_ptr=v["dispatch.recv.meta"])

    def send_args(self) -> dict:
        return {k: getattr(self, k) for k in ("peer_bases_ptr", "off_x", "off_scales", "off_meta", "off_counts",
                                              "off_signal", "off_sx", "off_ss", "off_sm", "off_scounts")}

    def recv_args(self) -> dict:
        return {k: getattr(self, k) for k in ("signal_ptr", "counts_ptr", "meta_ptr")}


@dataclass(frozen=True)
class CombineBuffers:
    """The combine buffers as the kernels take them, by parameter name.

    Send side: the peer table, the offsets of the partial rows and signals in every rank's
    block, and of this rank's staging rows (``off_sx``) for puts to other nodes. Receive
    side: this rank's own signals and partial rows.
    """

    peer_bases_ptr: torch.Tensor
    off_x: int
    off_signal: int
    off_sx: int
    off_ready: int
    signal_ptr: torch.Tensor
    recv_ptr: torch.Tensor
    ready_ptr: torch.Tensor

    @classmethod
    def of(cls, bufs: SymmetricBuffers) -> "CombineBuffers":
        v = bufs.local
        return cls(peer_bases_ptr=bufs.peer_bases, off_x=bufs.offset("combine.recv.x"),
                   off_signal=bufs.offset("combine.recv_count.signal"), off_sx=bufs.offset("combine.send.x"),
                   off_ready=bufs.offset("combine.ready.signal"), signal_ptr=v["combine.recv_count.signal"],
                   recv_ptr=v["combine.recv.x"], ready_ptr=v["combine.ready.signal"])

    def send_args(self) -> dict:
        return {k: getattr(self, k) for k in ("peer_bases_ptr", "off_x", "off_signal", "off_sx")}

    def recv_args(self) -> dict:
        return {k: getattr(self, k) for k in ("signal_ptr", "recv_ptr")}

    def pull_args(self) -> dict:
        """The receive's extra arguments of combine_mode "pull" (the peers' rows and flags)."""
        return {k: getattr(self, k) for k in ("peer_bases_ptr", "off_x", "ready_ptr")}


@dataclass(frozen=True)
class Workspace:
    """Per-rank device scratch, allocated once and never cleared by the host.

    ``epochs`` [2] int64: completed rounds of dispatch and combine; a send of round n+1
    signals n+1 and the receive waits for signals >= n+1, so buffers never need clearing.
    ``counters`` [4] int32: programs finished, per kernel kind; the last program of a launch
    sends the signals (or advances the epoch) and resets its counter to 0.
    ``status`` [R + 1] int32: error bits and silent sources (see STATUS_*).
    ``scratch`` [programs, E] int32: a private table per program of a receive launch (rows:
    RECV_PROGRAMS_PER_SM per SM, which caps the programs of a receive launch).
    ``totals`` [E + R] int32: rows per expert and per destination rank, summed by the
    programs of a send that lays out its own tokens (small batches); its last program reads
    and re-zeroes them.
    """

    epochs: torch.Tensor
    counters: torch.Tensor
    status: torch.Tensor
    scratch: torch.Tensor
    totals: torch.Tensor

    @classmethod
    def allocate(cls, cfg: EPConfig, device: torch.device | str) -> "Workspace":
        from ._util import num_sms

        return cls(
            epochs=torch.zeros(2, dtype=torch.int64, device=device),
            counters=torch.zeros(4, dtype=torch.int32, device=device),
            status=torch.zeros(cfg.world_size + 1, dtype=torch.int32, device=device),
            scratch=torch.zeros(RECV_PROGRAMS_PER_SM * num_sms(device), cfg.n_experts, dtype=torch.int32,
                                device=device),
            totals=torch.zeros(cfg.n_experts + cfg.world_size, dtype=torch.int32, device=device),
        )


def check_status(ws: Workspace, rank: int, what: str) -> None:
    """Raise the error a receive kernel flagged (this syncs with the device)."""
    status = ws.status.tolist()
    if status[0] == 0:
        return
    flags = status[0]
    ws.status.zero_()
    if flags & STATUS_TIMEOUT:
        silent = [s for s, v in enumerate(status[1:]) if v]
        raise EPTimeoutError(
            f"{what}: rank(s) {silent} stayed silent: rank {rank} timed out waiting for their signal "
            f"(recv_timeout_s); a peer died, hung or runs another round. The group must be rebuilt."
        )
    if flags & STATUS_OVERFLOW:
        raise EPOverflowError(
            f"rank {rank}: {what} received more rows than its buffers hold (peers disagree on "
            f"the config?); nothing was written past the buffers, but this round's output is invalid"
        )


def new_block(cfg: EPConfig | BufferPlan, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed uint8 block for one rank (the CPU / simulated-world stand-in for NVSHMEM)."""
    from ..config import plan_buffers

    plan = cfg if isinstance(cfg, BufferPlan) else plan_buffers(cfg)
    return torch.zeros(plan.total_bytes, dtype=torch.uint8, device=device)
