"""EPWorkerGroup on CPU: a two-node ray.cluster_utils.Cluster with fake GPUs.

One Ray cluster for the whole module (2 nodes x {CPU: 4, GPU: 2}), torn down at the end so
no Ray is left running for other modules. Groups are small (2 or 4 light actors) because the
CI machine has 2 cores. Failures are injected by worker classes, timeouts shrunk via config.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from ray_ep.actors import EPWorkerGroup, WorkerContext
from ray_ep.actors.group import _assign_ranks, _describe_shortfall, _Placement
from ray_ep.config import EPConfig
from ray_ep.errors import EPClusterError, EPStateError, EPTimeoutError, EPWorkerError

NODE_CPUS = 4
NODE_GPUS = 2


def make_config(n_nodes: int, gpus_per_node: int, **overrides) -> EPConfig:
    R = n_nodes * gpus_per_node
    fields = dict(hidden_size=16, n_experts=2 * R, top_k=1, max_tokens_per_rank=4,
                  n_nodes=n_nodes, gpus_per_node=gpus_per_node, init_timeout_s=60.0)
    return EPConfig(**{**fields, **overrides})


# ---- worker classes (plain classes; the group makes them remote) -----------------------------
class EchoWorker:
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx

    def context(self) -> WorkerContext:
        return self.ctx

    def where(self) -> dict:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def rank(self) -> int:
        return self.ctx.rank

    def scale(self, x: int, *, factor: int = 1) -> tuple[int, int]:
        return self.ctx.rank, x * factor

    def fail_on(self, rank: int) -> bool:
        if self.ctx.rank == rank:
            raise ValueError(f"bad input on rank {rank}")
        return True

    def sleep_on(self, rank: int, seconds: float) -> int:
        if self.ctx.rank == rank:
            time.sleep(seconds)
        return self.ctx.rank


class FailingWorker(EchoWorker):
    def __init__(self, ctx: WorkerContext):
        if ctx.rank == 1:
            raise RuntimeError("cannot open the device on rank 1")
        super().__init__(ctx)


class HangingWorker(EchoWorker):
    def __init__(self, ctx: WorkerContext):
        if ctx.rank == 0:
            time.sleep(120)  # e.g. a rendezvous that never completes
        super().__init__(ctx)


# ---- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    # Workers cannot import this test module (tests/ is not on their sys.path): ship its
    # classes by value instead.
    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=NODE_CPUS, num_gpus=NODE_GPUS, include_dashboard=False))
    try:
        c.add_node(num_cpus=NODE_CPUS, num_gpus=NODE_GPUS)
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level="WARNING")
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(module)


@pytest.fixture(scope="module")
def gpu_group(cluster):
    """2 nodes x 2 fake GPUs, held for the whole module."""
    group = EPWorkerGroup(EchoWorker, make_config(2, 2), use_gpu=True, num_cpus_per_worker=0.5)
    group.start()
    yield group
    group.shutdown()


def cpu_group(worker_cls=EchoWorker, **overrides) -> EPWorkerGroup:
    """1 node x 2 CPU workers (light: half a CPU each)."""
    return EPWorkerGroup(worker_cls, make_config(1, 2, **overrides), use_gpu=False,
                         num_cpus_per_worker=0.5)


def live_placement_groups() -> set[str]:
    return {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}


def alive_actors(class_name: str) -> list[str]:
    actors = ray._private.state.actors().values()  # GCS actor table; no dashboard needed
    return [a["ActorID"] for a in actors
            if a["ActorClassName"] == class_name and a["State"] != "DEAD"]


def wait_until(predicate, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


# ---- pure helpers (no Ray) ----------------------------------------------------------------
def test_assign_ranks_node_major_sorted_by_gpu_id():
    # Creation order: bundle 0 got GPUs 10 then 2, bundle 1 got 1 then 0. Both bundles on
    # one physical node (PACK on one host) still give two node ranks.
    placements = [_Placement("nodeA", "10.0.0.1", (gpu,), pid)
                  for pid, gpu in enumerate(["10", "2", "1", "0"])]
    ranked = _assign_ranks(placements, [0, 0, 1, 1], n_nodes=2, gpus_per_node=2, use_gpu=True)
    assert [i for i, _ in ranked] == [1, 0, 3, 2]  # "2" < "10" numerically
    assert [(c.rank, c.node_rank, c.local_rank) for _, c in ranked] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert [c.gpu_ids for _, c in ranked] == [("2",), ("10",), ("0",), ("1",)]
    assert all(c.world_size == 4 and c.master_addr is None and c.master_port is None
               for _, c in ranked)

    # Without GPUs the creation order is kept.
    ranked = _assign_ranks(placements[:2], [0, 0], n_nodes=1, gpus_per_node=2, use_gpu=False)
    assert [i for i, _ in ranked] == [0, 1]

    split = [_Placement("nodeA", "ip", ("0",), 1), _Placement("nodeB", "ip", ("1",), 2)]
    with pytest.raises(EPClusterError, match="several nodes"):
        _assign_ranks(split, [0, 0], n_nodes=1, gpus_per_node=2, use_gpu=True)


def test_describe_shortfall_names_what_is_missing():
    one_node = [{"NodeID": "ab" * 28, "Alive": True, "NodeManagerAddress": "10.0.0.1",
                 "Resources": {"CPU": 8.0, "GPU": 4.0}},
                {"NodeID": "cd" * 28, "Alive": False, "NodeManagerAddress": "10.0.0.2",
                 "Resources": {"CPU": 8.0, "GPU": 4.0}}]
    msg = _describe_shortfall(bundle={"CPU": 4.0, "GPU": 4.0}, n_bundles=2,
                              strategy="STRICT_SPREAD", nodes=one_node,
                              available={"CPU": 8.0, "GPU": 4.0}, timeout_s=5)
    assert "needs 2 node(s) with CPU=4, GPU=4 each" in msg
    assert "1 alive node(s)" in msg and "missing 1 node(s)" in msg

    msg = _describe_shortfall(bundle={"CPU": 4.0, "GPU": 8.0}, n_bundles=1, strategy="STRICT_PACK",
                              nodes=one_node, available={}, timeout_s=5)
    assert "no node has CPU=4, GPU=8" in msg

    msg = _describe_shortfall(bundle={"CPU": 4.0, "GPU": 4.0}, n_bundles=1, strategy="STRICT_PACK",
                              nodes=one_node, available={"CPU": 8.0, "GPU": 0.0}, timeout_s=5)
    assert "taken by other work" in msg and "GPU=0" in msg


def test_bad_arguments_fail_before_ray():
    cfg = make_config(1, 2)
    with pytest.raises(TypeError, match="plain class"):
        EPWorkerGroup(ray.remote(EchoWorker), cfg, use_gpu=False)
    with pytest.raises(ValueError, match="placement_strategy"):
        EPWorkerGroup(EchoWorker, cfg, use_gpu=False, placement_strategy="ROUND_ROBIN")
    with pytest.raises(ValueError, match="num_cpus_per_worker"):
        EPWorkerGroup(EchoWorker, cfg, use_gpu=False, num_cpus_per_worker=0)
    group = EPWorkerGroup(EchoWorker, cfg, use_gpu=False)
    assert not group.alive
    with pytest.raises(EPStateError, match="not started"):
        group.execute("rank")
    with pytest.raises(EPStateError, match="not started"):
        group.contexts
    group.shutdown()  # nothing to do, no error


# ---- (a) placement and ranks on two fake nodes ---------------------------------------------
def test_ranks_are_node_major_and_match_the_actor_nodes(gpu_group):
    ctxs = gpu_group.contexts
    assert gpu_group.alive and gpu_group.placement_strategy == "STRICT_SPREAD"
    assert [c.rank for c in ctxs] == [0, 1, 2, 3]
    assert [(c.node_rank, c.local_rank) for c in ctxs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(c.world_size == 4 and c.n_nodes == 2 and c.gpus_per_node == 2 and c.use_gpu
               for c in ctxs)
    # Distinct node ids per node rank although both raylets share one IP.
    assert ctxs[0].node_id == ctxs[1].node_id != ctxs[2].node_id == ctxs[3].node_id
    assert {c.node_ip for c in ctxs} == {ctxs[0].node_ip}

    # Each actor really runs where its context says, holds one GPU, sorted by GPU id.
    where = gpu_group.execute("where")
    assert [w["node_id"] for w in where] == [c.node_id for c in ctxs]
    assert [w["gpu_ids"] for w in where] == [list(c.gpu_ids) for c in ctxs]
    for node in (ctxs[:2], ctxs[2:]):
        assert [int(c.gpu_ids[0]) for c in node] == [0, 1]
    assert [w["cuda_visible_devices"] for w in where] == [c.gpu_ids[0] for c in ctxs]
    # The constructor got the same context the group reports.
    assert gpu_group.execute("context") == ctxs


# ---- (d) calls ----------------------------------------------------------------------------
def test_execute_returns_rank_ordered_results(gpu_group):
    assert gpu_group.execute("rank") == [0, 1, 2, 3]
    assert gpu_group.execute("scale", 3, factor=2) == [(r, 6) for r in range(4)]
    out = gpu_group.execute_per_rank("scale", [(r * 10,) for r in range(4)])
    assert out == [(r, r * 10) for r in range(4)]
    out = gpu_group.execute_per_rank("scale", [(1,)] * 4, [{"factor": r} for r in range(4)])
    assert out == [(r, r) for r in range(4)]
    assert gpu_group.get(gpu_group.execute_async("rank")) == [0, 1, 2, 3]
    assert gpu_group.execute_single(2, "rank") == 2
    with pytest.raises(ValueError, match="one per rank"):
        gpu_group.execute_per_rank("scale", [(1,)] * 3)
    with pytest.raises(AttributeError, match="no method 'nope'"):
        gpu_group.execute("nope")


def test_worker_exception_keeps_its_type(gpu_group):
    with pytest.raises(ValueError, match="bad input on rank 2") as info:
        gpu_group.execute("fail_on", 2)
    if sys.version_info >= (3, 11):
        assert any("on rank 2" in note for note in info.value.__notes__)
    # A method raising leaves the group usable.
    assert gpu_group.alive and gpu_group.execute("rank") == [0, 1, 2, 3]


# ---- (b) a cluster too small ---------------------------------------------------------------
@pytest.mark.parametrize("n_nodes, gpus_per_node, missing", [
    (3, 2, "missing 1 node(s)"),
    (1, 4, "no node has"),
])
def test_cluster_too_small_raises_cluster_error(cluster, n_nodes, gpus_per_node, missing):
    before = live_placement_groups()
    group = EPWorkerGroup(EchoWorker, make_config(n_nodes, gpus_per_node, init_timeout_s=2.0),
                          use_gpu=True, num_cpus_per_worker=0.5)
    t0 = time.monotonic()
    with pytest.raises(EPClusterError) as info:
        group.start()
    assert time.monotonic() - t0 < 15
    msg = str(info.value)
    assert f"needs {n_nodes} node(s) with CPU={gpus_per_node // 2}, GPU={gpus_per_node} each" in msg
    assert "2 alive node(s)" in msg and missing in msg
    assert not group.alive
    assert wait_until(lambda: live_placement_groups() <= before)


# ---- (c) a constructor that raises ------------------------------------------------------------
def test_constructor_failure_shuts_everything_down(cluster):
    before = live_placement_groups()
    group = cpu_group(FailingWorker)
    with pytest.raises(EPWorkerError) as info:
        group.start()
    msg = str(info.value)
    assert "rank 1" in msg and "cannot open the device on rank 1" in msg and "RuntimeError" in msg
    assert "rank 0 " not in msg
    assert not group.alive
    assert wait_until(lambda: not alive_actors("FailingWorker"))
    assert wait_until(lambda: live_placement_groups() <= before)


def test_constructor_hang_times_out_naming_the_rank(cluster):
    before = live_placement_groups()
    group = cpu_group(HangingWorker, init_timeout_s=10.0)
    with pytest.raises(EPTimeoutError, match=r"HangingWorker\(ctx\) did not finish within "
                                             r"init_timeout_s = 10 s on rank 0 \(") as info:
        group.start()
    assert "rank 1" not in str(info.value)
    assert not group.alive
    assert wait_until(lambda: not alive_actors("HangingWorker"))
    assert wait_until(lambda: live_placement_groups() <= before)


# ---- (e) a dead rank -------------------------------------------------------------------------
def test_dead_rank_fails_the_group(cluster):
    with cpu_group() as group:
        assert group.health() == [True, True]
        ray.kill(group.actors[1])
        # ray.kill is asynchronous: wait until the GCS reports the actor dead
        actor_id = group.actors[1]._actor_id.hex()
        deadline = time.monotonic() + 30
        while ray._private.state.actors(actor_id=actor_id).get("State") != "DEAD":
            assert time.monotonic() < deadline, "actor still alive 30 s after ray.kill"
            time.sleep(0.1)
        with pytest.raises(EPWorkerError, match="rank 1") as info:
            group.execute("rank")
        assert "rebuilt" in str(info.value)
        assert not group.alive
        assert group.health() == [True, False]
        with pytest.raises(EPStateError, match="must be rebuilt"):
            group.execute("rank")
        with pytest.raises(EPStateError, match="must be rebuilt"):
            group.execute_per_rank("rank", [()] * 2)


# ---- (f) a hung rank -----------------------------------------------------------------------
def test_hung_method_times_out_naming_the_rank(cluster):
    with cpu_group(call_timeout_s=30.0) as group:
        assert group.execute("sleep_on", 1, 0.1) == [0, 1]
        t0 = time.monotonic()
        with pytest.raises(EPTimeoutError, match=r"rank\(s\) \[1\] \(finished: \[0\]\)"):
            group.execute("sleep_on", 1, 60.0, call_timeout_s=0.5)
        assert time.monotonic() - t0 < 5
        # The ping has its own thread: the busy rank still answers.
        assert group.health() == [True, True]
        with pytest.raises(EPStateError, match="timed out"):
            group.execute("rank")


# ---- (g) shutdown --------------------------------------------------------------------------
def test_shutdown_is_idempotent_and_leaves_nothing(cluster):
    before = live_placement_groups()
    group = cpu_group()
    with group:
        assert group.alive and group.execute("rank") == [0, 1]
        assert group.placement_group.id.hex() in live_placement_groups()
        actor_ids = {h._actor_id.hex() for h in group.actors}
    assert not group.alive
    group.shutdown()
    group.shutdown()
    with pytest.raises(EPStateError, match="shut down"):
        group.execute("rank")
    with pytest.raises(EPStateError, match="shut down"):
        group.health()
    assert wait_until(lambda: not actor_ids & set(alive_actors("EchoWorker")))
    assert wait_until(lambda: live_placement_groups() <= before)
    # A shut-down group can be started again (the rebuild path).
    with group:
        assert group.execute("rank") == [0, 1]
    assert not group.alive
