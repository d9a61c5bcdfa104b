"""A whole world of R ranks in one process: every rank's symmetric block is a plain tensor
on one device, and "peer" addresses are just the other tensors' addresses.

The CPU test suite runs the real Triton kernels over it in interpreter mode (every rank's
send, then every rank's receive); on one GPU it runs the compiled kernels the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import EPConfig, plan_buffers
from ..kernels.buffers import SymmetricBuffers, Workspace, new_block, typed_views


@dataclass(frozen=True)
class LocalWorld:
    """R ranks' buffers and workspaces; ``blocks`` keeps the memory alive."""

    cfg: EPConfig
    blocks: list[torch.Tensor]
    bufs: list[SymmetricBuffers]
    workspaces: list[Workspace]

    @classmethod
    def create(cls, cfg: EPConfig, device: torch.device | str = "cpu") -> "LocalWorld":
        plan = plan_buffers(cfg)
        R = cfg.world_size
        blocks = [new_block(plan, device) for _ in range(R)]
        views = [typed_views(b, plan) for b in blocks]
        bases = torch.tensor([b.data_ptr() for b in blocks], dtype=torch.int64, device=device)
        bufs = [SymmetricBuffers(plan, r, views[r], list(views), bases) for r in range(R)]
        return cls(cfg, blocks, bufs, [Workspace.allocate(cfg, device) for _ in range(R)])
