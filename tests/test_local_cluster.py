"""One host as several Ray nodes (ray_ep.local_cluster), and the topology arithmetic the
kernels use: ranks are node-major, a rank's node is rank // gpus_per_node."""

import pytest
import ray

from ray_ep import EPCluster
from ray_ep.config import EPConfig
from ray_ep.local_cluster import LocalCluster, gpu_split


@pytest.mark.parametrize("n,g,visible,want", [
    (2, 2, None, ["0,1", "2,3"]),
    (2, 1, "4,5,6", ["4", "5"]),
    (4, 2, "0,1,2,3,4,5,6,7", ["0,1", "2,3", "4,5", "6,7"]),
    (1, 3, " 2, 3 ,5 ", ["2,3,5"]),
])
def test_gpu_split(n, g, visible, want):
    assert gpu_split(n, g, visible) == want


def test_gpu_split_needs_enough_gpus():
    with pytest.raises(ValueError, match=r"2 nodes x 2 GPUs need 4 GPUs; CUDA_VISIBLE_DEVICES lists 3"):
        gpu_split(2, 2, "0,1,2")


@pytest.mark.parametrize("n_nodes,per_node", [(1, 4), (2, 2), (4, 1), (2, 4)])
def test_node_of_is_node_major(n_nodes, per_node):
    cfg = EPConfig.preset("tiny", n_nodes=n_nodes, gpus_per_node=per_node, n_experts=16)
    nodes = [cfg.node_of(r) for r in range(cfg.world_size)]
    assert nodes == [r // per_node for r in range(cfg.world_size)]
    assert nodes == sorted(nodes) and set(nodes) == set(range(n_nodes))
    with pytest.raises(ValueError, match="outside"):
        cfg.node_of(cfg.world_size)


def test_cpu_slots_are_whole_and_hold_the_workers():
    assert LocalCluster(2, 2, use_gpu=False).num_cpus_per_node == 4  # 2 slots per rank by default
    assert LocalCluster(2, 2, use_gpu=False, num_cpus_per_node=6.5).num_cpus_per_node == 7
    assert isinstance(LocalCluster(2, 1, use_gpu=False, num_cpus_per_node=3.0).num_cpus_per_node, int)


@pytest.fixture
def no_ray():
    """This test starts a Ray of its own (two raylets): none may be running."""
    if ray.is_initialized():
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()


def test_two_nodes_on_one_host(no_ray):
    """n_nodes = 2 and no address: EPCluster starts two raylets, places one node's ranks on
    each, and the MoE layer across them matches the reference; shutdown stops the raylets."""
    cfg = EPConfig.preset("tiny", n_nodes=2, gpus_per_node=2, backend="torch")
    with EPCluster(cfg, use_gpu=False) as ep:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        info = ep.info()
        by_rank = {i["rank"]: i for i in info}
        assert [by_rank[r]["node_rank"] for r in range(4)] == [cfg.node_of(r) for r in range(4)]
        assert [by_rank[r]["local_rank"] for r in range(4)] == [0, 1, 0, 1]
        node_ids = [by_rank[r]["node_id"] for r in range(4)]
        assert node_ids[0] == node_ids[1] != node_ids[2] == node_ids[3]
        report = ep.check(num_tokens=[5, 0, 9, 3], routing="skewed", rounds=2)
        assert report.passed, report.table()
    assert not ray.is_initialized()


@pytest.mark.parametrize("which", ["rank 0", "other ranks"])
@pytest.mark.parametrize("n_nodes", [1, 2])
def test_nvshmem_starts_with_the_environment_of_its_topology(monkeypatch, n_nodes, which):
    """nvshmem_env is in place before a process's first NVSHMEM call (make_unique_id on rank 0,
    runtime_init elsewhere), each variable only where unset: one
    node gets no network transport and no proxy thread (which spins a CPU core per worker);
    several nodes keep both; NVLink multicast is off either way. NVSHMEM itself is faked: what
    it would read is the environment at its init."""
    import os
    import sys
    import types

    import torch
    import triton

    from ray_ep.transport import nvshmem as backend

    seen = {}
    def options(**kw):  # what NVSHMEM reads at its first call in the process
        seen.update({k: v for k, v in os.environ.items() if k.startswith("NVSHMEM_")})
        return types.SimpleNamespace(_data=memoryview(b"uid"))

    core = types.SimpleNamespace(init=options, get_unique_id=options)
    cuda_core = types.SimpleNamespace(Device=lambda index: types.SimpleNamespace(set_current=lambda: None))
    for name, mod in {"nvshmem": types.SimpleNamespace(core=core), "nvshmem.core": core,
                      "cuda.core": cuda_core}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for k in backend.nvshmem_env(1):  # unset, and restored after the test (init sets them)
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    if n_nodes == 2:
        monkeypatch.setenv("NVSHMEM_REMOTE_TRANSPORT", "ucx")  # a user's own value stays
    monkeypatch.setattr(backend, "_runtime", {})
    hooks = []
    monkeypatch.setattr(backend, "_uid_from_bytes", lambda raw: raw)
    monkeypatch.setattr(triton.knobs.runtime.kernel_load_end_hook, "add", hooks.append)
    first_call = {"rank 0": lambda: backend.make_unique_id(n_nodes),  # rank 0's first call
                  "other ranks": lambda: backend.runtime_init(0, 1, torch.device("cuda", 0), b"uid", n_nodes=n_nodes)}
    first_call[which]()
    assert seen["NVSHMEM_DISABLE_NVLS"] == "1"
    if n_nodes == 1:
        assert seen["NVSHMEM_REMOTE_TRANSPORT"] == "none"
        assert seen["NVSHMEM_DISABLE_LOCAL_ONLY_PROXY"] == "1"
    else:
        assert seen["NVSHMEM_REMOTE_TRANSPORT"] == "ucx"
        assert "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY" not in seen
    assert hooks == ([backend._register_module] if which == "other ranks" else [])
