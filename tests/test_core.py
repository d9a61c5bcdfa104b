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
from ray_ep.weights import ExpertWeights, init_expert_weights

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


# ---- fp8 expert weights ----------------------------------------------------------------------
def fp8_cfg(R=2, n_shared=1):
    return EPConfig(hidden_size=256, intermediate_size=128, n_experts=8, top_k=2, max_tokens_per_rank=8,
                    gpus_per_node=R, n_shared_experts=n_shared, expert_dtype="fp8")


def test_init_expert_weights_fp8_is_the_bf16_draw_quantised_per_block():
    cfg = fp8_cfg()
    f8 = init_expert_weights(cfg, seed=3)
    bf = init_expert_weights(cfg.model_copy(update={"expert_dtype": "bf16"}), seed=3)
    assert f8.fp8 and not bf.fp8
    assert f8.w_gate_up.dtype == f8.w_down.dtype == torch.float8_e4m3fn
    assert f8.w_gate_up_scales.shape == (8, 2, 2) and f8.w_down_scales.shape == (8, 1, 2)
    # shared experts: the same draw quantised the same way
    assert f8.shared_fp8 and f8.shared_gate_up_scales.shape == (1, 2, 2) and f8.shared_down_scales.shape == (1, 1, 2)
    sq, ss = bf.to_expert_dtype("fp8").shared_down, bf.to_expert_dtype("fp8").shared_down_scales
    assert torch.equal(f8.shared_down.view(torch.uint8), sq.view(torch.uint8)) and torch.equal(f8.shared_down_scales, ss)
    # per 128 x 128 block: scale = amax / 448, so the block's largest value becomes +-448
    w, q, s = bf.w_gate_up[1, 128:, :128].float(), f8.w_gate_up[1, 128:, :128].float(), f8.w_gate_up_scales[1, 1, 0]
    assert float(s) == pytest.approx(float(w.abs().max()) / 448, rel=1e-6)
    assert float(q.abs().max()) == 448.0
    # and q * scale is the weight within e4m3's precision (3 mantissa bits: 2^-4 relative; a
    # subnormal step of 2^-9 scale near zero)
    err = (q * s - w).abs()
    assert bool((err <= w.abs() * 2**-4 + float(s) * 2**-9).all())
    # a rank's slice and the conversions give the same bits
    L = cfg.experts_per_rank
    mine = init_expert_weights(cfg, seed=3, experts=range(L, 2 * L))
    assert torch.equal(mine.w_down.view(torch.uint8), f8.local(1, L).w_down.view(torch.uint8))
    assert torch.equal(mine.w_down_scales, f8.local(1, L).w_down_scales)
    conv = bf.to_expert_dtype("fp8")
    assert torch.equal(conv.w_gate_up.view(torch.uint8), f8.w_gate_up.view(torch.uint8))
    assert torch.equal(conv.w_gate_up_scales, f8.w_gate_up_scales)
    back = f8.to_expert_dtype("bf16")
    assert back.w_down.dtype == torch.bfloat16 and back.w_down_scales is None
    assert torch.equal(back.w_down, (f8.w_down.float() * f8.w_down_scales.repeat_interleave(128, 1)
                                     .repeat_interleave(128, 2)).to(torch.bfloat16))
    assert not back.shared_fp8 and back.shared_down_scales is None
    assert torch.equal(back.shared_down, (f8.shared_down.float() * f8.shared_down_scales.repeat_interleave(128, 1)
                                          .repeat_interleave(128, 2)).to(torch.bfloat16))
    # fp8 weights into an fp8 config: the same tensors, not copies
    assert f8.to_expert_dtype("fp8").shared_gate_up is f8.shared_gate_up
    # no shared experts: empty tensors either way
    none = init_expert_weights(fp8_cfg(n_shared=0), seed=3)
    assert none.shared_fp8 and none.shared_gate_up.shape == (0, 256, 256) and none.shared_down_scales.shape == (0, 1, 2)
    assert none.to_expert_dtype("bf16").shared_down.shape == (0, 128, 256)


