"""EPCluster end to end on CPU: the torch backend (gloo all_to_all) with CPU workers.

Every test builds the whole world's inputs from one seed (reference.make_inputs) and checks
each rank's output against reference.moe_forward, a plain loop over the world in this process.
Clusters are expensive to start (~7 s each after Ray), so they are module- or class-scoped and
shared; tests that break a cluster (a dead worker, shutdown) start a throw-away one.

Legend: R ranks, T tokens on a rank, H hidden size, K top-k, E experts, L = E / R.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import ray
import torch

from ray_ep import EPCluster, EPConfig, reference
from ray_ep.errors import EPClusterError, EPInputError, EPStateError, EPTimeoutError, EPWorkerError
from ray_ep.inputs import make_inputs
from ray_ep.weights import ExpertWeights, init_expert_weights
from ray_ep.routing import route

# Error of an output against the reference, as max|out - ref| / max|ref| per rank. The CPU
# workers run torch twins that round like the reference (bf16 operands, fp32 accumulation,
# bf16 between stages), but accumulate in another order, so a bf16 intermediate can land one
# ulp (2^-8 relative) away; that ulp then passes through the down projection and the weighted
# sum. fp32 combine leaves only those expert intermediates; bf16 combine adds a bf16 rounding
# of each (token, rank) partial sum on the wire and of the output (~2^-8 each). Worst measured
# over 18 full batches of the tiny preset: 3.0e-3 (fp32), 6.5e-3 (bf16, also with fp8
# dispatch, which the reference quantises identically); the limits keep a 3-5x margin and
# match the driver's check() tolerance.
TOL = {"fp32": 1e-2, "bf16": 3e-2}

ROUTINGS = ("uniform", "skewed", "one-expert")
LAYER0_SEED = 0  # seed of the experts every shared cluster holds in layer 0


# ---- helpers ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def world_weights(cfg: EPConfig, seed: int) -> ExpertWeights:
    """The world's experts that ``load_experts(seed=seed)`` loads, rank by rank."""
    return init_expert_weights(cfg, seed=seed)


def rel_errors(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> list[float]:
    errs = []
    for o, e in zip(outs, refs):
        assert o.shape == e.shape, f"output {tuple(o.shape)} vs reference {tuple(e.shape)}"
        if e.numel() == 0:
            errs.append(0.0)
            continue
        diff = (o.float() - e.float()).abs().max().item()
        errs.append(diff / max(e.float().abs().max().item(), 1e-6))
    return errs


def assert_close_to_reference(cfg: EPConfig, outs, xs, ids, ws, weights) -> None:
    """Every rank's output against reference.moe_forward (shape, finite, per-dtype tolerance)."""
    assert len(outs) == cfg.world_size
    refs = reference.moe_forward(cfg, xs, ids, ws, weights)
    for r, o in enumerate(outs):
        assert bool(torch.isfinite(o.float()).all()), f"rank {r}: non-finite output"
    errs = rel_errors(outs, refs)
    assert max(errs) <= TOL[cfg.combine_dtype], f"per-rank relative errors {errs} > {TOL[cfg.combine_dtype]}"


def inputs(cfg: EPConfig, num_tokens, seed: int, routing: str = "uniform"):
    return make_inputs(cfg, num_tokens, seed=seed, routing=routing)


def assert_usable(ep: EPCluster, seed: int = 99) -> None:
    """A forward right after an error still gives the reference answer."""
    cfg = ep.config
    xs, ids, ws = inputs(cfg, 5, seed)
    outs = ep.forward(xs, ids, ws)
    assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))


def kill_and_wait(handle, timeout_s: float = 30.0) -> None:
    """ray.kill is asynchronous: wait until the GCS reports the actor dead, or a call made
    right after the kill may still be served (seen on a loaded 2-core machine)."""
    ray.kill(handle)
    actor_id = handle._actor_id.hex()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray._private.state.actors(actor_id=actor_id).get("State") == "DEAD":
            return
        time.sleep(0.1)
    raise AssertionError(f"actor {actor_id} still alive {timeout_s} s after ray.kill")


def start_cluster(cfg: EPConfig, seed: int | None = LAYER0_SEED) -> EPCluster:
    ep = EPCluster(cfg).start()
    if seed is not None:
        ep.load_experts(seed=seed)
    return ep


# ---- fixtures --------------------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("ship_module_by_value")  # EPCluster.run gets this module's functions


@pytest.fixture(scope="module")
def ep2(ray_session):
    """tiny preset on 2 ranks (H 128, E 16, K 4, N_max 32), bf16 combine, seed-0 experts."""
    ep = start_cluster(EPConfig.preset("tiny", gpus_per_node=2))
    yield ep
    ep.shutdown()


@pytest.fixture(scope="module")
def ep4(ray_session):
    """tiny preset on 4 ranks (L = 4) with expert segments padded to 4 rows and fp32 combine."""
    ep = start_cluster(EPConfig.preset("tiny", gpus_per_node=4, expert_alignment=4, combine_dtype="fp32"))
    yield ep
    ep.shutdown()


@pytest.fixture(params=["ep2", "ep4"])
def ep(request):
    return request.getfixturevalue(request.param)


# ---- end to end against the reference ----------------------------------------------------------
@pytest.mark.parametrize("routing", ROUTINGS)
def test_check_passes(ep, routing):
    report = ep.check(num_tokens=16, seed=1, routing=routing, rounds=2)
    assert report.passed, report.table()
    assert report.backend == "torch" and report.rounds == 2
    assert len(report.per_rank_rel_error) == ep.world_size


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_forward_matches_reference(ep, routing, fused):
    cfg = ep.config
    xs, ids, ws = inputs(cfg, [7, 16, 1, 11][: cfg.world_size], seed=2, routing=routing)
    outs = ep.forward(xs, ids, ws, fused=fused)
    assert [tuple(o.shape) for o in outs] == [tuple(x.shape) for x in xs]
    assert all(o.dtype == torch.bfloat16 for o in outs)
    assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))


def test_fused_and_split_forms_agree_exactly(ep):
    cfg = ep.config
    xs, ids, ws = inputs(cfg, 9, seed=3, routing="skewed")
    fused = ep.forward(xs, ids, ws, fused=True)
    split = ep.forward(xs, ids, ws, fused=False)
    assert all(torch.equal(a, b) for a, b in zip(fused, split))


