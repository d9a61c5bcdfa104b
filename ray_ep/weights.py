"""Expert weights of a whole world: the container and seeded random initialisation.

Legend: E routed experts, S shared experts, H hidden size, F expert intermediate size,
L = E / R routed experts per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import EPConfig

# each expert draws from its own generator seeded with seed * SEED_STRIDE + expert id, so a
# rank can build just its slice; a prime stride keeps (seed, expert) pairs from colliding
SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class ExpertWeights:
    """SwiGLU expert weights: ``y = (silu(x @ Wg) * (x @ Wu)) @ Wd`` with
    ``w_gate_up[e] = [Wg | Wu]`` of shape [H, 2F] and ``w_down[e]`` of shape [F, H].
    Routed experts are [E, ...]; shared experts [S, ...] (S may be 0)."""

    w_gate_up: torch.Tensor  # [E, H, 2F]
    w_down: torch.Tensor  # [E, F, H]
    shared_gate_up: torch.Tensor  # [S, H, 2F]
    shared_down: torch.Tensor  # [S, F, H]

    def local(self, rank: int, experts_per_rank: int) -> "ExpertWeights":
        """The slice of routed experts that ``rank`` holds (shared experts are replicated)."""
        sl = slice(rank * experts_per_rank, (rank + 1) * experts_per_rank)
        return ExpertWeights(self.w_gate_up[sl], self.w_down[sl], self.shared_gate_up, self.shared_down)


def init_expert_weights(cfg: EPConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                        experts: range | None = None, device: torch.device | str = "cpu",
                        draw_on_device: bool = False) -> ExpertWeights:
    """Seeded random weights, scaled so activations stay O(1) through an expert.

    Each expert draws from its own generator (seed, expert id), so a rank can build just its
    slice (``experts=range(rank * L, (rank + 1) * L)``) and match the whole world's weights.
    The draw runs on the CPU and the result moves to ``device``; ``draw_on_device`` draws on
    ``device`` instead (seconds instead of minutes for a large layer, for benchmarks), but
    those values differ from the CPU draw, so nothing can compare them with the reference.
    """
    H, Fi, E, S = cfg.hidden_size, cfg.intermediate_size, cfg.n_experts, cfg.n_shared_experts
    ids = range(E) if experts is None else experts

    def one(stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        where = device if draw_on_device else "cpu"
        g = torch.Generator(device=where).manual_seed(seed * SEED_STRIDE + stream)
        gate_up = (torch.randn(H, 2 * Fi, generator=g, device=where) / H**0.5).to(dtype).to(device)
        down = (torch.randn(Fi, H, generator=g, device=where) / Fi**0.5).to(dtype).to(device)
        return gate_up, down

    def stack(pairs: list, i: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.stack([p[i] for p in pairs]) if pairs else torch.empty(0, *shape, dtype=dtype, device=device)

    routed = [one(e) for e in ids]
    shared = [one(E + s) for s in range(S)]
    return ExpertWeights(stack(routed, 0, (H, 2 * Fi)), stack(routed, 1, (Fi, H)),
                         stack(shared, 0, (H, 2 * Fi)), stack(shared, 1, (Fi, H)))
