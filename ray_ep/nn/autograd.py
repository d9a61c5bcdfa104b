"""Differentiable dispatch, experts and combine over an :class:`~ray_ep.communicator.EPCommunicator`.

Legend: T tokens on this rank, K top-k, H hidden size, F expert intermediate size, L local
experts, S shared experts, M expert-major rows this rank received (padding included).

Forward, on every rank at once::

    x_MH, d = dispatch(comm, x_TH, topk_ids_TK, topk_weights_TK)    # rows expert-major
    y_MH = swiglu_experts(x_MH, d, w_gate_up_LHF2, w_down_LFH)      # any differentiable experts
    out_TH = combine(y_MH, d)                                        # sum_k w[t, k] * y[t, k]

Backward (also collective: every rank runs its backward in the same order):

- of dispatch (``x_MH[m] = x[token of m]``): every expert-major row's gradient goes back to
  its token and the copies of a token add up: a combine with unit weights.
- of combine: ``dL/dy[m] = w(m) * dL/dout[token of m]``, so the gradient rows go where the
  tokens went: a dispatch of ``dL/dout`` that reuses the forward's send layout (no second
  layout pass), scaled on the receiver by each row's router weight. The router weights'
  gradient ``dL/dw[t, k] = <dL/dout[t], y[t, k]>`` is a dot product on the rank holding
  expert ``k`` of ``t``; it goes back to ``t`` in column ``k`` of a combine with unit weights
  (one more combine, only when the weights need a gradient).

Each dispatch keeps a copy of its layouts and meta rows (:meth:`DispatchHandle.kept`), so
later layers' dispatches may reuse the buffers before this layer's backward runs.
Precision follows the config's wire dtypes: gradient rows travel like activations (use
bf16, not fp8, dispatch for training); fp64 on the torch backend is exact enough for
``torch.autograd.gradcheck``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch
import torch.nn.functional as F

from ..communicator import EPCommunicator
from ..errors import EPConfigError, EPInputError
from ..types import DispatchHandle


@dataclass(frozen=True)
class Dispatched:
    """What a differentiable dispatch leaves for its combine and for both backward passes.

    ``handle`` holds the layouts and meta rows (not the rows); ``topk_ids_TK`` and
    ``sent_weights_TK`` are the ids and weights as sent; ``topk_weights_TK`` is the caller's
    (autograd) tensor, so the combine's gradient reaches it; ``num_rows`` is M.
    """

    comm: EPCommunicator
    handle: DispatchHandle
    topk_ids_TK: torch.Tensor
    sent_weights_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    num_rows: int
    x_dtype: torch.dtype
    fused: bool

    @cached_property
    def segments(self) -> list[tuple[int, int, int]]:
        """(first row, real rows, padded rows) of each local expert's segment (one host sync)."""
        r = self.handle.recv
        offsets, counts = r.row_offsets_L1.tolist(), r.num_tokens_L.tolist()
        return [(offsets[e], counts[e], offsets[e + 1] - offsets[e]) for e in range(len(counts))]

    @cached_property
    def row_slots_M(self) -> torch.Tensor:
        """The top-k slot k of each expert-major row's (token, k) (0 for padding rows), int64."""
        return self._row_slots_and_valid[0]

    @cached_property
    def row_weights_M(self) -> torch.Tensor:
        """The router weight of each expert-major row, in the activations' dtype (0 for padding)."""
        k, valid, j = self._row_slots_and_valid
        w = self.handle.router_weights(self.comm.config.top_k)[j].gather(1, k[:, None])[:, 0]
        return torch.where(valid, w, 0).to(self.x_dtype)

    @cached_property
    def _row_slots_and_valid(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, r = self.comm.config, self.handle.recv
        M, K = self.num_rows, cfg.top_k
        dev = r.row_ids_M.device
        rows = r.row_ids_M[:M].long()
        valid = rows >= 0
        j = rows.clamp(min=0)
        m = torch.arange(M, device=dev)
        # local expert of row m: segments end at row_offsets[1:], so count the ends at or before m
        local = torch.searchsorted(r.row_offsets_L1[1:].long(), m, right=True)
        expert = self.comm.rank * cfg.experts_per_rank + local
        k = (self.handle.meta_rows[j, :K].long() == expert[:, None]).int().argmax(dim=1)
        return torch.where(valid, k, 0), valid, j

    @cached_property
    def unit_handle(self) -> DispatchHandle:
        """The handle with every router weight 1: a combine through it sums a token's rows."""
        K = self.comm.config.top_k
        meta = self.handle.meta_rows.clone()
        meta[:, 2 * K:] = torch.ones(1, dtype=torch.float32, device=meta.device).view(torch.int32)
        w = self.handle.weights_rows
        return replace(self.handle, meta_rows=meta, weights_rows=None if w is None else torch.ones_like(w))

    def combine_input(self, y_MH: torch.Tensor) -> torch.Tensor:
        """y_MH as the combine takes it: the nvshmem kernels read up to ``max_recv_rows`` rows."""
        y = y_MH.contiguous()
        cap = self.comm.config.max_recv_rows
        if self.comm.backend == "nvshmem" and y.shape[0] < cap:
            y = torch.cat([y, y.new_zeros(cap - y.shape[0], y.shape[1])])
        return y


class _Dispatch(torch.autograd.Function):
    """x_TH -> x_MH (the rows of a finished dispatch, expert-major); backward: unit combine."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, live: DispatchHandle, d: Dispatched) -> torch.Tensor:
        ctx.d = d
        return live.expert_major_rows(d.num_rows, dtype=d.x_dtype)

    @staticmethod
    def backward(ctx, grad_MH: torch.Tensor):
        d: Dispatched = ctx.d
        grad_x = d.comm.combine(d.combine_input(grad_MH.to(d.x_dtype)), d.unit_handle, out_dtype=d.x_dtype,
                                fused=d.fused)
        return grad_x, None, None


class _Combine(torch.autograd.Function):
    """(y_MH, topk_weights_TK, add_TH) -> out_TH = sum_k w[t, k] y[t, k] + add[t]."""

    @staticmethod
    def forward(ctx, y_MH: torch.Tensor, topk_weights_TK: torch.Tensor, add_TH: torch.Tensor | None,
                d: Dispatched) -> torch.Tensor:
        ctx.d = d
        ctx.has_add = add_TH is not None
        ctx.save_for_backward(y_MH)
        add = None if add_TH is None else add_TH.detach().to(d.x_dtype).contiguous()
        return d.comm.combine(d.combine_input(y_MH.detach()), d.handle, out_dtype=d.x_dtype, add_TH=add,
                              fused=d.fused)

    @staticmethod
    def backward(ctx, grad_TH: torch.Tensor):
        d: Dispatched = ctx.d
        (y_MH,) = ctx.saved_tensors
        comm = d.comm
        # the gradient rows go where the tokens went (the forward's send layout)
        back = comm.dispatch(grad_TH.contiguous(), d.topk_ids_TK, d.sent_weights_TK, fused=d.fused, validate=False,
                             layout=d.handle.layout)
        g_MH = back.expert_major_rows(d.num_rows, dtype=y_MH.dtype)
        grad_y = g_MH * d.row_weights_M[:, None].to(y_MH.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            K, H = comm.config.top_k, comm.config.hidden_size
            if K > H:
                raise EPConfigError(f"the router weights' gradient travels in the first top_k columns of a "
                                    f"combine: top_k = {K} must be <= hidden_size = {H}")
            dots = (g_MH * y_MH.detach()).sum(dim=1)  # [M]: dL/dw of each row's (token, k)
            z_MH = torch.zeros_like(g_MH)
            z_MH[torch.arange(d.num_rows, device=z_MH.device), d.row_slots_M] = dots
            w = d.topk_weights_TK
            grad_w = comm.combine(d.combine_input(z_MH), d.unit_handle, out_dtype=w.dtype, fused=d.fused)[:, :K]
        return grad_y, grad_w, grad_TH if ctx.has_add else None, None


def dispatch(comm: EPCommunicator, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
             *, fused: bool = True, validate: bool = True) -> tuple[torch.Tensor, Dispatched]:
    """Differentiable dispatch (collective). Returns x_MH [M, H] in x's dtype, local expert i
    owning rows ``d.segments[i]``, and the :class:`Dispatched` that :func:`combine` needs.
    ``topk_weights_TK`` is what :func:`combine` weights the experts' outputs with; its
    gradient comes from there."""
    x, ids, w = comm.prepare_inputs(x_TH.detach(), topk_ids_TK, topk_weights_TK.detach(), validate)
    live = comm.dispatch(x, ids, w, fused=fused, validate=False)
    d = Dispatched(comm, live.kept(), ids, w, topk_weights_TK, int(live.recv.row_offsets_L1[-1]), x_TH.dtype, fused)
    return _Dispatch.apply(x_TH, live, d), d


def combine(y_MH: torch.Tensor, d: Dispatched, *, add_TH: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable combine (collective): out_TH [T, H] = sum_k w[t, k] * y[row of (t, k)]
    (+ add_TH), in x's dtype; gradients reach y_MH, the router weights and add_TH."""
    if y_MH.shape != (d.num_rows, d.comm.config.hidden_size):
        raise EPInputError(f"y_MH must be [M={d.num_rows}, H={d.comm.config.hidden_size}] (the dispatch's "
                           f"expert-major rows), got {tuple(y_MH.shape)}")
    return _Combine.apply(y_MH, d.topk_weights_TK, add_TH, d)


def swiglu(x_NH: torch.Tensor, w_gate_up_HF2: torch.Tensor, w_down_FH: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert, ``(silu(x @ Wg) * (x @ Wu)) @ Wd`` with ``[Wg | Wu] = w_gate_up``."""
    gate, up = (x_NH @ w_gate_up_HF2).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_down_FH


def swiglu_experts(x_MH: torch.Tensor, d: Dispatched, w_gate_up_LHF2: torch.Tensor,
                   w_down_LFH: torch.Tensor) -> torch.Tensor:
    """This rank's L SwiGLU experts over their segments of x_MH (padding rows give 0), with
    plain differentiable torch GEMMs (one per expert). Returns y_MH [M, H]."""
    pieces = []
    for e, (first, n, padded) in enumerate(d.segments):
        if n:
            pieces.append(swiglu(x_MH[first:first + n], w_gate_up_LHF2[e], w_down_LFH[e]))
        if padded > n:
            pieces.append(x_MH.new_zeros(padded - n, x_MH.shape[1]))
    return torch.cat(pieces) if pieces else x_MH.new_zeros(0, x_MH.shape[1])


def moe(comm: EPCommunicator, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
        w_gate_up_LHF2: torch.Tensor, w_down_LFH: torch.Tensor, shared_gate_up_SHF2: torch.Tensor | None = None,
        shared_down_SFH: torch.Tensor | None = None, *, fused: bool = True, validate: bool = True) -> torch.Tensor:
    """One differentiable MoE layer (collective): dispatch, this rank's L routed experts,
    combine, plus the S shared experts over this rank's own tokens. out_TH [T, H]."""
    x_MH, d = dispatch(comm, x_TH, topk_ids_TK, topk_weights_TK, fused=fused, validate=validate)
    y_MH = swiglu_experts(x_MH, d, w_gate_up_LHF2, w_down_LFH)
    shared = None
    if shared_gate_up_SHF2 is not None and shared_gate_up_SHF2.shape[0]:
        shared = sum(swiglu(x_TH, shared_gate_up_SHF2[s], shared_down_SFH[s])
                     for s in range(shared_gate_up_SHF2.shape[0]))
    return combine(y_MH, d, add_TH=shared)