@pytest.mark.parametrize("micro_batches", [2, 3])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_micro_batched_layer_matches_reference_and_serial(ep, routing, micro_batches):
    """The pipelined layer (micro-batches with their own buffers, communication of one beside
    the experts of another) gives the serial layer's output: odd token counts (uneven
    micro-batches), a rank with fewer tokens than micro-batches, an empty rank."""
    cfg = ep.config
    xs, ids, ws = inputs(cfg, [7, 16, 1, 0][: cfg.world_size], seed=8, routing=routing)
    for fused in (True, False):
        outs = ep.forward(xs, ids, ws, fused=fused, micro_batches=micro_batches)
        assert [tuple(o.shape) for o in outs] == [tuple(x.shape) for x in xs]
        assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))
        serial = ep.forward(xs, ids, ws, fused=fused)
        for a, b in zip(outs, serial):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_cuda_graph_needs_gpu_workers(ep2):
    cfg = ep2.config
    xs, ids, ws = inputs(cfg, 4, seed=10)
    with pytest.raises(EPInputError, match="cuda_graph replays the GPU kernels"):
        ep2.forward(xs, ids, ws, cuda_graph=True)


def test_token_buckets():
    from ray_ep.graphs import token_bucket

    assert [token_bucket(t, 256) for t in (0, 1, 2, 3, 5, 8, 9, 200, 256)] == [1, 1, 2, 4, 8, 8, 16, 256, 256]
    assert token_bucket(20, 24) == 24  # capped at max_tokens_per_rank


def test_layer_graphs_refuse_more_tokens_than_the_largest_bucket():
    """Callers skip validation in hot loops (validate=False): more tokens than
    max_tokens_per_rank is still a clear error, not a copy into too small a captured input."""
    from ray_ep.graphs import LayerGraphs

    graphs = LayerGraphs(transport=None, max_tokens=24)
    x, ids, w = torch.zeros(25, 8), torch.zeros(25, 2, dtype=torch.int32), torch.zeros(25, 2)
    with pytest.raises(EPInputError, match="25 tokens exceed max_tokens_per_rank = 24"):
        graphs.moe("layer", lambda *a: None, x, ids, w)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):  # 24 fit; CPU cannot capture
        graphs.moe("layer", lambda *a: None, x[:24], ids[:24], w[:24])


def test_gemms_beside_communication_leave_its_sms():
    """Under an SM budget a layer's persistent GEMMs take the SMs the communication leaves (a CPU
    counts 4 stand-in SMs); without a budget, or with one of every SM (or more), one program per
    SM (None), not a GEMM squeezed onto one SM."""
    from ray_ep.pipeline import gemm_sms_beside

    assert gemm_sms_beside(None, torch.device("cpu")) is None
    assert gemm_sms_beside(1, torch.device("cpu")) == 3
    assert gemm_sms_beside(3, torch.device("cpu")) == 1
    assert gemm_sms_beside(4, torch.device("cpu")) is None
    assert gemm_sms_beside(132, torch.device("cpu")) is None


@pytest.mark.parametrize("bad", [0, 9, 1.5, True, "2"])
def test_bad_micro_batches_is_refused(ep2, bad):
    cfg = ep2.config
    xs, ids, ws = inputs(cfg, 4, seed=9)
    with pytest.raises(EPInputError, match="micro_batches must be an int from 1 to 8"):
        ep2.forward(xs, ids, ws, micro_batches=bad)


@pytest.mark.parametrize("counts", ["zero-on-rank-0", "zero-everywhere", "one-token"])
def test_empty_and_single_token_ranks(ep, counts):
    cfg = ep.config
    R = cfg.world_size
    num = {"zero-on-rank-0": [0] + [6] * (R - 1), "zero-everywhere": [0] * R, "one-token": [1] * R}[counts]
    xs, ids, ws = inputs(cfg, num, seed=4)
    for fused in (True, False):
        outs = ep.forward(xs, ids, ws, fused=fused)
        assert [o.shape[0] for o in outs] == num
        assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))


def test_rank_that_receives_nothing(ep2):
    """Every token routed to rank 0's experts only: rank 1 receives no rows at all."""
    cfg = ep2.config
    L = cfg.experts_per_rank
    xs, _, ws = inputs(cfg, 8, seed=5)
    g = torch.Generator().manual_seed(5)
    ids = [torch.stack([torch.randperm(L, generator=g)[: cfg.top_k] for _ in range(8)]).to(torch.int32)
           for _ in range(cfg.world_size)]
    summaries = ep2.dispatch(xs, ids, ws)
    assert summaries[1].tokens_per_expert == [0] * L and summaries[1].rows_from_rank == [0, 0]
    assert summaries[0].rows_from_rank == [8, 8]
    ep2.compute()
    outs = ep2.combine()
    assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))


def test_all_tokens_to_one_expert_at_the_largest_batch(ep):
    """routing 'one-expert' at max_tokens_per_rank on every rank: expert 0 gets R * N_max rows."""
    cfg = ep.config
    N, R = cfg.max_tokens_per_rank, cfg.world_size
    xs, ids, ws = inputs(cfg, N, seed=6, routing="one-expert")
    summaries = ep.dispatch(xs, ids, ws)
    assert summaries[0].tokens_per_expert[0] == R * N
    ep.compute()
    outs = ep.combine()
    assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))
    assert ep.check(routing="one-expert", seed=7).passed  # num_tokens=None: N_max per rank


def test_largest_batch_uniform(ep):
    cfg = ep.config
    xs, ids, ws = inputs(cfg, cfg.max_tokens_per_rank, seed=8)
    outs = ep.forward(xs, ids, ws, fused=False)
    assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))


def test_masked_slots_and_fully_masked_token(ep2):
    cfg = ep2.config
    xs, ids, ws = inputs(cfg, [6, 4], seed=9)
    ids = [i.clone() for i in ids]
    ids[0][0, 1:] = -1  # one expert left
    ids[0][1, :] = -1  # no expert at all: the output row is zero
    ids[1][:, -1] = -1
    outs = ep2.forward(xs, ids, ws)
    assert bool((outs[0][1] == 0).all())
    assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))


