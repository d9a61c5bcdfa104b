"""The ``torch`` backend: dispatch and combine over torch.distributed all_to_all_single.

gloo on CPU (a laptop or CI runs the whole system), NCCL on GPUs, where it is the baseline
("NCCL pipeline") the benchmarks compare against: layout, permute rows by destination,
exchange counts, all_to_all_single of rows and meta, expert-major layout on the receiver;
then partial sums per (token, rank), all_to_all_single back, sum per token.

Rows travel as raw bytes (gloo has no bf16/fp8 reductions to offer and needs none).

Bounded waits (gloo): the group the EPWorker creates gets ``recv_timeout_s`` for its
collectives once its communicator is up (the rendezvous keeps ``init_timeout_s``); a group you
create and hand to an :class:`~ray_ep.communicator.EPCommunicator` keeps the timeout you gave
it. A collective that a peer does not join in time raises :class:`~ray_ep.errors.EPTimeoutError`
(gloo's own error names no rank); one that breaks because a peer gave up or died raises
:class:`~ray_ep.errors.EPWorkerError`. Either way the process group is closed (gloo:
"Application timeout caused pair closure") and the group must be rebuilt; the driver names the
ranks that stayed silent (those still running).

On NCCL (the GPU baseline) the group keeps ``init_timeout_s``: NCCL collectives return to
the host at once and a timeout is handled by NCCL's watchdog, which tears the waiting
worker's process down (the driver then reports a dead rank); a shorter limit there would
also cut the first, compiling rounds of a cold Triton cache on a slow rank.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import FP8_GROUP, NVFP4_BLOCK, EPConfig
from ..errors import EPInputError, EPTimeoutError, EPWorkerError
from ..fp8 import quantize_fp8_torch
from ..nvfp4 import quantize_nvfp4_torch
from ..kernels.combine import combine_partials_torch, combine_sum_torch
from ..kernels.dispatch import expert_major_torch, pack_meta_torch
from ..kernels.layout import compute_layout, compute_layout_torch
from ..kernels.nvfp4 import quantize_nvfp4
from ..kernels.quant import quantize_fp8
from ..types import DispatchHandle, DispatchLayout
from ..validation import check_send_inputs
from .base import Transport


@dataclass
class _PendingDispatch:
    layout: DispatchLayout
    counts_RL1: torch.Tensor
    recv_splits: list[int]
    rows: torch.Tensor
    scales: torch.Tensor | None
    meta: torch.Tensor
    works: list
    num_tokens: int
    weights: torch.Tensor | None


@dataclass
class _PendingCombine:
    handle: DispatchHandle
    rows: torch.Tensor
    work: object


WIRE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}  # combine rows


def _exclusive_cumsum(splits: list[int], device: torch.device) -> torch.Tensor:
    out, acc = [], 0
    for s in splits:
        out.append(acc)
        acc += s
    return torch.tensor(out, dtype=torch.int64, device=device)


class TorchTransport(Transport):
    """all_to_all_single over a torch.distributed process group (gloo or NCCL)."""

    name = "torch"

    def __init__(self, cfg: EPConfig, rank: int, device: torch.device, group: dist.ProcessGroup | None = None):
        """Runs over ``group`` (default: the process's WORLD group), which its owner (the
        :class:`~ray_ep.communicator.EPCommunicator`'s caller) created and destroys."""
        super().__init__(cfg, rank, device)
        self.group = group if group is not None else dist.group.WORLD
        # Triton layout kernel on GPUs (fast), its torch twin on CPUs (no interpreter cost)
        self._layout = compute_layout if device.type == "cuda" else compute_layout_torch
        on_gpu = device.type == "cuda"
        self._quant = {"fp8": quantize_fp8 if on_gpu else quantize_fp8_torch,
                       "nvfp4": quantize_nvfp4 if on_gpu else quantize_nvfp4_torch}.get(cfg.dispatch_dtype)

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
             async_op: bool = False, what: str = "dispatch"):
        # raw bytes: [rows, bytes per row]
        o = out.view(torch.uint8).view(out.shape[0], out.shape[1] * out.element_size())
        i = inp.contiguous().view(torch.uint8).view(inp.shape[0], inp.shape[1] * inp.element_size())
        with self._collective(what):
            return dist.all_to_all_single(o, i, out_splits, in_splits, group=self.group, async_op=async_op)

    @contextlib.contextmanager
    def _collective(self, what: str):
        """Turn a collective's failure into ray_ep's errors (module docstring)."""
        try:
            yield
        except RuntimeError as e:  # gloo and NCCL raise RuntimeError (DistBackendError is one)
            text = str(e)
            peers = [r for r in range(self.cfg.world_size) if r != self.rank]
            who = f"rank {peers[0]}" if len(peers) == 1 else f"one or more of ranks {peers}"
            if "Timed out" in text or "timed out" in text:
                raise EPTimeoutError(
                    f"rank {self.rank}: {what} ({self.group_backend}) timed out after recv_timeout_s = "
                    f"{self.cfg.recv_timeout_s:g} s: {who} did not take part (stalled, dead, slow in earlier "
                    f"work or in another call). The group must be rebuilt") from e
            if "closed" in text or "Connection" in text or "pair" in text or "abort" in text.lower():
                raise EPWorkerError(
                    f"rank {self.rank}: {what} ({self.group_backend}) broke: {text.splitlines()[0][-200:]}; "
                    f"{who} gave up, died or timed out. The group must be rebuilt") from e
            raise

    def _wait(self, work, what: str) -> None:
        with self._collective(what):
            work.wait()

    @property
    def group_backend(self) -> str:
        return str(dist.get_backend(self.group))

    def dispatch_send(self, x_TH, topk_ids_TK, topk_weights_TK, layout: DispatchLayout | None = None
                      ) -> _PendingDispatch:
        cfg, R, L, H = self.cfg, self.cfg.world_size, self.cfg.experts_per_rank, self.cfg.hidden_size
        check_send_inputs(cfg, x_TH, topk_ids_TK, topk_weights_TK, self.device)
        if layout is None:
            layout = self._layout(topk_ids_TK=topk_ids_TK, world_size=R, experts_per_rank=L)
        # counts for each destination: [rows, rows per local expert of that destination]
        send_counts = torch.cat([layout.rank_counts_R[:, None], layout.expert_counts_E.view(R, L)], dim=1)
        counts = torch.empty_like(send_counts)
        self._a2a(counts, send_counts, [1] * R, [1] * R, what="dispatch (counts)")
        in_splits = layout.rank_counts_R.tolist()
        recv_splits = counts[:, 0].tolist()
        # permute: destination-major, token order inside (= slot order)
        slots = layout.token_slots_TR
        order = [torch.nonzero(slots[:, d] >= 0).flatten() for d in range(R)]
        idx = torch.cat(order) if order else torch.empty(0, dtype=torch.int64, device=self.device)
        rows, scales = self._quant(x_TH=x_TH) if self._quant else (x_TH, None)
        meta = pack_meta_torch(topk_ids_TK, layout.ordinals_TK, topk_weights_TK)
        n_in = sum(recv_splits)
        r_rows = torch.empty(n_in, rows.shape[1], dtype=rows.dtype, device=self.device)  # nvfp4: H / 2 bytes
        r_meta = torch.empty(n_in, 3 * cfg.top_k, dtype=torch.int32, device=self.device)
        works = [self._a2a(r_rows, rows[idx], recv_splits, in_splits, async_op=True),
                 self._a2a(r_meta, meta[idx], recv_splits, in_splits, async_op=True)]
        r_scales = None
        if scales is not None:  # fp8: [H / 128] fp32; nvfp4: [H / 16] e4m3
            group = FP8_GROUP if cfg.dispatch_dtype == "fp8" else NVFP4_BLOCK
            r_scales = torch.empty(n_in, H // group, dtype=scales.dtype, device=self.device)
            works.append(self._a2a(r_scales, scales[idx], recv_splits, in_splits, async_op=True))
        r_weights = None
        if topk_weights_TK.dtype == torch.float64:  # fp32 bits in the meta rows would round them
            r_weights = torch.empty(n_in, cfg.top_k, dtype=torch.float64, device=self.device)
            works.append(self._a2a(r_weights, topk_weights_TK[idx], recv_splits, in_splits, async_op=True))
        return _PendingDispatch(layout, counts, recv_splits, r_rows, r_scales, r_meta, works, x_TH.shape[0],
                                r_weights)

    def dispatch_recv(self, pending: _PendingDispatch) -> DispatchHandle:
        for w in pending.works:
            self._wait(w, "dispatch")
        row_base = _exclusive_cumsum(pending.recv_splits, self.device)
        recv = expert_major_torch(cfg=self.cfg, rank=self.rank, counts_RL1=pending.counts_RL1,
                                meta_rows=pending.meta, row_base_R=row_base)
        return DispatchHandle(pending.layout, recv, pending.rows, pending.scales, pending.meta, pending.num_tokens,
                              pending.weights)

    def combine_send(self, y_MH, handle: DispatchHandle) -> _PendingCombine:
        cfg = self.cfg
        if y_MH.shape[1] != cfg.hidden_size:
            raise EPInputError(f"y_MH must have {cfg.hidden_size} channels, got {tuple(y_MH.shape)}")
        in_splits = handle.recv.recv_counts_R.tolist()
        row_base = _exclusive_cumsum(in_splits, self.device)
        parts = combine_partials_torch(cfg=cfg, rank=self.rank, y_MH=y_MH, src_offsets_RL=handle.recv.src_offsets_RL,
                                     counts_R=handle.recv.recv_counts_R, meta_rows=handle.meta_rows,
                                     row_base_R=row_base, weights_rows=handle.weights_rows)
        wire = WIRE_DTYPES[cfg.combine_dtype]
        send = torch.cat(parts).to(wire) if parts else torch.empty(0, cfg.hidden_size, dtype=wire, device=self.device)
        out_splits = handle.layout.rank_counts_R.tolist()
        rows = torch.empty(sum(out_splits), cfg.hidden_size, dtype=wire, device=self.device)
        work = self._a2a(rows, send, out_splits, in_splits, async_op=True, what="combine")
        return _PendingCombine(handle, rows, work)

    def combine_recv(self, pending: _PendingCombine, out_dtype, add_TH=None) -> torch.Tensor:
        self._wait(pending.work, "combine")
        h = pending.handle
        row_base = _exclusive_cumsum(h.layout.rank_counts_R.tolist(), self.device)
        return combine_sum_torch(rows_MH=pending.rows, row_base_R=row_base, token_slots_TR=h.layout.token_slots_TR,
                               out_dtype=out_dtype, add_TH=add_TH)

    def barrier(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        with self._collective("barrier"):
            dist.barrier(group=self.group)

    def device_barrier(self) -> None:
        if self.device.type != "cuda":
            return self.barrier()
        # a one-element all-reduce on the current stream: the GPUs leave it together
        if not hasattr(self, "_one"):
            self._one = torch.ones(1, device=self.device)
        with self._collective("device barrier"):
            dist.all_reduce(self._one, group=self.group)
