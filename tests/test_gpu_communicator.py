"""EPCommunicator and ray_ep.nn on GPUs: spawned ranks over an NCCL group, the nvshmem backend
(NVSHMEM bootstrapped through the group). Skips without enough GPUs.

- a layer (fused and split forms) against the reference, as tests/test_communicator.py on CPU;
- two differentiable MoE layers in a row (their backward runs two combines back to back, which
  the communicator separates with a device barrier) against the reference's autograd, bf16 on
  the wire, fp32 parameters.
"""

from __future__ import annotations

import pytest
import torch

from ray_ep import EPCommunicator, EPConfig, reference
from ray_ep.nn import moe
from ray_ep.weights import ExpertWeights
from spawn_ranks import run_ranks
from test_communicator import BF16_TOL, TINY, _layers_vs_reference
from test_nn import _GatherRows, _SumGrads

pytestmark = pytest.mark.gpu
WORLDS = [pytest.param(2, marks=pytest.mark.multi_gpu(2)), pytest.param(4, marks=pytest.mark.multi_gpu(4))]
# |grad - reference grad| / max|reference grad|: activations and gradient rows travel in bf16
# (2^-8 relative each way), partial sums in bf16, two layers deep
GRAD_TOL = 5e-2


@pytest.mark.parametrize("world", WORLDS)
def test_nvshmem_layer_matches_reference(world):
    cfg = EPConfig(**TINY, gpus_per_node=world, n_shared_experts=1)
    for rank, errs in enumerate(run_ranks(_layers_vs_reference, world, cfg, ["uniform", "skewed", "one-expert"],
                                          backend="nccl")):
        assert errs.pop("plan_bytes") > 0 and errs.pop("backend") == "nvshmem"
        for routing, rel in errs.items():
            assert rel <= BF16_TOL, (rank, routing, rel)


def _two_layers_vs_reference(rank: int, cfg: EPConfig, tokens: int) -> dict:
    R, L, H, K = cfg.world_size, cfg.experts_per_rank, cfg.hidden_size, cfg.top_k
    Fi, E = cfg.intermediate_size, cfg.n_experts
    g = torch.Generator().manual_seed(0)
    counts = [tokens] * R
    x = torch.randn(R * tokens, H, generator=g)
    w = torch.rand(R * tokens, K, generator=g) + 0.1
    wgu = torch.randn(E, H, 2 * Fi, generator=g) / H**0.5
    wd = torch.randn(E, Fi, H, generator=g) / Fi**0.5
    ids = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).int() for _ in range(R)]
    ref_in = [t.clone().requires_grad_() for t in (x, w, wgu, wd)]
    empty = ExpertWeights(wgu, wd, wgu[:0], wd[:0])

    def ref_layer(h, w, wgu, wd):
        weights = ExpertWeights(wgu, wd, empty.shared_gate_up, empty.shared_down)
        return torch.cat(reference.moe_forward(cfg, list(h.split(counts)), ids, list(w.split(counts)), weights))

    ref = ref_layer(ref_layer(ref_in[0], *ref_in[1:]), *ref_in[1:])
    v = torch.randn(ref.shape, generator=g)
    ref_grads = torch.autograd.grad((ref * v).sum(), ref_in)
    with EPCommunicator(cfg) as comm:
        dev = comm.device
        ep_in = [t.to(dev).requires_grad_() for t in (x, w, wgu, wd)]
        lo, hi, mine = rank * tokens, (rank + 1) * tokens, slice(rank * L, (rank + 1) * L)

        def ep_layer(h, w, wgu, wd):
            return moe(comm, h, ids[rank].to(dev), w[lo:hi], wgu[mine], wd[mine])

        xs, ws, gus, ds = (_SumGrads.apply(t) for t in ep_in)
        out = _GatherRows.apply(ep_layer(ep_layer(xs[lo:hi], ws, gus, ds), ws, gus, ds), counts)
        grads = torch.autograd.grad((out * v.to(dev)).sum(), ep_in)
    rel = lambda a, b: ((a.cpu() - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()  # noqa: E731
    return {"out": rel(out.detach(), ref.detach()),
            **{n: rel(a, b) for n, a, b in zip(("x", "topk_weights", "w_gate_up", "w_down"), grads, ref_grads)}}


@pytest.mark.parametrize("world", WORLDS)
def test_nvshmem_autograd_matches_reference_autograd(world):
    cfg = EPConfig(hidden_size=128, n_experts=8, top_k=2, intermediate_size=64, max_tokens_per_rank=64,
                   gpus_per_node=world)
    for rank, errs in enumerate(run_ranks(_two_layers_vs_reference, world, cfg, 48, backend="nccl")):
        for name, err in errs.items():
            assert err <= GRAD_TOL, (rank, name, err)


def _mismatch(rank: int, cfg: EPConfig) -> str:
    try:
        EPCommunicator(cfg.model_copy(update={"max_tokens_per_rank": 64 * (rank + 1)}))
    except Exception as e:  # noqa: BLE001 - the test checks the type by name
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.multi_gpu(2)
def test_mismatched_configs_fail_before_nvshmem_starts():
    cfg = EPConfig(**TINY, gpus_per_node=2)
    for msg in run_ranks(_mismatch, 2, cfg, backend="nccl"):
        assert msg.startswith("EPConfigError") and "max_tokens_per_rank = 64 here, 128 there" in msg, msg