def test_check_expert_weights_messages():
    from dataclasses import replace

    from ray_ep.weights import check_expert_weights

    cfg = fp8_cfg()
    w = init_expert_weights(cfg, seed=4)
    check_expert_weights(cfg, w)  # fine
    check_expert_weights(cfg, w.to_expert_dtype("bf16"))  # float weights into an fp8 config: fine
    cases = [
        (replace(w, w_down_scales=w.w_down_scales[:, :, :1]), r"w_down_scales has shape \[8, 1, 1\], expected \[8, 1, 2\]"),
        (replace(w, w_gate_up_scales=w.w_gate_up_scales * float("inf")), "not finite and positive"),
        (replace(w, w_down_scales=-w.w_down_scales), r"not finite and positive \(-"),
        (replace(w, shared_down=w.shared_down.float()),
         "shared_down is float32, expected float8_e4m3fn \\(shared_gate_up and shared_down must both be fp8"),
        (replace(w, shared_down_scales=None), r"fp8 shared_down needs shared_down_scales \[1, 1, 2\] fp32"),
        (replace(w, shared_gate_up_scales=w.shared_gate_up_scales[:, :1]),
         r"shared_gate_up_scales has shape \[1, 1, 2\], expected \[1, 2, 2\]"),
        (replace(w.to_expert_dtype("bf16"), shared_down_scales=w.shared_down_scales),
         "shared_down_scales given for bfloat16 shared experts"),
        (replace(w, w_down=w.w_down.float()), r"w_down is float32, expected float8_e4m3fn \(w_gate_up and w_down"),
        (replace(w, w_down=w.w_down[:4]), r"w_down has shape \[4, 128, 256\], this config needs \[8, 128, 256\]"),
    ]
    for bad, match in cases:
        with pytest.raises(EPInputError, match=match):
            check_expert_weights(cfg, bad)
    # a K that is not a multiple of 128 (H = 192 as a bf16 config allows it)
    cfg192 = EPConfig(hidden_size=192, intermediate_size=128, n_experts=8, top_k=2, max_tokens_per_rank=8)
    f8 = torch.zeros(8, 192, 256, dtype=torch.float8_e4m3fn)
    odd = ExpertWeights(f8, torch.zeros(8, 128, 192, dtype=torch.float8_e4m3fn), torch.zeros(0, 192, 256),
                        torch.zeros(0, 128, 192), torch.ones(8, 1, 2), torch.ones(8, 1, 1))
    with pytest.raises(EPInputError, match=r"hidden_size \(H\) % 128 == 0 .* got 192"):
        check_expert_weights(cfg192, odd)


