"""EPCommunicator inside plain torch.distributed ranks (spawned processes over gloo, no Ray):
the exchange against the reference, the split forms, and the errors at creation."""

from __future__ import annotations

import time

import pytest
import torch

from ray_ep import (EPCommunicator, EPConfig, EPConfigError, EPTimeoutError, EPWorkerError, init_expert_weights,
                    make_inputs, reference)
from ray_ep.communicator import check_summaries
from ray_ep.kernels.experts import LocalExperts, shared_experts
from spawn_ranks import RankError, run_ranks

TINY = dict(hidden_size=128, n_experts=8, top_k=2, intermediate_size=64, max_tokens_per_rank=16)
# |out - ref| / max|ref| with bf16 rows and bf16 partials on the wire (see reference.TOLERANCE)
BF16_TOL = 3e-2


def _layers_vs_reference(rank: int, cfg: EPConfig, routings: list[str]) -> dict:
    """Every routing: a fused and a split layer on this rank against the world's reference."""
    w = init_expert_weights(cfg, seed=0)
    loc = w.local(rank, cfg.experts_per_rank)
    errors = {}
    with EPCommunicator(cfg) as comm:  # CPU here; each rank's GPU in tests/test_gpu_communicator.py
        errors["backend"] = comm.backend
        experts = LocalExperts(*(t.to(comm.device) for t in (loc.w_gate_up, loc.w_down, loc.shared_gate_up,
                                                              loc.shared_down)))
        for i, routing in enumerate(routings):
            xs, ids, ws = make_inputs(cfg, 12, seed=i, routing=routing)
            ref = reference.moe_forward(cfg, xs, ids, ws, w)[rank].float()
            fused = comm.moe(xs[rank], ids[rank], ws[rank], experts).float().cpu()
            x, i_, w_ = comm.prepare_inputs(xs[rank], ids[rank], ws[rank])
            h = comm.dispatch_recv(comm.dispatch_send(x, i_, w_))
            rows = comm.expert_major(h, dtype=x.dtype).cpu()
            want = reference.dispatch_world(cfg, xs, ids)[rank]
            assert torch.equal(rows, want.x), "expert-major rows differ from the reference's"
            y = comm.run_experts(h, experts)
            split = comm.combine_recv(comm.combine_send(y, h), add_TH=shared_experts(x, experts)).float().cpu()
            scale = max(ref.abs().max().item(), 1e-6)
            errors[routing] = max((fused - ref).abs().max().item(), (split - ref).abs().max().item()) / scale
        errors["plan_bytes"] = comm.plan.total_bytes
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_layer_matches_reference(world):
    cfg = EPConfig(**TINY, gpus_per_node=world, n_shared_experts=1)
    out = run_ranks(_layers_vs_reference, world, cfg, ["uniform", "skewed", "one-expert"])
    for rank, errs in enumerate(out):
        assert errs.pop("plan_bytes") > 0 and errs.pop("backend") == "torch"
        for routing, rel in errs.items():
            assert rel <= BF16_TOL, (rank, routing, rel)


def _create(rank: int, cfgs: list[EPConfig]) -> str:
    with EPCommunicator(cfgs[rank]) as comm:
        return repr(comm)


def _errors(world: int, cfgs: list[EPConfig]) -> dict[int, tuple[str, str]]:
    with pytest.raises(RankError) as info:
        run_ranks(_create, world, cfgs, timeout_s=120)
    return info.value.errors


def test_mismatched_configs_fail_on_every_rank():
    cfg = EPConfig(**TINY, gpus_per_node=2)
    errors = _errors(2, [cfg, cfg.model_copy(update={"max_tokens_per_rank": 32})])
    assert sorted(errors) == [0, 1]
    for name, msg in errors.values():
        assert name == "EPConfigError"
        assert "max_tokens_per_rank = 16 here, 32 there" in msg, msg