@pytest.mark.parametrize("variant", ["fp32-x", "fp16-x", "int64-ids-bf16-weights", "non-contiguous"])
def test_accepted_input_formats(ep2, variant):
    cfg = ep2.config
    xs, ids, ws = inputs(cfg, [5, 3], seed=10)
    if variant == "fp32-x":
        xs = [x.float() for x in xs]
    elif variant == "fp16-x":
        xs = [x.half() for x in xs]
    elif variant == "int64-ids-bf16-weights":
        ids = [i.long() for i in ids]
        ws = [w.to(torch.bfloat16) for w in ws]
    else:  # every tensor a strided view
        xs = [torch.cat([x, x], dim=1)[:, ::2] for x in xs]
        ids = [i.t().contiguous().t() for i in ids]
        ws = [w.t().contiguous().t() for w in ws]
        assert not xs[0].is_contiguous() and not ids[0].is_contiguous()
    outs = ep2.forward(xs, ids, ws)
    assert all(o.dtype == torch.bfloat16 for o in outs)
    # The workers dispatch bf16 rows: the reference sees what went on the wire.
    ref_xs = [x.to(torch.bfloat16) for x in xs]
    assert_close_to_reference(cfg, outs, ref_xs, ids, [w.float() for w in ws], world_weights(cfg, LAYER0_SEED))


def test_fp32_output(ep4):
    cfg = ep4.config
    xs, ids, ws = inputs(cfg, 6, seed=11)
    outs = ep4.forward(xs, ids, ws, out_dtype="fp32")
    assert all(o.dtype == torch.float32 for o in outs)
    assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))


# ---- phases -------------------------------------------------------------------------------------
def expected_rows_from_rank(d: reference.RankDispatch, R: int) -> list[int]:
    """Tokens each source sent to this rank (a token goes once to a rank, whatever its K)."""
    pairs = {(s, t) for s, t, _ in d.src_info.tolist() if s >= 0}
    return [sum(1 for s, _ in pairs if s == src) for src in range(R)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
def test_phase_by_phase_equals_reference_and_forward(ep, fused):
    cfg = ep.config
    R = cfg.world_size
    xs, ids, ws = inputs(cfg, [12, 0, 30, 5][:R], seed=12, routing="skewed")
    want = reference.dispatch_world(cfg, xs, ids)
    if fused:
        summaries = ep.dispatch(xs, ids, ws)
    else:
        assert ep.dispatch_send(xs, ids, ws) is None
        summaries = ep.dispatch_recv()
    for r in range(R):
        s, d = summaries[r], want[r]
        assert s.rank == r
        assert s.tokens_per_expert == d.num_tokens.tolist()
        assert s.rows_from_rank == expected_rows_from_rank(d, R)
        got = ep.dispatched(r)
        assert torch.equal(got["row_offsets"].int(), d.row_offsets)
        assert torch.equal(got["num_tokens"].int(), d.num_tokens)
        # exact: bf16 rows only travel, padding rows are zero on both sides
        assert torch.equal(got["x"], d.dequantized()), f"rank {r}: dispatched rows differ"
    ep.compute()
    ep.dispatched(0)  # still readable between compute and combine
    outs = ep.combine(fused=fused)
    assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))
    # the phases are the forward, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(outs, ep.forward(xs, ids, ws, fused=fused)))


def test_split_dispatch_then_fused_combine(ep2):
    cfg = ep2.config
    xs, ids, ws = inputs(cfg, 10, seed=13)
    ep2.dispatch_send(xs, ids, ws)
    ep2.dispatch_recv()
    ep2.compute()
    outs = ep2.combine(fused=True, out_dtype="fp32")
    assert all(o.dtype == torch.float32 for o in outs)
    assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))


def test_out_of_order_phases_raise_state_error(ep2):
    cfg = ep2.config
    xs, ids, ws = inputs(cfg, 4, seed=14)
    ep2.forward(xs, ids, ws)  # leaves no phase open
    with pytest.raises(EPStateError, match=r"compute\(\) must follow dispatch\(\)"):
        ep2.compute()
    with pytest.raises(EPStateError, match=r"combine\(\) must follow compute\(\)"):
        ep2.combine()
    with pytest.raises(EPStateError, match=r"dispatch_recv\(\) must follow dispatch_send\(\)"):
        ep2.dispatch_recv()
    with pytest.raises(EPStateError, match="needs a completed dispatch"):
        ep2.dispatched(0)
    ep2.dispatch(xs, ids, ws)
    with pytest.raises(EPStateError, match=r"combine\(\) must follow compute\(\) \(current phase: dispatched\)"):
        ep2.combine()
    with pytest.raises(EPStateError, match=r"dispatch_recv\(\) must follow dispatch_send\(\)"):
        ep2.dispatch_recv()
    with pytest.raises(EPStateError, match="no experts loaded for layer 7"):
        ep2.compute(layer=7)
    ep2.compute()  # the dispatch is still there after the refusals
    ep2.combine()
    with pytest.raises(EPStateError, match=r"combine\(\) must follow compute\(\)"):
        ep2.combine()  # combine consumes the dispatch
    with pytest.raises(EPStateError, match="already started"):
        ep2.start()
    assert_usable(ep2)


# ---- routing from logits ------------------------------------------------------------------------
def test_router_logits_route_like_reference(ep):
    cfg = ep.config
    g = torch.Generator().manual_seed(15)
    counts = [9, 4, 0, 13][: cfg.world_size]
    xs = [torch.randn(T, cfg.hidden_size, generator=g).to(torch.bfloat16) for T in counts]
    logits = [torch.randn(T, cfg.n_experts, generator=g) for T in counts]
    outs = ep.forward(xs, router_logits=logits)
    routed = [route(lg, cfg.top_k) for lg in logits]
    ids, ws = [r[0] for r in routed], [r[1] for r in routed]
    assert all(torch.equal(a, b) for a, b in zip(outs, ep.forward(xs, ids, ws)))
    assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))


