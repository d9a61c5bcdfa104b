"""Autograd of dispatch and combine and the MoE module, on the torch backend over gloo ranks
(spawned processes, float64 on the wire): ``torch.autograd.gradcheck`` of the whole EP
layer as a function of every rank's inputs, and its gradients against the autograd of the
single-process reference (:func:`ray_ep.reference.moe_forward`).

How gradcheck runs across ranks: every rank builds the whole world's inputs from one seed and
checks the same global function ``F(world inputs) -> world outputs``, so all ranks perturb
the same element at the same time and their collectives line up. Inside F a rank takes its
slice of the inputs (whose gradient is summed over the ranks on the way back: each rank
contributes its slice's), runs its EP layer and gathers every rank's output.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ray_ep import EPCommunicator, EPConfig, reference
from ray_ep.nn import MoE, dispatch, moe
from ray_ep.weights import ExpertWeights
from spawn_ranks import run_ranks

# H = 4 (fp64 rows are 32 bytes), K = 2 <= H (the weights' gradient rides in K columns)
CFG = dict(hidden_size=4, n_experts=4, top_k=2, intermediate_size=2, max_tokens_per_rank=4, gpus_per_node=2,
           dispatch_dtype="fp64", combine_dtype="fp64", backend="torch")
# gradients of the EP layer and of the reference: the same float64 math summed in other orders
GRAD_TOL = 1e-10


class _SumGrads(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks (each rank's slice)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _GatherRows(torch.autograd.Function):
    """Every rank's [T_r, H] output concatenated in rank order; backward keeps this rank's rows
    (every rank runs the same global function with the same output gradient)."""

    @staticmethod
    def forward(ctx, out_TH, counts):
        ctx.rank, ctx.counts = dist.get_rank(), counts
        H = out_TH.shape[1]
        parts = [out_TH.new_zeros(max(counts), H) for _ in counts]
        pad = torch.cat([out_TH, out_TH.new_zeros(max(counts) - out_TH.shape[0], H)])
        dist.all_gather(parts, pad.contiguous())
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, g):
        start = sum(ctx.counts[:ctx.rank])
        return g[start:start + ctx.counts[ctx.rank]], None


def _ids(routing: str, cfg: EPConfig, counts: list[int], gen: torch.Generator) -> list[torch.Tensor]:
    """[T_r, K] ids per rank: uniform (one unused slot, -1), skewed (most tokens on experts 0
    and 1 of rank 0), local (every token's experts on its own rank: no remote traffic)."""
    E, K, L = cfg.n_experts, cfg.top_k, cfg.experts_per_rank
    out = []
    for r, T in enumerate(counts):
        if routing == "local":
            rows = [torch.randperm(L, generator=gen)[:K] + r * L for _ in range(T)]
        elif routing == "skewed":
            rows = [torch.tensor([0, 1]) if t % 3 else torch.randperm(E, generator=gen)[:K] for t in range(T)]
        else:
            rows = [torch.randperm(E, generator=gen)[:K] for _ in range(T)]
        ids = torch.stack(rows).to(torch.int32) if T else torch.zeros(0, K, dtype=torch.int32)
        if routing == "uniform" and T:
            ids[0, 1] = -1
        out.append(ids)
    return out


def _world(cfg: EPConfig, counts: list[int], routing: str, seed: int = 0):
    """The whole world's float64 inputs, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    H, E, Fi = cfg.hidden_size, cfg.n_experts, cfg.intermediate_size
    x = torch.randn(sum(counts), H, generator=g, dtype=torch.float64)
    w = torch.rand(sum(counts), cfg.top_k, generator=g, dtype=torch.float64) + 0.1
    wgu = torch.randn(E, H, 2 * Fi, generator=g, dtype=torch.float64) / H**0.5
    wd = torch.randn(E, Fi, H, generator=g, dtype=torch.float64) / Fi**0.5
    sgu = torch.randn(1, H, 2 * Fi, generator=g, dtype=torch.float64) / H**0.5
    sd = torch.randn(1, Fi, H, generator=g, dtype=torch.float64) / Fi**0.5
    return [t.requires_grad_() for t in (x, w, wgu, wd, sgu, sd)], _ids(routing, cfg, counts, g)


def _ep_layer(comm: EPCommunicator, counts: list[int], ids: list[torch.Tensor]):
    r, L = comm.rank, comm.config.experts_per_rank
    lo, hi = sum(counts[:r]), sum(counts[:r + 1])

    def layer(x, w, wgu, wd, sgu, sd):
        x, w, wgu, wd, sgu, sd = (_SumGrads.apply(t) for t in (x, w, wgu, wd, sgu, sd))
        out = moe(comm, x[lo:hi], ids[r], w[lo:hi], wgu[r * L:(r + 1) * L], wd[r * L:(r + 1) * L], sgu, sd)
        return _GatherRows.apply(out, counts)
    return layer


def _reference_layer(cfg: EPConfig, counts: list[int], ids: list[torch.Tensor]):
    def layer(x, w, wgu, wd, sgu, sd):
        xs, ws = list(x.split(counts)), list(w.split(counts))
        return torch.cat(reference.moe_forward(cfg, xs, ids, ws, ExpertWeights(wgu, wd, sgu, sd)))
    return layer


def _check_layer(rank: int, cfg: EPConfig, counts: list[int], routing: str) -> dict:
    inputs, ids = _world(cfg, counts, routing)
    with EPCommunicator(cfg) as comm:
        ep = _ep_layer(comm, counts, ids)
        ok = torch.autograd.gradcheck(ep, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)
        ref_layer = _reference_layer(cfg, counts, ids)
        out, ref = ep(*inputs), ref_layer(*inputs)
        v = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        grads = torch.autograd.grad((out * v).sum(), inputs)
        ref_grads = torch.autograd.grad((ref * v).sum(), inputs)
    names = ["x", "topk_weights", "w_gate_up", "w_down", "shared_gate_up", "shared_down"]
    return {"gradcheck": ok, "out": (out - ref).abs().max().item(),
            **{n: (a - b).abs().max().item() for n, a, b in zip(names, grads, ref_grads)}}


@pytest.mark.parametrize("routing, counts", [("uniform", [3, 2]), ("skewed", [3, 3]), ("local", [2, 3]),
                                             ("uniform", [4, 0])], ids=["uniform", "skewed", "no-remote-rank",
                                                                        "empty-rank"])
def test_moe_layer_gradcheck_and_reference_gradients(routing, counts):
    for rank, res in enumerate(run_ranks(_check_layer, 2, EPConfig(**CFG), counts, routing)):
        assert res.pop("gradcheck") is True
        for name, err in res.items():
            assert err <= GRAD_TOL, (rank, name, err)


def _module_gradcheck(rank: int, cfg: EPConfig) -> bool:
    """The MoE module (router included) as a function of the world's x, the router and the
    experts' weights, through torch.func.functional_call."""
    counts = [3, 3]
    L, lo, hi = cfg.experts_per_rank, 3 * rank, 3 * rank + 3
    with EPCommunicator(cfg) as comm:
        layer = MoE(comm, seed=0, dtype=torch.float64)
        g = torch.Generator().manual_seed(2)
        x = torch.randn(6, cfg.hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
        world = init = {n: p.detach() for n, p in layer.named_parameters()}
        # the world's experts: every rank's slice, the same values on every rank
        gathered = {}
        for n in ("w_gate_up", "w_down"):
            parts = [torch.empty_like(init[n]) for _ in range(comm.world_size)]
            dist.all_gather(parts, init[n].contiguous())
            gathered[n] = torch.cat(parts).requires_grad_()
        router = world["router"].clone().requires_grad_()
        sgu, sd = world["shared_gate_up"].clone().requires_grad_(), world["shared_down"].clone().requires_grad_()

        def f(x, router, wgu, wd, sgu, sd):
            x, router, wgu, wd, sgu, sd = (_SumGrads.apply(t) for t in (x, router, wgu, wd, sgu, sd))
            params = {"router": router, "w_gate_up": wgu[rank * L:(rank + 1) * L],
                      "w_down": wd[rank * L:(rank + 1) * L], "shared_gate_up": sgu, "shared_down": sd}
            out = torch.func.functional_call(layer, params, (x[lo:hi],))
            return _GatherRows.apply(out, counts)

        return torch.autograd.gradcheck(f, (x, router, gathered["w_gate_up"], gathered["w_down"], sgu, sd),
                                        eps=1e-6, atol=1e-8, rtol=1e-6)


def test_moe_module_gradcheck_with_router():
    assert run_ranks(_module_gradcheck, 2, EPConfig(**CFG, n_shared_experts=1)) == [True, True]


def _layout_passes(rank: int, cfg: EPConfig) -> tuple[int, int]:
    with EPCommunicator(cfg) as comm:
        t = comm.transport()
        calls = []
        layout = t._layout
        t._layout = lambda **kw: calls.append(1) or layout(**kw)
        inputs, ids = _world(cfg, [3, 3], "uniform")
        out = _ep_layer(comm, [3, 3], ids)(*inputs)
        forward = len(calls)
        out.sum().backward()
        return forward, len(calls) - forward


def test_backward_reuses_the_forward_layout():
    for forward, backward in run_ranks(_layout_passes, 2, EPConfig(**CFG)):
        assert (forward, backward) == (1, 0)


def _dispatch_rows(rank: int, cfg: EPConfig) -> bool:
    inputs, ids = _world(cfg, [3, 2], "skewed")
    x, w = inputs[0].detach(), inputs[1].detach()
    lo, hi = (0, 3) if rank == 0 else (3, 5)
    with EPCommunicator(cfg) as comm:
        x_MH, d = dispatch(comm, x[lo:hi], ids[rank], w[lo:hi])
    want = reference.dispatch_world(cfg, [x[:3], x[3:]], ids)[rank]
    return torch.equal(x_MH, want.x) and [s[1] for s in d.segments] == want.num_tokens.tolist()


def test_dispatch_rows_are_the_reference_rows():
    assert run_ranks(_dispatch_rows, 2, EPConfig(**CFG)) == [True, True]
