"""Properties of the plain-torch oracle (ray_ep.reference) on seeded random worlds.

Every check is written independently of the code under test: layouts are recomputed from the
rule in the module docstring with tensor ops, the MoE layer from a per-token loop. Worlds of
1, 2, 4 and 8 ranks with small sizes (H=128, F=64, E=16, K<=4, T<=32) keep the file fast.
"""

import pytest
import torch

from ray_ep import reference as ref
from ray_ep.config import EPConfig
from ray_ep.inputs import make_inputs
from ray_ep.weights import init_expert_weights

WORLDS = [1, 2, 4, 8]
H, F, E = 128, 64, 16

# Tolerances, and why each value:
# - torch.float32 (combine with out_dtype=fp32): the sum of <= K products w_k * x, all of one
#   sign, so no cancellation; each product and add rounds once (2^-24 relative), K <= 8 gives
#   < 2^-20 relative. atol 0: the bound is relative all the way down to x == 0.
# - torch.bfloat16 (combine with a bf16 output): one final rounding of an fp32 sum to bf16,
#   half an ulp (2^-8 relative); fp32 summation-order noise can tip it to the other
#   neighbour, so allow one ulp: rtol 2^-7. bf16 inputs here are N(0, 1), never subnormal.
# - "layer" (moe_forward against the per-token loop, bf16 output): the same roundings, but
#   combine sums a token's K outputs by destination rank while the loop sums by k, and the
#   batched matmul may block differently from one row at a time. Either can tip a bf16
#   rounding: at the output that is one ulp (rtol 2^-7); a tipped intermediate (h or the
#   SwiGLU product, 2^-8 relative of an O(1) value) moves an O(1) output by about
#   2^-8 * |W_down| ~ 1e-3, hence atol 2^-8. A wrong expert, weight or token is O(0.1..1) off.
# - torch.float8_e4m3fn (quantize_fp8 round trip): a bound per element, not atol/rtol, since
#   the error scales with each group's amax. e4m3 keeps 3 mantissa bits: a normal value v in
#   [2^e, 2^(e+1)) has quantum 2^(e-3), and round-to-nearest misses by at most half of it,
#   2^(e-4) <= |v| * 2^-4. Below 2^-6 values are subnormal with a fixed quantum 2^-9, error
#   <= 2^-10. With v = x / scale (|v| <= 448, no overflow) and scale = amax / 448:
#       |deq - x| <= 2^-4 * |x| + 2^-10 * scale        (per element)
#   and over a group at most 2^-4 * amax = 28 * scale (the top binade [256, 448] has quantum
#   32 * scale, so the worst-case absolute error is 16 * scale, not scale * 2^-4). The fp32
#   roundings of x * (448 / amax) and q * scale add ~2^-23 relative: "slack" below.
TOL = {
    torch.float32: dict(atol=0.0, rtol=2**-20),
    torch.bfloat16: dict(atol=1e-6, rtol=2**-7),
    "layer": dict(atol=2**-8, rtol=2**-7),
    torch.float8_e4m3fn: dict(rel=2**-4, subnormal=2**-10, slack=2**-20),
}


def make_cfg(R, top_k=4, alignment=1, dispatch_dtype="bf16", n_shared=0, max_tokens=32):
    return EPConfig(hidden_size=H, intermediate_size=F, n_experts=E, top_k=top_k, max_tokens_per_rank=max_tokens,
                    gpus_per_node=R, expert_alignment=alignment, dispatch_dtype=dispatch_dtype,
                    n_shared_experts=n_shared)


