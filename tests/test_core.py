"""The production helpers below the kernels: routing (:mod:`ray_ep.routing`), seeded inputs
(:mod:`ray_ep.inputs`) and expert weights (:mod:`ray_ep.weights`).

Each property is checked from its definition (softmax top-k recomputed, distinctness, seeds),
never by calling the code under test twice in the same way.
"""

import pytest
import torch

from ray_ep.config import EPConfig
from ray_ep.errors import EPInputError
from ray_ep.inputs import make_inputs, rank_inputs
from ray_ep.routing import route
from ray_ep.validation import validate_moe_inputs
from ray_ep.weights import init_expert_weights

WORLDS = [1, 2, 4, 8]
H, F, E = 128, 64, 16


def make_cfg(R, top_k=4, n_shared=0):
    return EPConfig(hidden_size=H, intermediate_size=F, n_experts=E, top_k=top_k, max_tokens_per_rank=32,
                    gpus_per_node=R, n_shared_experts=n_shared)


def expert_counts(ids):
    """[E] int64: how many (token, k) slots over all ranks chose each expert (-1 skipped)."""
    flat = torch.cat([i.reshape(-1).long() for i in ids])
    return torch.bincount(flat[flat >= 0], minlength=E)


# ---- route ---------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k", [1, 2, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route(top_k, dtype):
    g = torch.Generator().manual_seed(100 + top_k)
    logits = (3 * torch.randn(32, E, generator=g)).to(dtype)
    ids, weights = route(logits, top_k)
    assert ids.shape == weights.shape == (32, top_k)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert bool(((ids >= 0) & (ids < E)).all())
    assert all(len(set(row)) == top_k for row in ids.tolist())  # distinct per token
    torch.testing.assert_close(weights.sum(-1), torch.ones(32), atol=0, rtol=2**-20)
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_ids = torch.topk(probs, top_k, dim=-1)
    assert torch.equal(ids, top_ids.to(torch.int32))
    torch.testing.assert_close(weights, top_w / top_w.sum(-1, keepdim=True), atol=0, rtol=2**-22)
    # independent of topk: no unchosen expert beats a chosen one
    chosen = torch.zeros(32, E, dtype=torch.bool).scatter_(1, ids.long(), True)
    if top_k < E:
        lowest_chosen = probs.masked_fill(~chosen, 2.0).amin(-1)
        highest_other = probs.masked_fill(chosen, -1.0).amax(-1)
        assert bool((lowest_chosen >= highest_other).all())


