"""An MoE layer's phases in an order that lets them overlap on a GPU.

:func:`moe_layer` (one transport): the shared experts need only the rank's own tokens, so
they run on a side stream from the start, beside the dispatch (which in decode mostly waits
on its peers) and the routed experts, under an SM budget on the SMs the dispatch leaves; the
combine adds them once both streams meet::

    caller's stream: dispatch | routed experts | (join) combine + shared
    side stream:     shared experts |

:func:`moe_micro_batched`: a rank's tokens are cut into ``n`` micro-batches, each with its own
transport (its own symmetric buffers and epochs) and its own expert scratch. On a GPU the
communication runs on a side stream and the experts on the caller's stream:

    comm stream:    dispatch 0 | dispatch 1 | ...  | combine 0 (after experts 0) | combine 1 ...
    compute stream: shared experts | experts 0      | experts 1 (after d 1)      | ...

so the dispatches fly while the shared experts compute, and combine 0 while experts 1
compute. Under an SM budget the GEMMs beside communication leave its SMs free, the shared
experts take every token in one pass, and experts 0, with nothing beside it once the
dispatches are done (it waits for them when there are shared experts to cover them), takes
every SM. With ``combine_mode`` "pull", each micro-batch's partial rows are formed on the
compute stream after its experts; the comm stream loads and sums them.

It pays when the communication kernels run on a few SMs (``num_sms``) and leave the rest to
the GEMMs, and when the host's launches do not hold it up: replay it from a CUDA graph
(``EPCommunicator.moe(..., cuda_graph=True)``). Launched from Python on a 4x H200 host it
took 5.3 ms at 24 SMs and 7.2 ms with every SM where its graph took 4.7 (deepseek-v3 prefill,
fp8). Either output equals the serial layer's: every token's experts and weights are the
same, only the order of the work changes. On CPU (no streams) the same schedules run in order.

Collective: every rank calls it with the same ``n`` (with 0 tokens if it has none); the
micro-batch transports see their collectives in the same order on every rank (dispatch 0 .. n-1,
then combine 0 .. n-1).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from .kernels._util import num_sms, side_stream
from .kernels.experts import ExpertScratch, LocalExperts, run_experts, shared_experts
from .transport.base import Transport
from .types import DispatchHandle


def micro_batch_bounds(num_tokens: int, parts: int) -> list[tuple[int, int]]:
    """Row ranges of ``parts`` micro-batches, the first ones one row longer when T does not
    divide. Example: 5 tokens in 2 -> [(0, 3), (3, 5)]; 0 tokens -> [(0, 0), (0, 0)]."""
    base, extra = divmod(num_tokens, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def gemm_sms_beside(budget: int | None, device: torch.device) -> int | None:
    """The programs a persistent grouped GEMM takes while communication kernels hold ``budget``
    SMs: the SMs they leave, so they never wait for the GEMM to finish, whatever order its
    blocks and theirs reach the SMs in (a CUDA graph's replay keeps no launch order between
    streams). None (one program per SM) without a budget or with one of every SM."""
    sms = num_sms(device)
    return sms - budget if budget and budget < sms else None


def _deferring(transports: Sequence[Transport]) -> contextlib.ExitStack:
    """Defer the transports' receive checks to the end of a layer: no host sync between the
    phases, so the streams run ahead (a caller already deferring, e.g. a benchmark loop or a
    CUDA graph capture, checks later itself)."""
    checks = contextlib.ExitStack()
    for t in transports:
        if t.check:
            checks.enter_context(t.deferred_checks())
    return checks


def moe_layer(t: Transport, scratch: ExpertScratch, experts: LocalExperts, x_TH: torch.Tensor,
              topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
              fused: bool = True) -> tuple[torch.Tensor, DispatchHandle]:
    """One MoE layer (routed experts + shared experts) on one transport: (out [T, H]
    ``out_dtype`` on the caller's stream, the handle of its dispatch). On a GPU the shared
    experts run on a side stream beside the dispatch and the routed experts (see the module
    docstring). Receives flag errors on the device; unless the caller defers the checks itself,
    the dispatch's error (a silent peer, an overflow) is raised before the combine, once the
    routed experts are launched (the host waits there, not between dispatch and experts), and
    the combine's at the end."""
    if x_TH.device.type != "cuda":
        h = t.dispatch(x_TH, topk_ids_TK, topk_weights_TK, fused=fused)
        y = run_experts(handle=h, experts=experts, scratch=scratch)
        return t.combine(y, h, out_dtype, shared_experts(x_TH, experts), fused=fused), h
    main = torch.cuda.current_stream(x_TH.device)
    inputs_ready = torch.cuda.Event()
    inputs_ready.record(main)
    # allocated on the stream that reads it after the join: no cross-stream lifetime to track
    add = (torch.empty(x_TH.shape, dtype=experts.shared_sum_dtype, device=x_TH.device)
           if experts.shared_down_SFH.shape[0] else None)
    checking = t.check
    with _deferring([t]):
        h = t.dispatch(x_TH, topk_ids_TK, topk_weights_TK, fused=fused)
        if add is not None:
            # launched after the dispatch, so its blocks reach the SMs first; under a budget on
            # the SMs the dispatch leaves (one H200, a stand-in dispatch on 24 SMs: the same time
            # as on every SM, and a graph's replay cannot make the dispatch wait for it)
            side = side_stream(x_TH.device)
            side.wait_event(inputs_ready)
            with torch.cuda.stream(side):
                shared_experts(x_TH, experts, out=add, num_sms=gemm_sms_beside(t.cfg.num_sms, x_TH.device))
        y = run_experts(handle=h, experts=experts, scratch=scratch)
        if add is not None:
            main.wait_stream(side)
        if checking:  # a failed dispatch ends the layer here, not after the combine waits out a timeout too
            t.check_status("dispatch")
        return t.combine(y, h, out_dtype, add, fused=fused), h


def moe_micro_batched(transports: Sequence[Transport], scratches: Sequence[ExpertScratch], experts: LocalExperts,
                      x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                      out_dtype: torch.dtype = torch.bfloat16, fused: bool = True) -> torch.Tensor:
    """One MoE layer (routed experts + shared experts) over ``len(transports)`` micro-batches;
    out [T, H] ``out_dtype`` on the caller's stream. Receives flag errors on the device while
    the layer runs; the error (timeout, overflow) is raised at the end (a host sync), unless
    the caller defers the checks itself (``Transport.deferred_checks``)."""
    if len(transports) != len(scratches) or not transports:
        raise ValueError(f"one scratch per micro-batch transport: got {len(transports)} transports and "
                         f"{len(scratches)} scratches")
    T, H = x_TH.shape
    bounds = micro_batch_bounds(T, len(transports))
    parts = [(x_TH[a:b], topk_ids_TK[a:b], topk_weights_TK[a:b]) for a, b in bounds]
    out = torch.empty(T, H, dtype=out_dtype, device=x_TH.device)
    with _deferring(transports):
        if x_TH.device.type != "cuda":
            handles = [t.dispatch(*p, fused=fused) for t, p in zip(transports, parts)]
            for (a, b), t, h, s, p in zip(bounds, transports, handles, scratches, parts):
                y = run_experts(handle=h, experts=experts, scratch=s)
                out[a:b] = t.combine(y, h, out_dtype, shared_experts(p[0], experts), fused=fused)
            return out
        compute = torch.cuda.current_stream(x_TH.device)
        comm = side_stream(x_TH.device)
        comm.wait_stream(compute)  # the inputs (and the buffers' last users) are ready
        handles, dispatched = [], []
        with torch.cuda.stream(comm):
            for t, p in zip(transports, parts):
                handles.append(t.dispatch(*p, fused=fused))
                dispatched.append(torch.cuda.Event())
                dispatched[-1].record(comm)
        budget = transports[0].cfg.num_sms
        gemm_sms = gemm_sms_beside(budget, x_TH.device)
        # the shared experts need no dispatch: they compute while the dispatches fly; under a
        # budget in one pass over every token on the SMs it leaves (two half passes took 1.5x
        # as long there), without one a half at a time (4x H200, from graphs: one pass 4880
        # us against 4655 beside every-SM dispatches)
        # Under a budget experts 0 has no combine beside it: once the dispatches (beside the
        # shared experts) are done it takes every SM, as later ones cannot (combine i - 1 runs
        # beside experts i); with no shared experts to cover them it goes beside the dispatches.
        if gemm_sms is None:
            adds = [shared_experts(p[0], experts) for p in parts]
            whole_first = False
        else:
            add = shared_experts(x_TH, experts, num_sms=gemm_sms)
            adds = [None if add is None else add[a:b] for a, b in bounds]
            whole_first = add is not None
        # combine_mode "pull": forming the partial rows is expert-side work (on the SMs the budget
        # leaves), so it follows the experts on the compute stream; the comm stream loads and sums
        pull = transports[0].cfg.combine_mode == "pull"
        # under a budget the receive may start before its rows are formed (it loads each block
        # once flagged, on its SMs, while the rest form them); without one its programs would
        # fill every SM first and wait for rows that could then never be formed
        early = pull and budget is not None and budget < num_sms(x_TH.device)
        ys, computed = [], []
        if whole_first:
            compute.wait_event(dispatched[-1])
        for i, (t, h, s, ev) in enumerate(zip(transports, handles, scratches, dispatched)):
            compute.wait_event(ev)
            y = run_experts(handle=h, experts=experts, scratch=s,
                            num_sms=None if whole_first and i == 0 else gemm_sms)
            if pull and not early:
                y = t.combine_send(y, h)  # before the event: the receive waits for the whole pass
            computed.append(torch.cuda.Event())
            computed[-1].record(compute)
            if early:
                y = t.combine_send(y, h)
            ys.append(y)  # pull: the pending receive instead of the expert outputs
        with torch.cuda.stream(comm):
            for (a, b), t, h, y, shared, ev in zip(bounds, transports, handles, ys, adds, computed):
                comm.wait_event(ev)
                if pull:
                    out[a:b] = t.combine_recv(y, out_dtype, shared)
                else:
                    out[a:b] = t.combine(y, h, out_dtype, shared, fused=fused)
        compute.wait_stream(comm)
        return out
