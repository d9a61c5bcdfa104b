"""What every transport offers the worker: the dispatch and combine phases, split and fused.

A transport owns its communication state (process group or symmetric buffers) for one
rank. Split forms: ``*_send`` returns a pending object at once, ``*_recv`` completes it,
so expert compute can run in between; fused forms do both in one call.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from ..config import EPConfig
from ..kernels.dispatch import DispatchHandle


class Transport(abc.ABC):
    """One rank's end of the expert-parallel exchange."""

    name: str = "abstract"

    def __init__(self, cfg: EPConfig, rank: int, device: torch.device):
        self.cfg = cfg
        self.rank = rank
        self.device = device
        # receive kernels that may flag errors on the device: True checks (a host sync) after
        # each receive; False defers it to check_status() (hot loops, CUDA graphs)
        self.check = True

    def check_status(self) -> None:
        """Raise the error a deferred receive flagged (transports that fail on the host: no-op)."""

    @abc.abstractmethod
    def dispatch_send(self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> Any:
        """Start sending this rank's tokens; returns what :meth:`dispatch_recv` needs."""

    @abc.abstractmethod
    def dispatch_recv(self, pending: Any) -> DispatchHandle:
        """Wait for every source and return the expert-major receive description."""

    def dispatch(self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> DispatchHandle:
        return self.dispatch_recv(self.dispatch_send(x_TH, topk_ids_TK, topk_weights_TK))

    @abc.abstractmethod
    def combine_send(self, y_MH: torch.Tensor, handle: DispatchHandle) -> Any:
        """Start returning expert outputs (expert-major rows of ``handle``) to their sources."""

    @abc.abstractmethod
    def combine_recv(self, pending: Any, out_dtype: torch.dtype, add_TH: torch.Tensor | None = None) -> torch.Tensor:
        """Wait for every rank's partial rows; return out_TH [T, H] (+ add_TH)."""

    def combine(self, y_MH: torch.Tensor, handle: DispatchHandle, out_dtype: torch.dtype,
                add_TH: torch.Tensor | None = None) -> torch.Tensor:
        return self.combine_recv(self.combine_send(y_MH, handle), out_dtype, add_TH)

    def barrier(self) -> None:
        """Block the host until every rank got here."""

    def device_barrier(self) -> None:
        """Queue a barrier across ranks on the current stream (GPUs leave it together)."""
        self.barrier()

    def shutdown(self) -> None:
        """Release communication state; idempotent."""
