"""The results that travel between layers during one dispatch / combine round.

Legend: T tokens on this rank, K top-k, E experts, R ranks, L = E / R local experts,
H hidden, N = N_max, M expert-major rows (capacity: EPConfig.max_recv_rows), G = H / 128.

A send produces a :class:`DispatchLayout` (where this rank's tokens go), a receive a
:class:`RecvLayout` (how the arrived rows form expert-major segments), and a
:class:`DispatchHandle` bundles both with the received rows for the experts and the combine.
Every backend (Triton kernels, their torch twins, the torch.distributed pipeline) returns these.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from .config import EPConfig
from .fp8 import dequantize_fp8_torch
from .nvfp4 import dequantize_nvfp4_torch


@dataclass(frozen=True)
class DispatchLayout:
    """Send-side layout of one dispatch (all int32, on the tokens' device).

    ``token_slots_TR`` [T, R]: row of token t in rank d's receive region for this source, -1
    when none of t's experts lives on d; ``ordinals_TK`` [T, K]: earlier tokens of this rank
    that chose the same expert (-1 for an unused slot); ``expert_counts_E`` [E] and
    ``rank_counts_R`` [R]: tokens per expert and per destination rank.
    """

    token_slots_TR: torch.Tensor
    ordinals_TK: torch.Tensor
    expert_counts_E: torch.Tensor
    rank_counts_R: torch.Tensor


@dataclass(frozen=True)
class RecvLayout:
    """Receive side of a dispatch, all int32 on the rank's device.

    ``row_ids_M`` [M_cap]: receive row read by each expert-major row (-1 padding/unused);
    ``row_offsets_L1`` [L + 1]: segment bounds; ``num_tokens_L`` [L]: real rows per local
    expert; ``src_offsets_RL`` [R, L]: first expert-major row of (source, expert);
    ``recv_counts_R`` [R]: rows received from each source.
    """

    row_ids_M: torch.Tensor
    row_offsets_L1: torch.Tensor
    num_tokens_L: torch.Tensor
    src_offsets_RL: torch.Tensor
    recv_counts_R: torch.Tensor

    @classmethod
    def allocate(cls, cfg: EPConfig, device: torch.device | str) -> "RecvLayout":
        R, L = cfg.world_size, cfg.experts_per_rank

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        return cls(torch.full((cfg.max_recv_rows,), -1, dtype=torch.int32, device=device),
                   zeros(L + 1), zeros(L), zeros(R, L), zeros(R))


@dataclass(frozen=True)
class DispatchHandle:
    """Everything the expert compute and the combine of one round need.

    ``x_rows`` [rows, H] receive rows (bf16 or fp8; on the nvshmem backend a view of the
    symmetric buffer, valid until any rank's next dispatch, which may start once this rank's
    combine has sent), ``scales_rows`` [rows, G] fp32 for fp8;
    for nvfp4 ``x_rows`` [rows, H/2] uint8 packed codes and ``scales_rows`` [rows, H/16]
    float8_e4m3fn (on the nvshmem backend both are strided views of the wire rows),
    ``meta_rows`` [rows, 3K] int32 (expert ids, ordinals, weight bits). Expert-major row m is
    ``x_rows[recv.row_ids_M[m]]``. ``weights_rows`` [rows, K] holds the router weights in the
    row dtype where fp32 bits in the meta rows would lose precision (fp64 rows, torch
    backend); None elsewhere.
    """

    layout: DispatchLayout
    recv: RecvLayout
    x_rows: torch.Tensor
    scales_rows: torch.Tensor | None
    meta_rows: torch.Tensor
    num_tokens: int
    weights_rows: torch.Tensor | None = None

    def router_weights(self, top_k: int) -> torch.Tensor:
        """The router weights of every receive row, [rows, K] (fp32, or the row dtype where
        ``weights_rows`` carries them)."""
        if self.weights_rows is not None:
            return self.weights_rows
        return self.meta_rows[:, 2 * top_k:].contiguous().view(torch.float32)

    def expert_major_rows(self, num_rows: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The first ``num_rows`` (default: all M_cap) expert-major rows as ``dtype`` [num_rows, H],
        dequantised for fp8 and nvfp4; padding and unused rows are 0. No host sync."""
        ids = self.recv.row_ids_M if num_rows is None else self.recv.row_ids_M[:num_rows]
        ids = ids.long()
        if not self.x_rows.shape[0]:  # nothing arrived (the torch backend's packed receive)
            H = self.x_rows.shape[1] * (2 if self.x_rows.dtype == torch.uint8 else 1)
            return torch.zeros(ids.shape[0], H, dtype=dtype, device=ids.device)
        safe = ids.clamp(min=0)
        rows = self.x_rows[safe]
        if self.x_rows.dtype == torch.uint8:
            rows = dequantize_nvfp4_torch(rows, self.scales_rows[safe], out_dtype=torch.float32)
        elif self.scales_rows is not None:
            rows = dequantize_fp8_torch(rows, self.scales_rows[safe], out_dtype=torch.float32)
        return torch.where((ids >= 0)[:, None], rows.to(dtype), 0)

    def kept(self) -> "DispatchHandle":
        """A copy of the layouts and meta rows that later dispatches cannot overwrite (the
        nvshmem backend reuses its receive description and buffers every round), without the
        received rows. Backward passes keep this between forward and backward."""
        def clone(t):
            return t.clone() if isinstance(t, torch.Tensor) else t

        layout = DispatchLayout(*(clone(getattr(self.layout, f.name)) for f in fields(DispatchLayout)))
        recv = RecvLayout(*(clone(getattr(self.recv, f.name)) for f in fields(RecvLayout)))
        empty = self.x_rows.new_empty(0, self.x_rows.shape[1])
        return replace(self, layout=layout, recv=recv, x_rows=empty, scales_rows=None,
                       meta_rows=self.meta_rows.clone(), weights_rows=clone(self.weights_rows))