def _save_deepseek(folder, cfg, layer, experts_fp32, shared_fp32, fp8=True):
    """A DeepSeek-V3-layout checkpoint of one layer in two files plus the index: [out, in]
    projections, e4m3 with weight_scale_inv per 128 x 128 block (or bf16)."""
    import json

    from safetensors.torch import save_file

    from ray_ep.fp8 import quantize_fp8_blocks_torch

    tensors = {}
    Fi = cfg.intermediate_size
    pre = f"model.layers.{layer}.mlp."
    for name, (gu, dn) in [(f"experts.{e}", ed) for e, ed in enumerate(experts_fp32)] + [("shared_experts", shared_fp32)]:
        for proj, w_io in (("gate", gu[:, :Fi]), ("up", gu[:, Fi:]), ("down", dn)):
            w_oi = w_io.t().contiguous()  # the checkpoint's [out, in]
            if fp8:
                q, s = quantize_fp8_blocks_torch(w_oi)
                tensors[f"{pre}{name}.{proj}_proj.weight"] = q
                tensors[f"{pre}{name}.{proj}_proj.weight_scale_inv"] = s
            else:
                tensors[f"{pre}{name}.{proj}_proj.weight"] = w_oi.to(torch.bfloat16)
    keys = sorted(tensors)
    half = len(keys) // 2
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(folder / fname))
        weight_map.update({k: fname for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_load_deepseek_experts(tmp_path):
    from ray_ep.fp8 import dequantize_fp8_blocks_torch
    from ray_ep.weights import load_deepseek_experts

    cfg = fp8_cfg(n_shared=1)
    H, Fi, E = cfg.hidden_size, cfg.intermediate_size, cfg.n_experts
    g = torch.Generator().manual_seed(5)
    experts = [(torch.randn(H, 2 * Fi, generator=g), torch.randn(Fi, H, generator=g)) for _ in range(E)]
    shared = (torch.randn(H, 2 * Fi, generator=g), torch.randn(Fi, H, generator=g))
    _save_deepseek(tmp_path, cfg, 3, experts, shared)
    w = load_deepseek_experts(tmp_path, cfg, layer=3)
    assert w.fp8 and w.w_gate_up.shape == (E, H, 2 * Fi) and w.w_down.shape == (E, Fi, H)
    assert w.w_gate_up.stride(1) == 1 and w.w_down.stride(1) == 1  # K-major views of [out, in] rows
    assert w.shared_fp8 and w.shared_gate_up.shape == (1, H, 2 * Fi) and w.shared_down_scales.shape == (1, 1, 2)
    assert w.shared_gate_up.stride(1) == 1  # shared experts stay fp8 too, as K-major views
    # the same values as quantising our [in, out] weights per block (blocks are transposes)
    for e in (0, E - 1):
        gu = dequantize_fp8_blocks_torch(w.w_gate_up[e], w.w_gate_up_scales[e], torch.float32)
        assert torch.allclose(gu, experts[e][0], rtol=2**-4, atol=float(w.w_gate_up_scales[e].max()) * 2**-9)
    sd = dequantize_fp8_blocks_torch(w.shared_down[0], w.shared_down_scales[0], torch.float32)
    assert torch.allclose(sd, shared[1], rtol=2**-4, atol=float(w.shared_down_scales.max()) * 2**-9)
    # one rank's slice reads only its experts and matches the whole
    part = load_deepseek_experts(tmp_path, cfg, layer=3, experts=range(4, 8))
    assert torch.equal(part.w_down.view(torch.uint8), w.w_down[4:].view(torch.uint8))
    assert torch.equal(part.w_gate_up_scales, w.w_gate_up_scales[4:])
    with pytest.raises(EPInputError, match="no tensor 'model.layers.4.mlp.experts.0.gate_proj.weight'"):
        load_deepseek_experts(tmp_path, cfg, layer=4)
    # a bf16 checkpoint loads as bf16
    bf = tmp_path / "bf16"
    bf.mkdir()
    _save_deepseek(bf, cfg, 0, experts, shared, fp8=False)
    wb = load_deepseek_experts(bf, cfg, layer=0)
    assert not wb.fp8 and torch.equal(wb.w_down[2], experts[2][1].to(torch.bfloat16))
    assert not wb.shared_fp8 and torch.equal(wb.shared_down[0], shared[1].to(torch.bfloat16))


def test_deepseek_checkpoint_with_bad_scales_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from ray_ep.weights import load_deepseek_experts

    cfg = fp8_cfg(n_shared=0)
    H, Fi = cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(6)
    experts = [(torch.randn(H, 2 * Fi, generator=g), torch.randn(Fi, H, generator=g)) for _ in range(8)]
    _save_deepseek(tmp_path, cfg, 0, experts, experts[0])
    for f in tmp_path.glob("*.safetensors"):
        t = load_file(str(f))
        key = "model.layers.0.mlp.experts.2.down_proj.weight_scale_inv"
        if key in t:
            t[key][0, 0] = float("nan")
            save_file(t, str(f))
    with pytest.raises(EPInputError, match="w_down_scales holds a scale that is not finite"):
        load_deepseek_experts(tmp_path, cfg, layer=0)


def test_fp8_block_quantisation_of_stacked_experts_is_per_matrix():
    # stacked experts are quantised one [D, O] matrix at a time (the peak stays one matrix's
    # fp32 temporaries): the same bits and scales as each matrix alone, any strides, zero
    # blocks scale 1; dequantising stacks matches too
    from ray_ep.fp8 import dequantize_fp8_blocks_torch, quantize_fp8_blocks_torch

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(2, 3, 256, 384, generator=gen) * 10.0 ** torch.randint(-3, 2, (2, 3, 1, 1), generator=gen)
    w[1, 2, 128:, :128] = 0.0
    for stack in (w, w.transpose(-1, -2)):
        q, s = quantize_fp8_blocks_torch(stack)
        assert q.shape == stack.shape and s.shape == (*stack.shape[:-2], stack.shape[-2] // 128, stack.shape[-1] // 128)
        for i in range(2):
            for j in range(3):
                qi, si = quantize_fp8_blocks_torch(stack[i, j].contiguous())
                assert torch.equal(q[i, j].view(torch.uint8), qi.view(torch.uint8)) and torch.equal(s[i, j], si)
                assert torch.equal(dequantize_fp8_blocks_torch(q, s)[i, j], dequantize_fp8_blocks_torch(qi, si))
    q, s = quantize_fp8_blocks_torch(w)
    assert s[1, 2, 1, 0] == 1.0 and not bool(q[1, 2, 128:, :128].float().any())