def test_router_logits_bad_arguments(ep2):
    cfg = ep2.config
    xs, ids, ws = inputs(cfg, 3, seed=16)
    logits = [torch.randn(3, cfg.n_experts) for _ in range(2)]
    with pytest.raises(EPInputError, match="either router_logits or topk_ids"):
        ep2.forward(xs, ids, ws, router_logits=logits)
    with pytest.raises(EPInputError, match="one tensor per rank"):
        ep2.forward(xs, router_logits=logits[:1])
    with pytest.raises(EPInputError, match=r"router_logits must be \[T=3, n_experts=16\]"):
        ep2.forward(xs, router_logits=[torch.randn(3, 8), logits[1]])
    with pytest.raises(EPInputError, match=r"router_logits must be \[T=3, n_experts=16\]"):
        ep2.forward(xs, router_logits=[torch.randn(4, 16), logits[1]])
    with pytest.raises(EPInputError, match=r"rank 1: router_logits must be .*, got list"):
        ep2.forward(xs, router_logits=[logits[0], logits[1].tolist()])
    with pytest.raises(EPInputError, match=r"xs must be a list with one tensor per rank \(2\), got 1"):
        ep2.forward(xs[:1], router_logits=logits)  # too few xs for the logits
    with pytest.raises(EPInputError, match="needs topk_ids and topk_weights"):
        ep2.forward(xs, ids)
    assert_usable(ep2)


# ---- user code inside the workers -----------------------------------------------------------
def _moe_in_worker(worker, num_tokens, seed, layer=0):
    """Every rank rebuilds the world's inputs from the seed and runs its share (collective)."""
    xs, ids, ws = make_inputs(worker.config, num_tokens, seed=seed)
    r = worker.rank
    out = worker.moe(xs[r], ids[r], ws[r], layer=layer)
    assert out.device == worker.device
    return r, out.cpu()


def _two_layers_with_state(worker, x, ids, ws):
    """A tiny 'model': two MoE layers with a residual, and a call counter kept in worker.state."""
    worker.state["calls"] = worker.state.get("calls", 0) + 1
    h = x.float() + worker.moe(x, ids, ws, layer=0).float()
    out = worker.moe(h.to(torch.bfloat16), ids, ws, layer=1)
    return worker.state["calls"], out.cpu()


def _raise_everywhere(worker):
    raise ValueError(f"user code failed on rank {worker.rank}")


def test_run_executes_user_code_in_the_workers(ep):
    cfg = ep.config
    counts = [3, 8, 0, 5][: cfg.world_size]
    got = ep.run(_moe_in_worker, counts, 17)
    assert [r for r, _ in got] == list(range(cfg.world_size))
    xs, ids, ws = inputs(cfg, counts, seed=17)
    want = ep.forward(xs, ids, ws)
    assert all(torch.equal(o, w) for (_, o), w in zip(got, want))


def test_run_with_per_rank_args_state_and_two_layers(ep2):
    cfg = ep2.config
    ep2.load_experts(seed=1, layer=1)
    xs, ids, ws = inputs(cfg, [6, 2], seed=18)
    per_rank = [(x, i, w) for x, i, w in zip(xs, ids, ws)]
    first = ep2.run(_two_layers_with_state, args_per_rank=per_rank)
    second = ep2.run(_two_layers_with_state, args_per_rank=per_rank)
    assert [c for c, _ in second] == [c + 1 for c, _ in first]  # worker.state persists
    # the same two layers driven from here
    h = ep2.forward(xs, ids, ws, layer=0)
    h = [(x.float() + o.float()).to(torch.bfloat16) for x, o in zip(xs, h)]
    want = ep2.forward(h, ids, ws, layer=1)
    assert all(torch.equal(o, w) for (_, o), w in zip(second, want))
    with pytest.raises(EPInputError, match="one tuple per rank"):
        ep2.run(_two_layers_with_state, args_per_rank=per_rank[:1])


def _nvshmem_options(worker):
    return {k: v for k, v in os.environ.items() if k.startswith(("NVSHMEM_", "NCCL_NVLS", "TORCH_SYMM_MEM"))}


def test_workers_start_with_the_nvshmem_environment_of_one_node(ep2):
    # in the worker's environment from its start (runtime_env), before anything reads NVSHMEM's
    # options: on one node no network transport and no proxy thread, multicast off
    from ray_ep.transport.nvshmem import nvshmem_env

    for got in ep2.run(_nvshmem_options):
        assert {k: got.get(k) for k in nvshmem_env(1)} == nvshmem_env(1)
    assert nvshmem_env(1)["NVSHMEM_DISABLE_LOCAL_ONLY_PROXY"] == "1"


def test_run_error_is_raised_with_its_type_and_cluster_stays_usable(ep2):
    with pytest.raises(ValueError, match="user code failed on rank 0"):
        ep2.run(_raise_everywhere)
    assert_usable(ep2)


# ---- experts and layers ---------------------------------------------------------------------
def test_load_given_world_weights(ep):
    cfg = ep.config
    base = init_expert_weights(cfg, seed=21)
    # not what any seed gives: flip and rescale, so only the given tensors can match
    weights = ExpertWeights((-base.w_gate_up * 0.5).to(torch.bfloat16), base.w_down.flip(0),
                                      base.shared_gate_up, base.shared_down)
    ep.load_experts(weights, layer=2)
    xs, ids, ws = inputs(cfg, 10, seed=22, routing="skewed")
    outs = ep.forward(xs, ids, ws, layer=2)
    assert_close_to_reference(cfg, outs, xs, ids, ws, weights)
    seeded = reference.moe_forward(cfg, xs, ids, ws, world_weights(cfg, LAYER0_SEED))
    assert max(rel_errors(outs, seeded)) > 0.5  # really not layer 0


def test_load_weights_of_the_wrong_shape_raises(ep2):
    cfg = ep2.config
    other = EPConfig.preset("tiny", gpus_per_node=2, intermediate_size=32)
    with pytest.raises(EPInputError, match=r"w_gate_up has shape \[16, 128, 64\], this config needs \[16, 128, 128\]"):
        ep2.load_experts(init_expert_weights(other, seed=0), layer=3)
    with pytest.raises(EPStateError, match="no experts loaded for layer 3"):
        ep2.forward(*inputs(cfg, 2, seed=0), layer=3)
    assert_usable(ep2)


