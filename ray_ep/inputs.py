"""Seeded inputs of a whole world, for tests, checks and benchmarks.

Legend: R ranks, T tokens on a rank, H hidden size, E experts, K top-k.

Rank r's inputs depend on (seed, r) alone (:func:`rank_seed`), so a worker builds its own
on its device and a test or a check rebuilds every rank's from the seed.
"""

from __future__ import annotations

import torch

from .config import EPConfig

ROUTINGS = ("uniform", "skewed", "one-expert")
# rank r of a seed draws from seed * RANK_STRIDE + r: a prime stride keeps (seed, rank) pairs apart
RANK_STRIDE = 1009


def rank_seed(seed: int, rank: int) -> int:
    """The generator seed of rank ``rank``'s inputs (the one mixer of seeds and ranks)."""
    return seed * RANK_STRIDE + rank


def expert_popularity(n_experts: int, seed: int, zipf_s: float = 1.2) -> torch.Tensor:
    """Zipf(s) popularity [E] (fp64, unnormalised) over a seeded permutation of the experts:
    the skewed routing. The same on every rank (it depends on the seed only)."""
    pop = 1.0 / torch.arange(1, n_experts + 1, dtype=torch.float64) ** zipf_s
    return pop[torch.randperm(n_experts, generator=torch.Generator().manual_seed(seed))]


def rank_inputs(cfg: EPConfig, num_tokens: int, rank: int, seed: int = 0, routing: str = "uniform",
                zipf_s: float = 1.2, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs, drawn on ``device``: x [T, H] (``dtype``), topk_ids [T, K] int32,
    topk_weights [T, K] fp32 summing to 1 per token.

    routing ``uniform``: K distinct experts uniformly at random; ``skewed``: K distinct
    experts drawn by Zipf(s) popularity (:func:`expert_popularity`); ``one-expert``: every
    token picks expert 0 first, the rest uniformly.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(map(repr, ROUTINGS))}, got {routing!r}")
    T, E, K, H = num_tokens, cfg.n_experts, cfg.top_k, cfg.hidden_size
    g = torch.Generator(device=device).manual_seed(rank_seed(seed, rank))
    x = torch.randn(T, H, generator=g, device=device).to(dtype)
    if routing == "skewed":
        # Gumbel top-k over log-popularity = sampling K distinct experts by popularity
        u = torch.rand(T, E, generator=g, device=device, dtype=torch.float64).clamp_min(1e-12)
        scores = expert_popularity(E, seed, zipf_s).log().to(device)[None, :] - torch.log(-torch.log(u))
    else:
        scores = torch.rand(T, E, generator=g, device=device)
        if routing == "one-expert":
            scores[:, 0] = 2.0
    ids = torch.topk(scores, K, dim=-1).indices.to(torch.int32)
    w = torch.rand(T, K, generator=g, device=device) + 0.1
    return x, ids.contiguous(), (w / w.sum(dim=-1, keepdim=True)).float().contiguous()


def make_inputs(cfg: EPConfig, num_tokens: list[int] | int, seed: int = 0, routing: str = "uniform",
                zipf_s: float = 1.2, dtype: torch.dtype = torch.bfloat16
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's inputs on the CPU: (xs [T_r, H], topk_ids [T_r, K] int32, topk_weights
    [T_r, K] fp32), rank r's as :func:`rank_inputs` draws them."""
    counts = [num_tokens] * cfg.world_size if isinstance(num_tokens, int) else list(num_tokens)
    per_rank = [rank_inputs(cfg, T, r, seed, routing, zipf_s, dtype) for r, T in enumerate(counts)]
    return [p[0] for p in per_rank], [p[1] for p in per_rank], [p[2] for p in per_rank]