def mask_ids(ids, p, seed):
    """Set a random fraction p of the slots to -1 (unused)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.where(torch.rand(i.shape, generator=g) < p, -1, i).to(torch.int32) for i in ids]


def expert_counts(ids):
    """[E] int64: how many (token, k) slots over all ranks chose each expert (-1 skipped)."""
    flat = torch.cat([i.reshape(-1).long() for i in ids])
    return torch.bincount(flat[flat >= 0], minlength=E)


def check_dispatch(cfg, xs, ids, out):
    """Check ``out = reference.dispatch_world(cfg, xs, ids)`` against the layout rule, recomputed."""
    R, L, A = cfg.world_size, cfg.experts_per_rank, cfg.expert_alignment
    fp8 = cfg.dispatch_dtype == "fp8"
    assert len(out) == R
    counts = expert_counts(ids)
    sent = [ref.quantize_fp8(x) for x in xs] if fp8 else None
    real_rows = 0
    for r, d in enumerate(out):
        M = d.x.shape[0]
        assert d.x.shape == (M, H) and d.x.dtype == (torch.float8_e4m3fn if fp8 else xs[0].dtype)
        assert (d.scales is not None) == fp8
        if fp8:
            assert d.scales.shape == (M, H // 128) and d.scales.dtype == torch.float32
        assert d.row_offsets.dtype == d.num_tokens.dtype == d.src_info.dtype == torch.int32
        assert d.row_offsets.shape == (L + 1,) and d.num_tokens.shape == (L,) and d.src_info.shape == (M, 3)
        assert M <= cfg.max_recv_rows
        offsets = d.row_offsets.tolist()
        assert offsets[0] == 0 and offsets[-1] == M
        # num_tokens: every (token, k) over all source ranks that chose the expert
        assert d.num_tokens.tolist() == counts[r * L:(r + 1) * L].tolist()
        for i in range(L):
            a, b, c = offsets[i], offsets[i + 1], int(d.num_tokens[i])
            assert b - a == -(-c // A) * A  # monotone, padded to the alignment, and no more
            e = r * L + i
            # rows ordered by (source rank, source token); (t, k) from nonzero() come row-major
            want = [[src, t, k] for src in range(R) for t, k in (ids[src] == e).nonzero().tolist()]
            got = d.src_info[a:a + c].tolist()
            assert got == want, f"rank {r} expert {e}"
            assert got == sorted(got)
            # padding rows: zero data, src_info -1
            assert bool((d.src_info[a + c:b] == -1).all())
            assert bool((d.x[a + c:b].float() == 0).all())
            if fp8:
                assert bool((d.scales[a + c:b] == 0).all())
            # real rows: the source token's row, bit for bit
            for m, (src, t, _) in enumerate(got, start=a):
                if fp8:
                    assert torch.equal(d.x[m].view(torch.uint8), sent[src][0][t].view(torch.uint8))
                    assert torch.equal(d.scales[m], sent[src][1][t])
                else:
                    assert torch.equal(d.x[m], xs[src][t])
        real_rows += int(d.num_tokens.sum())
    assert real_rows == int(counts.sum())  # every valid slot arrives once, masked ones never


def moe_loop(cfg, xs, ids, ws, weights):
    """The MoE layer one token at a time: out[t] = sum_k w[t,k] * expert_{ids[t,k]}(x[t]) +
    sum_s shared_s(x[t]), in fp32, cast to x's dtype. fp8 dispatch feeds the routed experts
    the token dequantised (and rounded to the weights' dtype), the shared experts the original."""
    fp8 = cfg.dispatch_dtype == "fp8"
    outs = []
    for x, ids_r, w_r in zip(xs, ids, ws):
        out = torch.zeros(x.shape[0], H, dtype=torch.float32)
        for t in range(x.shape[0]):
            xt = x[t:t + 1]
            xin = ref.dequantize_fp8(*ref.quantize_fp8(xt)).to(weights.w_down.dtype) if fp8 else xt
            for k in range(cfg.top_k):
                e = int(ids_r[t, k])
                if e >= 0:
                    out[t] += w_r[t, k] * ref.swiglu_expert(xin, weights.w_gate_up[e], weights.w_down[e])[0].float()
            for s in range(weights.shared_down.shape[0]):
                out[t] += ref.swiglu_expert(xt, weights.shared_gate_up[s], weights.shared_down[s])[0].float()
        outs.append(out.to(x.dtype))
    return outs


def check_round_trip(cfg, xs, ids, ws):
    """combine(dispatch(x)) with identity experts == x * (sum of the token's valid weights)."""
    d = ref.dispatch_world(cfg, xs, ids)
    ys = []
    for dr in d:
        y = dr.dequantized()  # fp32 copy of each dispatched row: an identity expert
        y[dr.src_info[:, 0] < 0] = float("nan")  # combine must never read a padding row
        ys.append(y)
    T = [x.shape[0] for x in xs]
    out32 = ref.combine_world(cfg, ys, d, ws, T, out_dtype=torch.float32)
    out16 = ref.combine_world(cfg, ys, d, ws, T)
    for r, (x, ids_r, w_r) in enumerate(zip(xs, ids, ws)):
        src = ref.dequantize_fp8(*ref.quantize_fp8(x)) if cfg.dispatch_dtype == "fp8" else x.float()
        wsum = (w_r * (ids_r >= 0)).sum(dim=-1, keepdim=True)
        expected = src * wsum
        assert out32[r].dtype == torch.float32 and out16[r].dtype == torch.bfloat16
        torch.testing.assert_close(out32[r], expected, **TOL[torch.float32])
        torch.testing.assert_close(out16[r].float(), expected, **TOL[torch.bfloat16])


def check_layer(cfg, xs, ids, ws, seed=0):
    weights = init_expert_weights(cfg, seed=seed)
    got = ref.moe_forward(cfg, xs, ids, ws, weights)
    want = moe_loop(cfg, xs, ids, ws, weights)
    for r, (g, w, x) in enumerate(zip(got, want, xs)):
        assert g.shape == x.shape and g.dtype == x.dtype, r
        torch.testing.assert_close(g.float(), w.float(), **TOL["layer"], msg=lambda m: f"rank {r}: {m}")
    return got


# ---- fp8 -----------------------------------------------------------------------------------
def fp8_input(T, Hq, seed):
    """Rows whose 128-channel groups span six orders of magnitude, with an all-zero group, a
    group with one non-zero channel and a group of tiny values (subnormal after scaling)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, Hq // 128, 128, generator=g)
    x *= 10.0 ** torch.empty(T, Hq // 128, 1).uniform_(-3, 3, generator=g)
    x[0, 0] = 0.0
    x[1, 0] = 0.0
    x[1, 0, 5] = -3.0
    x[2, 0] = 1.0
    x[2, 0, :64] = 1e-6  # 1e-6 * 448 = 4.5e-4 < 2^-6: subnormal in e4m3
    return x.reshape(T, Hq)


@pytest.mark.parametrize("Hq", [128, 512])
def test_quantize_fp8(Hq):
    T = 16
    x = fp8_input(T, Hq, seed=Hq)
    q, scales = ref.quantize_fp8(x)
    assert q.shape == (T, Hq) and q.dtype == torch.float8_e4m3fn
    assert scales.shape == (T, Hq // 128) and scales.dtype == torch.float32
    amax = x.reshape(T, -1, 128).abs().amax(-1)
    zero = amax == 0
    assert bool(zero[0, 0]) and int(zero.sum()) == 1
    # scale = amax / 448 (as fp32 division), 1 for an all-zero group
    expected = torch.where(zero, torch.ones_like(amax), amax / torch.full_like(amax, 448.0))
    torch.testing.assert_close(scales, expected, atol=0, rtol=2**-23)
    assert bool((scales[zero] == 1).all())
    qf = q.float().reshape(T, -1, 128)
    assert bool((qf[zero] == 0).all())
    assert bool((qf.abs() <= 448).all())
    # the largest element of every non-zero group lands on +-448 (the full fp8 range is used)
    assert bool((qf.abs().amax(-1)[~zero] == 448).all())
    assert float(qf[1, 0, 5]) == -448 and int((qf[1, 0] != 0).sum()) == 1


@pytest.mark.parametrize("Hq", [128, 512])
def test_fp8_round_trip_within_e4m3_precision(Hq):
    T, tol = 16, TOL[torch.float8_e4m3fn]
    x = fp8_input(T, Hq, seed=Hq + 1)
    q, scales = ref.quantize_fp8(x)
    deq = ref.dequantize_fp8(q, scales)
    assert deq.shape == (T, Hq) and deq.dtype == torch.float32
    err = (deq - x).abs()
    scale_el = scales.repeat_interleave(128, dim=1)
    bound = (tol["rel"] * x.abs() + tol["subnormal"] * scale_el) * (1 + tol["slack"])
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max())}"
    amax_el = x.reshape(T, -1, 128).abs().amax(-1).repeat_interleave(128, dim=1)
    assert bool((err <= tol["rel"] * amax_el * (1 + tol["slack"])).all())  # per-group bound
    assert bool((deq.reshape(T, -1, 128)[0, 0] == 0).all())  # zero group: exact zeros
    assert float((err / x.abs().clamp_min(1e-30)).max()) > 2**-6  # it really is 3-bit precise
    # bf16 input quantises exactly like its fp32 value
    xb = x.to(torch.bfloat16)
    qb, sb = ref.quantize_fp8(xb)
    q32, s32 = ref.quantize_fp8(xb.float())
    assert torch.equal(qb.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(sb, s32)


def test_quantize_fp8_zero_tokens():
    q, s = ref.quantize_fp8(torch.zeros(0, 256))
    assert q.shape == (0, 256) and s.shape == (0, 2)


# ---- dispatch ------------------------------------------------------------------------------
@pytest.mark.parametrize("R", WORLDS)
@pytest.mark.parametrize("top_k, alignment", [(1, 1), (4, 1), (4, 8), (2, 4)])
def test_dispatch_layout(R, top_k, alignment):
    cfg = make_cfg(R, top_k=top_k, alignment=alignment)
    xs, ids, _ = make_inputs(cfg, 32, seed=10 * R + top_k + alignment)
    check_dispatch(cfg, xs, ids, ref.dispatch_world(cfg, xs, ids))


@pytest.mark.parametrize("R", [2, 8])
def test_dispatch_layout_fp8(R):
    cfg = make_cfg(R, alignment=4, dispatch_dtype="fp8")
    xs, ids, _ = make_inputs(cfg, [32, 7] * (R // 2), seed=R)
    check_dispatch(cfg, xs, ids, ref.dispatch_world(cfg, xs, ids))


@pytest.mark.parametrize("R", WORLDS)
def test_dispatch_skips_masked_ids(R):
    cfg = make_cfg(R, alignment=2)
    xs, ids, _ = make_inputs(cfg, 24, seed=R)
    ids = mask_ids(ids, 0.4, seed=R)
    ids[0][0] = -1  # one token with every slot unused
    assert int(sum((i < 0).sum() for i in ids)) > 0
    out = ref.dispatch_world(cfg, xs, ids)
    check_dispatch(cfg, xs, ids, out)
    for d in out:  # no row refers to an unused slot or to the fully masked token
        for src, t, k in d.src_info.tolist():
            if src >= 0:
                assert int(ids[src][t, k]) >= 0
                assert (src, t) != (0, 0)


def test_dispatch_non_contiguous_inputs():
    cfg = make_cfg(4, alignment=4)
    xs, ids, _ = make_inputs(cfg, [5, 0, 9, 3], seed=3)
    wide_x = [torch.stack([x, -x], dim=2).reshape(x.shape[0], 2 * H)[:, ::2] for x in xs]
    wide_ids = [torch.stack([i, i], dim=0).transpose(0, 1)[:, 0] for i in ids]
    wide_x[2] = xs[2].t().contiguous().t()  # column-major
    assert not wide_x[0].is_contiguous() and not wide_x[2].is_contiguous()
    for a, b in zip(ref.dispatch_world(cfg, xs, ids), ref.dispatch_world(cfg, wide_x, wide_ids)):
        for field in ("x", "row_offsets", "num_tokens", "src_info"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_dispatch_needs_one_input_per_rank():
    cfg = make_cfg(4)
    xs, ids, _ = make_inputs(cfg, 2)
    with pytest.raises(ValueError, match=r"one input per rank \(4\)"):
        ref.dispatch_world(cfg, xs[:3], ids[:3])


def test_experts_on_dispatched_rows():
    cfg = make_cfg(2, alignment=8)
    xs, ids, _ = make_inputs(cfg, 16, seed=5)
    d = ref.dispatch_world(cfg, xs, ids)
    weights = init_expert_weights(cfg, seed=5)
    ys = ref.experts_world(cfg, d, weights)
    for r, (dr, y) in enumerate(zip(d, ys)):
        assert y.shape == dr.x.shape and y.dtype == torch.bfloat16
        pad = dr.src_info[:, 0] < 0
        assert bool(pad.any()) and bool((y[pad] == 0).all())
        for m in range(0, y.shape[0], 7):
            src, t, k = dr.src_info[m].tolist()
            if src >= 0:
                e = int(ids[src][t, k])
                assert e // cfg.experts_per_rank == r
                one = ref.swiglu_expert(xs[src][t:t + 1], weights.w_gate_up[e], weights.w_down[e])[0]
                torch.testing.assert_close(y[m].float(), one.float(), **TOL["layer"])


# ---- combine(dispatch(x)) ------------------------------------------------------------------
@pytest.mark.parametrize("R", WORLDS)
@pytest.mark.parametrize("alignment, mask", [(1, 0.0), (8, 0.0), (4, 0.3)])
def test_round_trip_identity_experts(R, alignment, mask):
    cfg = make_cfg(R, alignment=alignment)
    xs, ids, ws = make_inputs(cfg, 32, seed=R + alignment)
    if mask:
        ids = mask_ids(ids, mask, seed=R)
    check_round_trip(cfg, xs, ids, ws)


@pytest.mark.parametrize("R", [1, 4])
def test_round_trip_fp8(R):
    cfg = make_cfg(R, alignment=2, dispatch_dtype="fp8")
    xs, ids, ws = make_inputs(cfg, 16, seed=R)
    check_round_trip(cfg, xs, mask_ids(ids, 0.2, seed=R), ws)


# ---- moe_forward ---------------------------------------------------------------------------
@pytest.mark.parametrize("R, top_k, dispatch_dtype, n_shared, alignment", [
    (1, 4, "bf16", 0, 1),
    (2, 2, "bf16", 1, 4),
    (4, 4, "bf16", 2, 1),
    (4, 4, "fp8", 1, 8),
    (8, 4, "bf16", 1, 2),
    (8, 1, "fp8", 0, 1),
])
def test_moe_forward_matches_per_token_loop(R, top_k, dispatch_dtype, n_shared, alignment):
    cfg = make_cfg(R, top_k=top_k, alignment=alignment, dispatch_dtype=dispatch_dtype, n_shared=n_shared)
    counts = [32, 17, 1, 0, 12, 5, 9, 3][:R]
    xs, ids, ws = make_inputs(cfg, counts, seed=R + top_k)
    check_layer(cfg, xs, mask_ids(ids, 0.15, seed=R), ws, seed=R)


# ---- edge cases ----------------------------------------------------------------------------
def test_rank_with_zero_tokens():
    cfg = make_cfg(4, alignment=4, n_shared=1)
    xs, ids, ws = make_inputs(cfg, [0, 5, 0, 11], seed=21)
    check_dispatch(cfg, xs, ids, ref.dispatch_world(cfg, xs, ids))
    check_round_trip(cfg, xs, ids, ws)
    out = check_layer(cfg, xs, ids, ws)
    assert out[0].shape == (0, H) and out[2].shape == (0, H)


@pytest.mark.parametrize("R", WORLDS)
def test_no_tokens_anywhere(R):
    cfg = make_cfg(R, alignment=8, n_shared=1)
    xs, ids, ws = make_inputs(cfg, 0)
    out = ref.dispatch_world(cfg, xs, ids)
    for d in out:
        assert d.x.shape == (0, H) and d.src_info.shape == (0, 3)
        assert d.row_offsets.tolist() == [0] * (cfg.experts_per_rank + 1)
        assert d.num_tokens.tolist() == [0] * cfg.experts_per_rank
    assert [o.shape for o in check_layer(cfg, xs, ids, ws)] == [(0, H)] * R


@pytest.mark.parametrize("R", WORLDS)
def test_one_token_per_rank(R):
    cfg = make_cfg(R, alignment=2, n_shared=1)
    xs, ids, ws = make_inputs(cfg, 1, seed=R)
    check_dispatch(cfg, xs, ids, ref.dispatch_world(cfg, xs, ids))
    check_round_trip(cfg, xs, ids, ws)
    check_layer(cfg, xs, ids, ws)


@pytest.mark.parametrize("R", WORLDS)
def test_all_tokens_to_one_expert(R):
    cfg = make_cfg(R, top_k=1, alignment=8)
    L, hot = cfg.experts_per_rank, 13
    xs, _, ws = make_inputs(cfg, [32, 3, 17, 0, 1, 32, 8, 30][:R], seed=R)
    ids = [torch.full((x.shape[0], 1), hot, dtype=torch.int32) for x in xs]
    out = ref.dispatch_world(cfg, xs, ids)
    check_dispatch(cfg, xs, ids, out)
    total = sum(x.shape[0] for x in xs)
    holder = hot // L
    for r, d in enumerate(out):
        if r == holder:
            assert d.num_tokens.tolist() == [total if i == hot % L else 0 for i in range(L)]
            assert d.x.shape[0] == -(-total // 8) * 8
        else:  # every other rank receives nothing
            assert d.x.shape[0] == 0 and int(d.num_tokens.sum()) == 0
    check_round_trip(cfg, xs, ids, ws)
    check_layer(cfg, xs, ids, ws)


def test_one_expert_routing_layer():
    cfg = make_cfg(4, alignment=4)
    xs, ids, ws = make_inputs(cfg, 8, seed=8, routing="one-expert")
    out = ref.dispatch_world(cfg, xs, ids)
    check_dispatch(cfg, xs, ids, out)
    assert int(out[0].num_tokens[0]) == 4 * 8
    check_layer(cfg, xs, ids, ws)


def test_rank_that_receives_nothing():
    cfg = make_cfg(4, alignment=4, n_shared=1)
    L = cfg.experts_per_rank
    xs, _, ws = make_inputs(cfg, 8, seed=31)
    g = torch.Generator().manual_seed(31)
    # every token picks 4 distinct experts among those of ranks 0..2; rank 3 gets no row
    ids = [torch.stack([torch.randperm(3 * L, generator=g)[:4] for _ in range(8)]).to(torch.int32)
           for _ in range(4)]
    out = ref.dispatch_world(cfg, xs, ids)
    check_dispatch(cfg, xs, ids, out)
    assert out[3].x.shape == (0, H) and out[3].row_offsets.tolist() == [0] * (L + 1)
    check_round_trip(cfg, xs, ids, ws)
    check_layer(cfg, xs, ids, ws)


def test_all_slots_masked():
    cfg = make_cfg(2, n_shared=1)
    xs, ids, ws = make_inputs(cfg, 6, seed=4)
    ids = [torch.full_like(i, -1) for i in ids]
    assert all(d.x.shape[0] == 0 for d in ref.dispatch_world(cfg, xs, ids))
    out = check_layer(cfg, xs, ids, ws)  # shared experts only
    weights = init_expert_weights(cfg)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o.float(), ref.shared_experts(x, weights).to(torch.bfloat16).float(), atol=0, rtol=0)


@pytest.mark.parametrize("R, alignment", [(2, 1), (8, 1), (8, 4)])
def test_largest_receive_side(R, alignment):
    # every rank sends N_max tokens, each to min(K, L) experts of rank 0: the most rank 0 can get
    cfg = make_cfg(R, alignment=alignment)
    N, KL = cfg.max_tokens_per_rank, cfg.experts_per_token_rank
    xs, _, ws = make_inputs(cfg, N, seed=R)
    row = list(range(KL)) + list(range(cfg.experts_per_rank, cfg.experts_per_rank + cfg.top_k - KL))
    ids = [torch.tensor([row] * N, dtype=torch.int32) for _ in range(R)]
    out = ref.dispatch_world(cfg, xs, ids)
    check_dispatch(cfg, xs, ids, out)
    assert int(out[0].num_tokens.sum()) == R * N * KL
    if alignment == 1:
        assert out[0].x.shape[0] == cfg.max_recv_rows
    check_round_trip(cfg, xs, ids, ws)