def test_layers_keep_their_own_experts(ep2):
    cfg = ep2.config
    ep2.load_experts(seed=1, layer=1)
    xs, ids, ws = inputs(cfg, 12, seed=23)
    out0 = ep2.forward(xs, ids, ws, layer=0)
    out1 = ep2.forward(xs, ids, ws, layer=1)
    assert_close_to_reference(cfg, out0, xs, ids, ws, world_weights(cfg, LAYER0_SEED))
    assert_close_to_reference(cfg, out1, xs, ids, ws, world_weights(cfg, 1))
    assert max(rel_errors(out0, out1)) > 0.5
    # phases pick the layer at compute time
    ep2.dispatch(xs, ids, ws)
    ep2.compute(layer=1)
    assert all(torch.equal(a, b) for a, b in zip(ep2.combine(), out1))
    # loading (and checking with) other layers leaves layer 0 alone
    ep2.load_experts(seed=5, layer=1)
    assert ep2.check(num_tokens=8, expert_seed=3).passed
    assert all(torch.equal(a, b) for a, b in zip(ep2.forward(xs, ids, ws, layer=0), out0))


# ---- bad input --------------------------------------------------------------------------------
def _bad_inputs(cfg: EPConfig, case: str):
    """(xs, ids, ws) for one kind of bad input, and a fragment of the expected message."""
    xs, ids, ws = inputs(cfg, [4, 3], seed=30)
    xs, ids, ws = list(xs), [i.clone() for i in ids], list(ws)
    N, E, H, K = cfg.max_tokens_per_rank, cfg.n_experts, cfg.hidden_size, cfg.top_k
    if case == "too-many-tokens":
        big = inputs(cfg, N + 1, seed=31)
        xs[1], ids[1], ws[1] = big[0][1], big[1][1], big[2][1]
        return (xs, ids, ws), f"rank 1: {N + 1} tokens exceed max_tokens_per_rank = {N}"
    if case == "expert-id-too-large":
        ids[0][2, 1] = E
        return (xs, ids, ws), rf"rank 0: topk_ids must lie in \[0, n_experts={E}\) or be -1"
    if case == "expert-id-below-minus-one":
        ids[1][0, 0] = -2
        return (xs, ids, ws), r"rank 1: topk_ids must lie in .* found values in \[-2,"
    if case == "duplicate-expert":
        ids[0][1, 1] = ids[0][1, 0]
        return (xs, ids, ws), "rank 0: a token lists the same expert twice"
    if case == "int-x":
        xs[0] = torch.ones(4, H, dtype=torch.int32)
        return (xs, ids, ws), "rank 0: x must be bf16, fp16 or fp32, got torch.int32"
    if case == "float64-ids":
        ids[1] = ids[1].double()
        return (xs, ids, ws), "rank 1: topk_ids has dtype torch.float64"
    if case == "hidden-mismatch":
        xs[1] = torch.zeros(3, H + 16, dtype=torch.bfloat16)
        return (xs, ids, ws), rf"rank 1: x must be \[T, hidden_size={H}\], got \(3, {H + 16}\)"
    if case == "ids-shape-mismatch":
        ids[0] = ids[0][:, :2]
        return (xs, ids, ws), rf"rank 0: topk_ids must be \[T=4, top_k={K}\], got \(4, 2\)"
    if case == "weights-shape-mismatch":
        ws[1] = ws[1][:2]
        return (xs, ids, ws), rf"rank 1: topk_weights must be \[T=3, top_k={K}\]"
    if case == "x-not-2d":
        xs[0] = xs[0][None]
        return (xs, ids, ws), r"rank 0: x must be \[T, hidden_size"
    if case == "too-few-ranks":
        return (xs[:1], ids, ws), r"xs must be a list with one tensor per rank \(2\), got 1"
    if case == "too-many-ranks":
        return (xs, ids, ws + ws[:1]), r"topk_weights must be a list with one tensor per rank \(2\), got 3"
    if case == "not-a-list":
        return (xs[0], ids, ws), "xs must be a list with one tensor per rank"
    if case == "nan-weights":
        ws[1] = ws[1].clone()
        ws[1][2, 0] = float("nan")
        return (xs, ids, ws), "rank 1: topk_weights contain NaN or Inf"
    if case == "inf-weights":
        ws[0] = ws[0].clone()
        ws[0][0, 3] = float("inf")
        return (xs, ids, ws), "rank 0: topk_weights contain NaN or Inf"
    if case == "nan-x":
        xs[0] = xs[0].clone()
        xs[0][3, 7] = float("nan")
        return (xs, ids, ws), "rank 0: x contains NaN or Inf"
    raise AssertionError(case)


BAD_CASES = ["too-many-tokens", "expert-id-too-large", "expert-id-below-minus-one", "duplicate-expert", "int-x",
             "float64-ids", "hidden-mismatch", "ids-shape-mismatch", "weights-shape-mismatch", "x-not-2d",
             "too-few-ranks", "too-many-ranks", "not-a-list", "nan-weights", "inf-weights", "nan-x"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_raises_and_leaves_the_cluster_usable(ep2, case):
    args, message = _bad_inputs(ep2.config, case)
    for call in (ep2.forward, ep2.dispatch, ep2.dispatch_send):
        with pytest.raises(EPInputError, match=message):
            call(*args)
    assert_usable(ep2)


def test_refused_dispatch_keeps_the_open_one(ep2):
    """Inputs are checked before any worker is called: a dispatch in progress survives."""
    cfg = ep2.config
    xs, ids, ws = inputs(cfg, [5, 6], seed=34)
    want = ep2.forward(xs, ids, ws)
    ep2.dispatch(xs, ids, ws)
    (bad_xs, bad_ids, bad_ws), message = _bad_inputs(cfg, "duplicate-expert")
    with pytest.raises(EPInputError, match=message):
        ep2.dispatch(bad_xs, bad_ids, bad_ws)
    ep2.compute()
    assert all(torch.equal(a, b) for a, b in zip(ep2.combine(), want))


def test_duplicate_masked_ids_are_fine(ep2):
    """-1 may repeat inside a token: only real expert ids must be distinct."""
    cfg = ep2.config
    xs, ids, ws = inputs(cfg, [2, 2], seed=32)
    ids = [i.clone() for i in ids]
    ids[0][0, 2:] = -1
    outs = ep2.forward(xs, ids, ws)
    assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))


def test_bad_output_dtype_raises_input_error(ep2):
    xs, ids, ws = inputs(ep2.config, 2, seed=33)
    with pytest.raises(EPInputError, match=r"out_dtype must be one of \['bf16', 'fp32'\], got 'fp16'"):
        ep2.forward(xs, ids, ws, out_dtype="fp16")
    ep2.dispatch(xs, ids, ws)
    ep2.compute()
    with pytest.raises(EPInputError, match="out_dtype"):
        ep2.combine(out_dtype=torch.bfloat16)
    ep2.combine()  # the refused combine left the computed dispatch in place
    assert_usable(ep2)


