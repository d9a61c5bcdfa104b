"""What every transport offers the worker: the dispatch and combine phases, split and fused.

A transport owns its communication state (process group or symmetric buffers) for one
rank. Split forms: ``*_send`` returns a pending object at once, ``*_recv`` completes it,
so expert compute can run in between; :meth:`Transport.dispatch` and
:meth:`Transport.combine` run both halves, in one launch where the backend has a fused form.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Iterator

import torch

from ..config import EPConfig
from ..types import DispatchHandle, DispatchLayout


class Transport(abc.ABC):
    """One rank's end of the expert-parallel exchange."""

    name: str = "abstract"

    def __init__(self, cfg: EPConfig, rank: int, device: torch.device):
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self._check = True

    @property
    def check(self) -> bool:
        """Whether a receive checks its device-side error flags at once (a host sync); False
        inside :meth:`deferred_checks`."""
        return self._check

    @contextlib.contextmanager
    def deferred_checks(self) -> Iterator[None]:
        """Inside this block receives only flag errors on the device (no host sync: hot loops,
        CUDA graphs); leaving it raises what they flagged (:meth:`check_status`)."""
        before = self._check
        self._check = False
        try:
            yield
        finally:
            self._check = before
        self.check_status()

    def check_status(self, what: str = "last round") -> None:
        """Raise the error a deferred receive flagged, naming ``what`` ran (transports that fail
        on the host: no-op)."""

    @abc.abstractmethod
    def dispatch_send(self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                      layout: DispatchLayout | None = None) -> Any:
        """Start sending this rank's tokens; returns what :meth:`dispatch_recv` needs.
        ``layout``: the send-side layout of an earlier dispatch of the same ``topk_ids_TK``
        (a backward pass sends gradient rows where the forward sent tokens: no layout pass)."""

    @abc.abstractmethod
    def dispatch_recv(self, pending: Any) -> DispatchHandle:
        """Wait for every source and return the expert-major receive description."""

    def dispatch_fused(self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                       layout: DispatchLayout | None = None) -> DispatchHandle:
        """Send and receive in one step (backends without a fused kernel run the two halves)."""
        return self.dispatch_recv(self.dispatch_send(x_TH, topk_ids_TK, topk_weights_TK, layout))

    def dispatch(self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 fused: bool = True, layout: DispatchLayout | None = None) -> DispatchHandle:
        """A whole dispatch: the fused form, or ``send`` then ``recv`` with ``fused=False``."""
        if fused:
            return self.dispatch_fused(x_TH, topk_ids_TK, topk_weights_TK, layout)
        return self.dispatch_recv(self.dispatch_send(x_TH, topk_ids_TK, topk_weights_TK, layout))

    @abc.abstractmethod
    def combine_send(self, y_MH: torch.Tensor, handle: DispatchHandle) -> Any:
        """Start returning expert outputs (expert-major rows of ``handle``) to their sources."""

    @abc.abstractmethod
    def combine_recv(self, pending: Any, out_dtype: torch.dtype, add_TH: torch.Tensor | None = None) -> torch.Tensor:
        """Wait for every rank's partial rows; return out_TH [T, H] (+ add_TH)."""

    def combine_fused(self, y_MH: torch.Tensor, handle: DispatchHandle, out_dtype: torch.dtype,
                      add_TH: torch.Tensor | None = None) -> torch.Tensor:
        """Send and receive in one step (backends without a fused kernel run the two halves)."""
        return self.combine_recv(self.combine_send(y_MH, handle), out_dtype, add_TH)

    def combine(self, y_MH: torch.Tensor, handle: DispatchHandle, out_dtype: torch.dtype,
                add_TH: torch.Tensor | None = None, fused: bool = True) -> torch.Tensor:
        """A whole combine: the fused form, or ``send`` then ``recv`` with ``fused=False``."""
        if fused:
            return self.combine_fused(y_MH, handle, out_dtype, add_TH)
        return self.combine_recv(self.combine_send(y_MH, handle), out_dtype, add_TH)

    def barrier(self) -> None:
        """Block the host until every rank got here."""

    def device_barrier(self) -> None:
        """Queue a barrier across ranks on the current stream (GPUs leave it together)."""
        self.barrier()

    def shutdown(self) -> None:
        """Release communication state; idempotent."""