def test_route_without_renormalize():
    logits = torch.randn(8, E, generator=torch.Generator().manual_seed(7))
    ids, weights = route(logits, 4, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(weights, probs.gather(1, ids.long()))
    assert bool((weights.sum(-1) < 1).all())


# ---- make_inputs ---------------------------------------------------------------------------
@pytest.mark.parametrize("R", WORLDS)
@pytest.mark.parametrize("routing", ["uniform", "skewed", "one-expert"])
def test_make_inputs_shapes(R, routing):
    cfg = make_cfg(R)
    counts = [0, 1, 32, 7, 3, 32, 16, 2][:R]
    xs, ids, ws = make_inputs(cfg, counts, seed=1, routing=routing)
    assert len(xs) == len(ids) == len(ws) == R
    for T, x, i, w in zip(counts, xs, ids, ws):
        assert x.shape == (T, H) and x.dtype == torch.bfloat16
        assert i.shape == (T, 4) and i.dtype == torch.int32
        assert w.shape == (T, 4) and w.dtype == torch.float32
        assert bool(((i >= 0) & (i < E)).all())
        assert all(len(set(row)) == 4 for row in i.tolist())
        assert bool((w > 0).all())
        torch.testing.assert_close(w.sum(-1), torch.ones(T), atol=0, rtol=2**-20)


def test_make_inputs_int_count_and_dtype():
    cfg = make_cfg(4)
    xs, ids, ws = make_inputs(cfg, 5, dtype=torch.float32)
    assert [x.shape for x in xs] == [(5, H)] * 4 and xs[0].dtype == torch.float32
    assert [i.shape for i in ids] == [(5, 4)] * 4


@pytest.mark.parametrize("routing", ["uniform", "skewed", "one-expert"])
def test_make_inputs_deterministic_per_seed(routing):
    cfg = make_cfg(2)
    a = make_inputs(cfg, 16, seed=3, routing=routing)
    b = make_inputs(cfg, 16, seed=3, routing=routing)
    c = make_inputs(cfg, 16, seed=4, routing=routing)
    for part_a, part_b, part_c in zip(a, b, c):
        assert all(torch.equal(p, q) for p, q in zip(part_a, part_b))
        assert not all(torch.equal(p, q) for p, q in zip(part_a, part_c))


def test_make_inputs_skewed_concentrates():
    cfg = make_cfg(4)
    T = 32
    uniform_share = 4 * T * cfg.top_k / E  # 32 slots per expert if spread evenly
    skewed = expert_counts(make_inputs(cfg, T, seed=0, routing="skewed")[1])
    uniform = expert_counts(make_inputs(cfg, T, seed=0, routing="uniform")[1])
    assert int(skewed.sum()) == int(uniform.sum()) == 4 * T * cfg.top_k
    assert int(skewed.max()) >= 2 * uniform_share  # Zipf(1.2): the top expert is in most tokens
    assert int(skewed.max()) > int(uniform.max())
    # a sharper Zipf concentrates more
    sharper = expert_counts(make_inputs(cfg, T, seed=0, routing="skewed", zipf_s=3.0)[1])
    assert int(sharper.sort(descending=True).values[:4].sum()) > int(skewed.sort(descending=True).values[:4].sum())


def test_make_inputs_one_expert():
    cfg = make_cfg(4)
    _, ids, _ = make_inputs(cfg, [8, 0, 3, 32], seed=2, routing="one-expert")
    for i in ids:
        assert bool((i[:, 0] == 0).all())
    assert int(expert_counts(ids)[0]) == 8 + 0 + 3 + 32


def test_make_inputs_bad_routing():
    with pytest.raises(ValueError) as info:
        make_inputs(make_cfg(2), 4, routing="zipf")
    msg = str(info.value)
    assert "'zipf'" in msg and "'uniform'" in msg and "'skewed'" in msg and "'one-expert'" in msg


# ---- expert weights ------------------------------------------------------------------------
def test_init_expert_weights_shapes():
    cfg = make_cfg(4, n_shared=2)
    w = init_expert_weights(cfg, seed=1)
    assert w.w_gate_up.shape == (E, H, 2 * F) and w.w_down.shape == (E, F, H)
    assert w.shared_gate_up.shape == (2, H, 2 * F) and w.shared_down.shape == (2, F, H)
    assert {t.dtype for t in (w.w_gate_up, w.w_down, w.shared_gate_up, w.shared_down)} == {torch.bfloat16}
    # O(1) activations through an expert: entries ~ N(0, 1/H) and N(0, 1/F)
    assert 0.5 < float(w.w_gate_up.float().std() * H**0.5) < 1.5
    assert 0.5 < float(w.w_down.float().std() * F**0.5) < 1.5
    none = init_expert_weights(make_cfg(4), seed=1, dtype=torch.float32)
    assert none.shared_gate_up.shape == (0, H, 2 * F) and none.shared_down.shape == (0, F, H)
    assert none.w_down.dtype == none.shared_down.dtype == torch.float32


@pytest.mark.parametrize("R", WORLDS)
def test_init_expert_weights_rank_slice(R):
    cfg = make_cfg(R, n_shared=1)
    L = cfg.experts_per_rank
    world = init_expert_weights(cfg, seed=9)
    for rank in range(R):
        mine = init_expert_weights(cfg, seed=9, experts=range(rank * L, (rank + 1) * L))
        local = world.local(rank, L)
        for got in (mine, local):
            assert torch.equal(got.w_gate_up, world.w_gate_up[rank * L:(rank + 1) * L])
            assert torch.equal(got.w_down, world.w_down[rank * L:(rank + 1) * L])
            assert torch.equal(got.shared_gate_up, world.shared_gate_up)  # shared: replicated
            assert torch.equal(got.shared_down, world.shared_down)
    empty = init_expert_weights(cfg, seed=9, experts=range(0))
    assert empty.w_gate_up.shape == (0, H, 2 * F)


def test_init_expert_weights_seeded():
    cfg = make_cfg(2, n_shared=1)
    a, b, c = (init_expert_weights(cfg, seed=s) for s in (1, 1, 2))
    assert torch.equal(a.w_gate_up, b.w_gate_up) and torch.equal(a.shared_down, b.shared_down)
    assert not torch.equal(a.w_gate_up, c.w_gate_up) and not torch.equal(a.shared_down, c.shared_down)
    assert not torch.equal(a.w_gate_up[0], a.w_gate_up[1])  # experts differ from each other


@pytest.mark.parametrize("routing", ["uniform", "skewed", "one-expert"])
def test_rank_inputs_are_the_worlds_share(routing):
    """A rank that draws its own inputs gets exactly its part of the world's (what workers rely on)."""
    cfg = make_cfg(4)
    xs, ids, ws = make_inputs(cfg, [5, 0, 9, 3], seed=7, routing=routing)
    for r, T in enumerate([5, 0, 9, 3]):
        x, i, w = rank_inputs(cfg, T, r, seed=7, routing=routing)
        assert torch.equal(x, xs[r]) and torch.equal(i, ids[r]) and torch.equal(w, ws[r])
    other = rank_inputs(cfg, 5, 1, seed=7, routing=routing)[0]  # another rank, same count: other rows
    assert not torch.equal(other, xs[0])


@pytest.mark.parametrize("which", ["x", "topk_ids", "topk_weights"])
@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_meta_and_sparse_inputs_are_input_errors(which, kind):
    cfg = make_cfg(2)
    x, ids, w = rank_inputs(cfg, 4, 0, seed=1)
    args = {"x": x, "topk_ids": ids, "topk_weights": w}
    t = args[which]
    args[which] = torch.empty(t.shape, dtype=t.dtype, device="meta") if kind == "meta" else t.to_sparse()
    with pytest.raises(EPInputError, match=which):
        validate_moe_inputs(cfg, args["x"], args["topk_ids"], args["topk_weights"], rank=1)