def test_world_size_must_match_the_group():
    cfg = EPConfig(**TINY, gpus_per_node=4)
    errors = _errors(2, [cfg, cfg])
    assert sorted(errors) == [0, 1]
    assert all("process group has 2 ranks but the config's world size is" in m for _, m in errors.values())


def test_nvshmem_on_cpu_fails_on_every_rank():
    cfg = EPConfig(**TINY, gpus_per_node=2, backend="nvshmem")
    errors = _errors(2, [cfg, cfg])
    assert sorted(errors) == [0, 1]
    assert all("backend 'nvshmem' needs a CUDA device" in m for _, m in errors.values())


def _second_on_device(rank: int, cfg: EPConfig) -> str:
    first = EPCommunicator(cfg)
    try:
        EPCommunicator(cfg)
    except EPConfigError as e:
        msg = str(e)
    else:
        raise AssertionError("a second communicator on the device was created")
    first.close()
    with EPCommunicator(cfg):  # the device is free again
        pass
    return msg


def test_second_communicator_on_a_device_is_refused():
    cfg = EPConfig(**TINY, gpus_per_node=2)
    for msg in run_ranks(_second_on_device, 2, cfg):
        assert "already has an EPCommunicator on cpu" in msg and "sibling" in msg


def _one_rank_stays_away(rank: int, cfg: EPConfig, leave: bool) -> str:
    """Rank 1 never creates its communicator: it stays alive past rank 0's init_timeout_s, or
    (``leave``) exits at once."""
    if rank == 1:
        if not leave:
            time.sleep(cfg.init_timeout_s + 2)
        return "away"
    try:
        EPCommunicator(cfg)
    except (EPTimeoutError, EPWorkerError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_rank_that_never_comes_is_a_timeout():
    cfg = EPConfig(**TINY, gpus_per_node=2, init_timeout_s=2.0)
    msg = run_ranks(_one_rank_stays_away, 2, cfg, False)[0]
    assert msg.startswith("EPTimeoutError") and "did not complete within init_timeout_s = 2 s" in msg, msg


def test_a_rank_that_leaves_is_a_worker_error():
    cfg = EPConfig(**TINY, gpus_per_node=2, init_timeout_s=60.0)
    msg = run_ranks(_one_rank_stays_away, 2, cfg, True)[0]
    assert msg.startswith("EPWorkerError") and "crashed or left" in msg, msg


def test_summaries_name_shared_gpus_and_split_nodes():
    cfg = EPConfig(**TINY, gpus_per_node=2, n_nodes=2)
    base = {"config": cfg.model_dump(mode="json"), "backend": "nvshmem", "problem": None}
    hosts = ["a", "a", "b", "b"]
    ok = [dict(base, host=h, device=f"gpu-{r % 2}") for r, h in enumerate(hosts)]
    check_summaries(ok, cfg, 0)
    shared = [dict(s) for s in ok]
    shared[1]["device"] = "gpu-0"
    with pytest.raises(EPConfigError, match="ranks 0 and 1 both use GPU gpu-0 on host a"):
        check_summaries(shared, cfg, 0)
    split = [dict(s) for s in ok]
    split[3]["host"] = "c"
    with pytest.raises(EPConfigError, match="ranks 2 and 3 form node 1 of the config .* hosts b and c"):
        check_summaries(split, cfg, 0)


def test_communicator_needs_a_process_group():
    from ray_ep import EPStateError

    with pytest.raises(EPStateError, match="init_process_group"):
        EPCommunicator(EPConfig(**TINY))


def test_torch_only_wire_dtypes_need_the_torch_backend():
    with pytest.raises(ValueError, match="dispatch_dtype 'fp64' is moved by the torch backend only"):
        EPConfig(**TINY, dispatch_dtype="fp64")
    with pytest.raises(ValueError, match="combine_dtype 'fp64' is moved by the torch backend only"):
        EPConfig(**TINY, combine_dtype="fp64", backend="auto")
    assert EPConfig(**TINY, dispatch_dtype="fp64", combine_dtype="fp64", backend="torch").hidden_size == 128