# ---- cluster state ------------------------------------------------------------------------------
def test_info_and_health(ep):
    info = ep.info()
    assert [i["rank"] for i in info] == list(range(ep.world_size))
    assert all(i["device"] == "cpu" and i["node_rank"] == 0 for i in info)
    assert [i["local_rank"] for i in info] == list(range(ep.world_size))
    assert len({i["node_id"] for i in info}) == 1
    assert ep.health() == [True] * ep.world_size
    assert ep.backend == "torch"
    assert ep.buffer_plan().total_bytes > 0


def test_calls_before_start_raise_state_error():
    ep = EPCluster(EPConfig.preset("tiny"))  # no Ray needed: nothing is started
    xs, ids, ws = inputs(ep.config, 2, seed=0)
    for call in (lambda: ep.forward(xs, ids, ws), lambda: ep.dispatch(xs, ids, ws),
                 lambda: ep.dispatch_send(xs, ids, ws), ep.dispatch_recv, ep.compute, ep.combine,
                 ep.info, ep.health, lambda: ep.load_experts(seed=0), lambda: ep.run(_raise_everywhere),
                 lambda: ep.check(num_tokens=2), lambda: ep.dispatched(0)):
        with pytest.raises(EPStateError):
            call()
    with pytest.raises(EPStateError, match="not running"):
        ep.forward(xs, ids, ws)
    ep.shutdown()  # nothing to stop, no error


def test_fresh_cluster_without_experts_then_shutdown_and_restart(ray_session):
    cfg = EPConfig.preset("tiny", gpus_per_node=2)
    xs, ids, ws = inputs(cfg, 3, seed=40)
    ep = EPCluster(cfg).start()
    try:
        with pytest.raises(EPStateError, match="no experts loaded for layer 0"):
            ep.forward(xs, ids, ws)
        ep.dispatch(xs, ids, ws)  # moving tokens needs no experts
        with pytest.raises(EPStateError, match="no experts loaded for layer 0"):
            ep.compute()
    finally:
        ep.shutdown()
    assert ray.is_initialized()  # the cluster did not start Ray, so it leaves it running
    for call in (lambda: ep.forward(xs, ids, ws), lambda: ep.dispatch(xs, ids, ws), ep.info, ep.health,
                 lambda: ep.load_experts(seed=0)):
        with pytest.raises(EPStateError, match="not running"):
            call()
    ep.shutdown()  # idempotent
    # the rebuild path: start again, experts must be loaded again
    with ep:
        with pytest.raises(EPStateError, match="no experts loaded"):
            ep.forward(xs, ids, ws)
        ep.load_experts(seed=LAYER0_SEED)
        assert_usable(ep)
    with pytest.raises(EPStateError, match="not running"):
        ep.info()


def test_dead_worker_fails_the_cluster(ray_session):
    cfg = EPConfig.preset("tiny", gpus_per_node=2, call_timeout_s=60.0)
    xs, ids, ws = inputs(cfg, 3, seed=41)
    ep = start_cluster(cfg)
    try:
        ep.forward(xs, ids, ws)
        kill_and_wait(ep._group.actors[1])
        with pytest.raises(EPWorkerError, match=r"rank\(s\) died during 'forward'") as info:
            ep.forward(xs, ids, ws)
        assert "rank 1" in str(info.value) and "rebuilt" in str(info.value)
        for call in (lambda: ep.forward(xs, ids, ws), ep.info, lambda: ep.load_experts(seed=0),
                     lambda: ep.run(_raise_everywhere)):
            with pytest.raises(EPStateError, match="unusable"):
                call()
        assert ep.health() == [False, False]  # a failed group serves nothing, whichever rank died
    finally:
        ep.shutdown()
    with pytest.raises(EPStateError, match="not running"):
        ep.info()
    ep.shutdown()


# ---- other configurations ---------------------------------------------------------------------
@pytest.fixture(scope="class")
def ep_fp8(ray_session):
    """tiny on 2 ranks with fp8 dispatch; lives as long as the class that uses it."""
    ep = start_cluster(EPConfig.preset("tiny", gpus_per_node=2, dispatch_dtype="fp8"))
    yield ep
    ep.shutdown()


@pytest.fixture(scope="class")
def ep_shared(ray_session):
    """tiny on 2 ranks with one shared expert; lives as long as the class that uses it."""
    ep = start_cluster(EPConfig.preset("tiny", gpus_per_node=2, n_shared_experts=1))
    yield ep
    ep.shutdown()


class TestFp8Dispatch:
    """fp8 e4m3 rows on the wire (one fp32 scale per 128 channels); the reference quantises
    the same way, so the comparison keeps the bf16 tolerance."""

    @pytest.mark.parametrize("routing", ROUTINGS)
    def test_check_and_forward(self, ep_fp8, routing):
        cfg = ep_fp8.config
        assert ep_fp8.check(num_tokens=[12, 0], routing=routing, seed=50).passed
        xs, ids, ws = inputs(cfg, cfg.max_tokens_per_rank, seed=51, routing=routing)
        for fused in (True, False):
            outs = ep_fp8.forward(xs, ids, ws, fused=fused)
            assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))

    def test_micro_batched(self, ep_fp8):
        cfg = ep_fp8.config
        xs, ids, ws = inputs(cfg, [cfg.max_tokens_per_rank, 3], seed=53)
        outs = ep_fp8.forward(xs, ids, ws, micro_batches=2)
        assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))

    def test_dispatched_rows_are_the_reference_fp8_rows(self, ep_fp8):
        cfg = ep_fp8.config
        xs, ids, ws = inputs(cfg, [9, 14], seed=52, routing="skewed")
        xs[0] = xs[0].clone()
        xs[0][0] = 0  # an all-zero group: scale 1
        want = reference.dispatch_world(cfg, xs, ids)
        ep_fp8.dispatch_send(xs, ids, ws)
        ep_fp8.dispatch_recv()
        for r in range(cfg.world_size):
            got = ep_fp8.dispatched(r)
            assert torch.equal(got["row_offsets"].int(), want[r].row_offsets)
            assert torch.equal(got["x"], want[r].dequantized()), f"rank {r}: fp8 rows differ"
        ep_fp8.compute()
        outs = ep_fp8.combine(fused=False)
        assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))


