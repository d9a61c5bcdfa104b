"""``MoE``: an expert-parallel MoE layer as an ``nn.Module`` (router, dispatch, this rank's
experts, combine, optional shared experts), and the gradient averaging that data-parallel
training over the EP ranks needs.

Legend: T tokens on this rank, H hidden size, E experts, K top-k, L = E / R local experts,
F expert intermediate size, S shared experts.

Parameters: ``router`` [H, E] (replicated: every rank holds the same copy), ``w_gate_up``
[L, H, 2F] and ``w_down`` [L, F, H] (this rank's experts only, marked ``expert_parallel``),
``shared_gate_up`` [S, H, 2F] and ``shared_down`` [S, F, H] (replicated). Initial values do
not depend on the world size: rank r's experts are rows r*L..(r+1)*L-1 of the seeded
world's (:func:`ray_ep.init_expert_weights`), so a model on R ranks starts where the same
model on one rank does.
"""

from __future__ import annotations

import torch
from torch import nn

from ..communicator import EPCommunicator
from ..weights import init_expert_weights
from .autograd import moe


class MoE(nn.Module):
    """Router + dispatch + experts + combine on one EP rank. Forward and backward are
    collective: every rank runs them in the same order (with 0 tokens where it has none).

    Args:
        comm: this rank's communicator; its config gives H, E, K, F and S.
        seed: seeds the experts (:func:`ray_ep.init_expert_weights`) and the router.
        dtype: parameter dtype (fp32 for CPU training, fp64 for gradient checks, bf16 on GPUs).
        renormalize: the K router weights of a token sum to 1.
    """

    def __init__(self, comm: EPCommunicator, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 renormalize: bool = True):
        super().__init__()
        cfg = comm.config
        self.comm = comm
        self.renormalize = renormalize
        H, E = cfg.hidden_size, cfg.n_experts
        w = init_expert_weights(cfg, seed=seed, dtype=dtype, experts=comm.local_expert_ids, device=comm.device)
        g = torch.Generator().manual_seed(seed)
        self.router = nn.Parameter((torch.randn(H, E, generator=g) / H**0.5).to(comm.device, dtype))
        self.w_gate_up = nn.Parameter(w.w_gate_up)
        self.w_down = nn.Parameter(w.w_down)
        self.shared_gate_up = nn.Parameter(w.shared_gate_up)
        self.shared_down = nn.Parameter(w.shared_down)
        for p in (self.w_gate_up, self.w_down):
            p.expert_parallel = True  # average_gradients: its gradient already sums every rank's tokens

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax top-k: topk_ids_TK int64, topk_weights_TK (differentiable) in x's dtype."""
        logits = x_TH @ self.router
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        weights, ids = torch.topk(probs, self.comm.config.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x_TH.dtype)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """out_TH [T, H] in x's dtype."""
        ids, weights = self.route(x_TH)
        return moe(self.comm, x_TH, ids, weights, self.w_gate_up, self.w_down, self.shared_gate_up,
                   self.shared_down, validate=False)


def average_gradients(module: nn.Module, comm: EPCommunicator) -> None:
    """Turn each rank's gradients of its own loss into those of the mean loss over all R ranks
    (data-parallel over the EP group, equal token counts per rank; call after ``backward``,
    collective): replicated parameters are all-reduced and divided by R; expert parameters
    (``expert_parallel``) are only divided by R, since the combine's backward already brought
    every rank's tokens' gradient to the rank holding the expert."""
    R = comm.world_size
    dense = [p for p in module.parameters() if p.requires_grad and not getattr(p, "expert_parallel", False)]
    for p in module.parameters():
        if getattr(p, "expert_parallel", False) and p.grad is not None:
            p.grad.div_(R)
    if not dense:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in dense]
    flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for every replicated parameter
    torch.distributed.all_reduce(flat, group=comm.group)
    flat.div_(R)
    offset = 0
    for p, g in zip(dense, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n