@pytest.fixture(scope="class")
def ep_fp8w(ray_session):
    """tiny on 2 ranks with fp8 expert weights (F 128: both GEMMs reduce over multiples of 128),
    bf16 dispatch (rows quantised to fp8 before the GEMM) and one shared expert (fp8 too)."""
    ep = start_cluster(EPConfig.preset("tiny", gpus_per_node=2, intermediate_size=128, expert_dtype="fp8",
                                       n_shared_experts=1))
    yield ep
    ep.shutdown()


def _kmajor(t: torch.Tensor) -> torch.Tensor:
    """The same values with D contiguous, as a checkpoint's [out, in] rows viewed [in, out]."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _bad_fp8(w: ExpertWeights, case: str) -> tuple[ExpertWeights, str]:
    """Weights broken one way, and a fragment of the error load_experts must give."""
    from dataclasses import replace

    if case == "scale-shape":
        return replace(w, w_gate_up_scales=w.w_gate_up_scales[:, :, :1]), \
            r"w_gate_up_scales has shape \[16, 1, 1\], expected \[16, 1, 2\]"
    if case == "nan-scale":
        s = w.w_gate_up_scales.clone()
        s[3, 0, 1] = float("nan")
        return replace(w, w_gate_up_scales=s), \
            r"w_gate_up_scales holds a scale that is not finite and positive \(nan at \[3, 0, 1\]\)"
    if case == "zero-scale":
        s = w.w_down_scales.clone()
        s[0, 0, 0] = 0.0
        return replace(w, w_down_scales=s), "not finite and positive"
    if case == "no-scales":
        return replace(w, w_gate_up_scales=None), r"fp8 w_gate_up needs w_gate_up_scales \[16, 1, 2\] fp32"
    if case == "fp64-scales":
        return replace(w, w_down_scales=w.w_down_scales.double()), "w_down_scales is float64, expected float32"
    if case == "nan-weight":
        q = w.w_gate_up.clone()
        q.view(torch.uint8)[5, 7, 9] = 0x7F
        return replace(w, w_gate_up=q), r"w_gate_up holds NaN at \[5, 7, 9\]"
    if case == "mixed-dtypes":
        return replace(w, w_down=w.w_down.float() * 0), "w_down is float32, expected float8_e4m3fn"
    if case == "scales-on-bf16":
        return replace(w.to_expert_dtype("bf16"), w_down_scales=w.w_down_scales), "block scales belong to float8_e4m3fn"
    raise AssertionError(case)


BAD_FP8 = ["scale-shape", "nan-scale", "zero-scale", "no-scales", "fp64-scales", "nan-weight", "mixed-dtypes",
           "scales-on-bf16"]


class TestFp8Experts:
    """Routed and shared experts in fp8 e4m3 with one fp32 scale per 128 x 128 block; the reference
    dequantises the weights and quantises the activations per 128 channels the same way, so
    the comparison keeps the bf16 tolerance."""

    @pytest.mark.parametrize("routing", ROUTINGS)
    def test_check_and_forward(self, ep_fp8w, routing):
        cfg = ep_fp8w.config
        w = world_weights(cfg, LAYER0_SEED)
        assert w.fp8 and w.shared_fp8 and w.shared_down.shape[0] == cfg.n_shared_experts > 0
        report = ep_fp8w.check(num_tokens=[12, 0], routing=routing, seed=70)
        # fp8 weights pass at FP8_EXPERTS_TOLERANCE (an e4m3 step of a SwiGLU value on a GPU)
        assert report.passed and report.tolerance == 5e-2, report.table()
        xs, ids, ws = inputs(cfg, cfg.max_tokens_per_rank, seed=71, routing=routing)
        for fused in (True, False):
            outs = ep_fp8w.forward(xs, ids, ws, fused=fused)
            assert_close_to_reference(cfg, outs, xs, ids, ws, w)

    def test_given_weights_fp8_or_bf16(self, ep_fp8w):
        # fp8 weights in a checkpoint's K-major layout load as they are; bf16 weights are
        # quantised per block at load, which gives the seeded fp8 weights of the same draw
        cfg = ep_fp8w.config
        fp8 = init_expert_weights(cfg, seed=72)
        from dataclasses import replace

        given = replace(fp8, w_gate_up=_kmajor(fp8.w_gate_up), w_down=_kmajor(fp8.w_down))
        ep_fp8w.load_experts(given, layer=1)
        bf16 = init_expert_weights(cfg.model_copy(update={"expert_dtype": "bf16"}), seed=72)
        ep_fp8w.load_experts(bf16, layer=2)
        xs, ids, ws = inputs(cfg, [20, 9], seed=73, routing="skewed")
        out1 = ep_fp8w.forward(xs, ids, ws, layer=1)
        assert_close_to_reference(cfg, out1, xs, ids, ws, fp8)
        assert all(torch.equal(a, b) for a, b in zip(ep_fp8w.forward(xs, ids, ws, layer=2), out1))

    @pytest.mark.parametrize("case", BAD_FP8)
    def test_bad_weights_raise_at_load(self, ep_fp8w, case):
        w, match = _bad_fp8(init_expert_weights(ep_fp8w.config, seed=74), case)
        with pytest.raises(EPInputError, match=match):
            ep_fp8w.load_experts(w, layer=3)
        with pytest.raises(EPStateError, match="no experts loaded for layer 3"):
            ep_fp8w.forward(*inputs(ep_fp8w.config, 2, seed=0), layer=3)


def test_fp8_weights_need_k_multiple_of_128(ep2):
    # ep2 has F = 64: the down projection's reduction dim cannot hold 128 x 128 blocks
    cfg = ep2.config
    big = EPConfig.preset("tiny", gpus_per_node=2, intermediate_size=128, expert_dtype="fp8")
    w = init_expert_weights(big, seed=0)
    from dataclasses import replace

    w = replace(w, w_gate_up=w.w_gate_up[:, :, :2 * cfg.intermediate_size], w_down=w.w_down[:, :cfg.intermediate_size],
                shared_gate_up=w.shared_gate_up[:, :, :2 * cfg.intermediate_size],
                shared_down=w.shared_down[:, :cfg.intermediate_size])
    with pytest.raises(EPInputError, match=r"intermediate_size \(F\) % 128 == 0 .* got 64"):
        ep2.load_experts(w, layer=3)
    assert_usable(ep2)


class TestSharedExperts:
    """One shared expert, applied to every token on its own rank and added to the output."""

    @pytest.mark.parametrize("routing", ROUTINGS)
    def test_check_and_forward(self, ep_shared, routing):
        cfg = ep_shared.config
        assert ep_shared.check(num_tokens=[0, 10], routing=routing, seed=60).passed
        xs, ids, ws = inputs(cfg, [cfg.max_tokens_per_rank, 0], seed=61, routing=routing)
        outs = ep_shared.forward(xs, ids, ws, fused=False)
        assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))

    def test_micro_batched(self, ep_shared):
        cfg = ep_shared.config
        xs, ids, ws = inputs(cfg, [cfg.max_tokens_per_rank, 5], seed=65, routing="skewed")
        outs = ep_shared.forward(xs, ids, ws, micro_batches=2)
        assert_close_to_reference(cfg, outs, xs, ids, ws, world_weights(cfg, LAYER0_SEED))

    def test_shared_expert_alone_on_masked_tokens(self, ep_shared):
        cfg = ep_shared.config
        w = world_weights(cfg, LAYER0_SEED)
        xs, ids, ws = inputs(cfg, [4, 4], seed=62)
        ids = [torch.full_like(i, -1) for i in ids]  # no routed expert at all
        outs = ep_shared.forward(xs, ids, ws, out_dtype="fp32")
        for x, o in zip(xs, outs):
            assert max(rel_errors([o], [reference.shared_experts(x, w)])) <= TOL["fp32"]

    def test_phases_and_given_weights(self, ep_shared):
        cfg = ep_shared.config
        given = init_expert_weights(cfg, seed=63)
        ep_shared.load_experts(given, layer=1)
        xs, ids, ws = inputs(cfg, [7, 3], seed=64)
        ep_shared.dispatch(xs, ids, ws)
        ep_shared.compute(layer=1)
        outs = ep_shared.combine()
        assert_close_to_reference(cfg, outs, xs, ids, ws, given)
        assert all(torch.equal(a, b) for a, b in zip(outs, ep_shared.forward(xs, ids, ws, layer=1)))


# ---- checked before any worker runs ----------------------------------------------------------
@pytest.mark.parametrize("kwargs, words", [
    (dict(num_tokens=33), "0..max_tokens_per_rank = 32"),
    (dict(num_tokens=[4, 40]), "0..max_tokens_per_rank = 32"),
    (dict(num_tokens=[4]), "one int per rank (2)"),
    (dict(num_tokens=-1), "0..max_tokens_per_rank"),
    (dict(routing="zipf"), "routing must be one of uniform, skewed, one-expert"),
    (dict(rounds=0), "rounds must be at least 1"),
    (dict(num_tokens=0), "0 on every rank"),
])
def test_check_refuses_bad_arguments_in_the_driver(ep2, kwargs, words):
    with pytest.raises(EPInputError) as info:
        ep2.check(**kwargs)
    assert words in str(info.value)
    assert_usable(ep2)


@pytest.mark.parametrize("layer", [-1, "check", 1.0, True])
def test_expert_layers_are_non_negative_ints(ep2, layer):
    # negative slots belong to ray_ep (check() loads its experts at -1): a user's layer there
    # would be deleted by the next check
    with pytest.raises(EPInputError, match="layer must be an int >= 0"):
        ep2.load_experts(seed=0, layer=layer)
    assert_usable(ep2)


def test_memory_plan_refuses_experts_that_do_not_fit(ray_session):
    # one expert of 3 x H x F bf16 = 48 GiB per rank: more than a test machine has free; the
    # driver refuses before any worker builds it, and the cluster stays usable
    cfg = EPConfig(hidden_size=128, intermediate_size=64 * 2**20, n_experts=2, top_k=1, max_tokens_per_rank=1,
                   gpus_per_node=2)
    ep = EPCluster(cfg).start()
    try:
        with pytest.raises(EPClusterError) as info:
            ep.load_experts(seed=0)
        msg = str(info.value)
        assert "not enough memory for expert layer 0" in msg and "GiB" in msg and "--no-memory-check" in msg
        with pytest.raises(EPClusterError):
            ep.check(num_tokens=1)
        assert all(ep.health())
    finally:
        ep.shutdown()


def _silent_peer_on_rank_1(worker):
    if worker.rank == 1:
        raise EPTimeoutError("rank 1: dispatch timed out waiting for ranks [0], which never signalled")
    return "ok"


def test_a_timeout_in_a_worker_fails_the_group(ray_session):
    # after a silent peer the ranks are out of step: no "healthy but broken" group
    ep = EPCluster(EPConfig.preset("tiny", gpus_per_node=2)).start()
    try:
        with pytest.raises(EPTimeoutError, match="never signalled"):
            ep.run(_silent_peer_on_rank_1)
        assert ep.health() == [False, False]
        with pytest.raises(EPStateError, match="EPTimeoutError during 'run' on rank 1"):
            ep.check(num_tokens=4)
    finally:
        ep.shutdown()


def _scratch_rows(worker) -> int:
    return worker.group_state().comm.scratch.rows


def test_cpu_expert_scratch_follows_the_rows_not_the_capacity(ray_session):
    """CPU workers allocate the expert scratch by the rows that arrive: at a large
    max_tokens_per_rank a 5-token layer holds a few rows of scratch, not max_recv_rows; the
    output still matches the reference, and a larger batch grows the scratch."""
    cfg = EPConfig.preset("tiny", gpus_per_node=2, max_tokens_per_rank=65536)
    ep = EPCluster(cfg).start()
    try:
        ep.load_experts(seed=LAYER0_SEED)
        assert ep.run(_scratch_rows) == [0, 0]  # nothing at load time (capacity: 131072 rows each)
        w = world_weights(cfg, LAYER0_SEED)
        for n in (5, 40):
            xs, ids, ws = inputs(cfg, n, seed=70 + n)
            assert_close_to_reference(cfg, ep.forward(xs, ids, ws), xs, ids, ws, w)
            rows = ep.run(_scratch_rows)
            assert all(1 <= r <= 2 * n * cfg.top_k + cfg.experts_per_rank * cfg.expert_alignment for r in rows), rows
    finally:
        ep.shutdown()
