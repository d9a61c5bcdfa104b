"""Faults: a worker killed between calls and mid-call, a worker stalled (SIGSTOP) past
recv_timeout_s, a slow and a silent peer; then EPCluster.restart() and auto_restart rebuild
the group with the same experts; and a Ray address that does not answer fails within
init_timeout_s.

One 2-rank cluster (recv_timeout_s = 2 s) serves every test and each test leaves it rebuilt:
CPU workers (torch backend over gloo) everywhere, and on a host with 2 GPUs also the nvshmem
backend and the NCCL baseline (whose waits are bounded by NCCL's watchdog at init_timeout_s,
so its timing tests skip). No test asserts a speed; the waits are bounded by the timeouts
they test.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ray_ep import EPCluster, EPConfig, make_inputs
from ray_ep.errors import EPClusterError, EPStateError, EPTimeoutError, EPWorkerError
from ray_ep.local_cluster import init_ray_bounded
from ray_ep.weights import init_expert_weights

REPO = Path(__file__).resolve().parents[1]
RECV_TIMEOUT_S = 2.0
CFG = EPConfig.preset("tiny", gpus_per_node=2, recv_timeout_s=RECV_TIMEOUT_S, call_timeout_s=120.0)
# CPU workers (gloo) everywhere; on 2 GPUs the nvshmem backend and the NCCL baseline too, on 4
# GPUs the nvshmem backend over 4 ranks
KINDS = ["cpu", pytest.param("nvshmem", marks=pytest.mark.multi_gpu(2)),
         pytest.param("nccl", marks=pytest.mark.multi_gpu(2)),
         pytest.param("nvshmem-4", marks=pytest.mark.multi_gpu(4))]
TOKENS = [7, 4, 5, 3]  # per rank (the first R)


pytestmark = pytest.mark.usefixtures("ship_module_by_value")  # EPCluster.run gets this module's functions


@pytest.fixture(scope="module", params=KINDS)
def ep(request, ray_session):
    """tiny on 2 ranks; layer 0 seeded, layer 1 from given weights; the reference outputs."""
    kind = request.param
    if kind == "cpu":
        cluster = EPCluster(CFG, use_gpu=False).start()
    else:
        cfg = CFG.model_copy(update={"backend": "torch" if kind == "nccl" else "nvshmem",
                                     "gpus_per_node": 4 if kind == "nvshmem-4" else 2})
        cluster = EPCluster(cfg, use_gpu=True).start()
    cluster.kind = kind
    cfg = cluster.config
    cluster.load_experts(seed=5)
    cluster.load_experts(init_expert_weights(cfg, seed=6), layer=1)
    xs, ids, ws = make_inputs(cfg, TOKENS[:cfg.world_size], seed=8)
    want = [cluster.forward(xs, ids, ws, layer=layer) for layer in (0, 1)]
    cluster.inputs, cluster.want = (xs, ids, ws), want
    yield cluster
    cluster.shutdown(kill=True)


def bounded_by_recv_timeout(ep: EPCluster) -> None:
    """Only the nvshmem kernels and gloo bound a wait by recv_timeout_s; NCCL's watchdog keeps
    init_timeout_s (ray_ep/transport/torch_dist.py)."""
    if ep.kind == "nccl":
        pytest.skip("NCCL waits are bounded by its watchdog at init_timeout_s, not recv_timeout_s")


def pid_of(ep: EPCluster, rank: int) -> int:
    return ep.info()[rank]["pid"]


def assert_serves_as_before(ep: EPCluster) -> None:
    """Both layers give the outputs they gave before any fault (the experts were reloaded)."""
    assert ep.health() == [True] * ep.world_size and ep.failure is None
    xs, ids, ws = ep.inputs
    for layer in (0, 1):
        got = ep.forward(xs, ids, ws, layer=layer)
        assert all(torch.equal(a, b) for a, b in zip(got, ep.want[layer])), f"layer {layer} changed"


def test_kill_between_calls_then_restart(ep):
    xs, ids, ws = ep.inputs
    restarts = ep.restarts
    os.kill(pid_of(ep, 1), signal.SIGKILL)
    with pytest.raises(EPWorkerError, match=r"rank 1 .*died|died.*rank 1") as info:
        for _ in range(50):  # the kill lands within a call or two
            ep.forward(xs, ids, ws)
            time.sleep(0.1)
    assert "restart()" in str(info.value)
    assert ep.health() == [False] * ep.world_size and "died" in ep.failure
    with pytest.raises(EPStateError, match="unusable"):
        ep.forward(xs, ids, ws)
    ep.restart()
    assert ep.restarts == restarts + 1
    assert_serves_as_before(ep)


def _die_mid_layer(worker, xs, ids, ws):
    if worker.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # while rank 0 waits for it inside the layer
    return worker.moe(xs[worker.rank], ids[worker.rank], ws[worker.rank]).shape


def test_kill_mid_call_then_auto_restart(ep):
    xs, ids, ws = ep.inputs
    ep.auto_restart = True
    try:
        with pytest.raises(EPWorkerError, match="died during 'run'"):
            ep.run(_die_mid_layer, xs, ids, ws)
        restarts = ep.restarts
        got = ep.forward(xs, ids, ws)  # rebuilt first, then served
        assert ep.restarts == restarts + 1
        assert all(torch.equal(a, b) for a, b in zip(got, ep.want[0]))
    finally:
        ep.auto_restart = False
    assert_serves_as_before(ep)


def test_stall_past_the_timeout_names_the_stalled_rank(ep):
    """SIGSTOP rank 1 for longer than recv_timeout_s: rank 0's layer times out naming rank 1,
    the group reports failed (no healthy-but-broken state), and a restart serves again."""
    bounded_by_recv_timeout(ep)
    xs, ids, ws = ep.inputs
    pid = pid_of(ep, 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(EPTimeoutError, match=r"rank\(s\) \[1\] stayed silent") as info:
            ep.forward(xs, ids, ws)
        if ep.kind == "cpu":
            assert f"recv_timeout_s = {RECV_TIMEOUT_S:g} s" in str(info.value)
        assert ep.health() == [False] * ep.world_size
    finally:
        os.kill(pid, signal.SIGCONT)
    others = [r for r in range(ep.world_size) if r != 1]
    assert ep.failure == f"rank(s) [1] stayed silent during 'forward' (rank(s) {others} timed out waiting for them)"
    with pytest.raises(EPStateError, match=r"unusable since rank\(s\) \[1\] stayed silent"):
        ep.forward(xs, ids, ws)
    ep.restart()
    assert_serves_as_before(ep)


def _slow_rank_1(worker, xs, ids, ws, delay_s):
    if worker.rank == 1:
        time.sleep(delay_s)
    return worker.moe(xs[worker.rank], ids[worker.rank], ws[worker.rank]).shape


def test_slow_peer_past_recv_timeout_raises_naming_it(ep):
    """A peer 5 s late with a 2 s recv_timeout_s is not waited for: the error names it."""
    bounded_by_recv_timeout(ep)
    xs, ids, ws = ep.inputs
    others = re.escape(str([r for r in range(ep.world_size) if r != 1]))
    with pytest.raises(EPTimeoutError, match=rf"rank\(s\) \[1\] stayed silent: rank\(s\) {others} timed out"):
        ep.run(_slow_rank_1, xs, ids, ws, 2.5 * RECV_TIMEOUT_S)
    assert ep.health() == [False] * ep.world_size
    ep.restart()
    assert_serves_as_before(ep)


def test_slow_peer_within_recv_timeout_is_waited_for(ep):
    bounded_by_recv_timeout(ep)
    xs, ids, ws = ep.inputs
    want = [torch.Size([n, CFG.hidden_size]) for n in TOKENS[:ep.world_size]]
    assert ep.run(_slow_rank_1, xs, ids, ws, 0.25 * RECV_TIMEOUT_S) == want
    assert ep.health() == [True] * ep.world_size


def _rank_1_skips_the_layer(worker, xs, ids, ws):
    if worker.rank == 1:
        return None
    return worker.moe(xs[worker.rank], ids[worker.rank], ws[worker.rank]).shape


def test_silent_peer_on_the_torch_backend(ep):
    """Rank 1 never joins the layer (it returned): rank 0 raises EPTimeoutError after
    recv_timeout_s (not a raw gloo error after init_timeout_s) naming rank 1."""
    bounded_by_recv_timeout(ep)
    xs, ids, ws = ep.inputs
    with pytest.raises(EPTimeoutError) as info:
        ep.run(_rank_1_skips_the_layer, xs, ids, ws)
    msg = str(info.value)
    if ep.kind == "cpu":
        assert "rank 0: dispatch" in msg and "rank 1 did not take part" in msg and "recv_timeout_s = 2 s" in msg
    else:  # the receive kernel's status names the source that never signalled
        assert "dispatch: rank(s) [1] stayed silent: rank 0 timed out" in msg
    assert ep.health() == [False] * ep.world_size
    ep.restart()
    assert_serves_as_before(ep)


def _rank_1_hangs(worker, seconds):
    if worker.rank == 1:
        time.sleep(seconds)
    return worker.rank


def test_marking_the_group_failed_releases_a_waiting_call(ep):
    """A health check that finds a rank stalled marks the group failed from another thread: the
    call waiting on that rank ends at once with EPTimeoutError naming it, not after
    call_timeout_s (a serving step would otherwise hold the lock its rebuild needs)."""
    import threading

    if ep.kind != "cpu":
        pytest.skip("driver-side logic: the CPU case covers it")
    timer = threading.Timer(1.0, ep.mark_failed, args=("rank 1 did not answer a ping (test)",))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(EPTimeoutError, match=r"abandoned on rank\(s\) \[1\].*did not answer a ping"):
            ep.run(_rank_1_hangs, 60.0)
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 30.0  # released by the mark, long before rank 1 wakes (60 s)
    assert ep.health() == [False, False] and "did not answer a ping" in ep.failure
    ep.restart()
    assert_serves_as_before(ep)


def test_restart_needs_a_started_cluster(ray_session):
    with pytest.raises(EPStateError, match="not running"):
        EPCluster(CFG).restart()


# ---- a Ray address that does not answer --------------------------------------------------------
def test_ray_init_is_bounded():
    with pytest.raises(EPClusterError, match=r"no Ray cluster answers at 127.0.0.1:1 .*ray start --head"):
        init_ray_bounded("127.0.0.1:1", 5.0)
    with pytest.raises(EPClusterError, match="not HOST:PORT"):
        init_ray_bounded("nowhere", 5.0)
    with socket.socket() as srv:  # accepts connections, never speaks Ray's protocol
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        # in a process of its own: this one may hold the session's Ray
        code = (f"from ray_ep.local_cluster import init_ray_bounded\n"
                f"init_ray_bounded('127.0.0.1:{srv.getsockname()[1]}', 2.0)")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode != 0
    assert "EPTimeoutError: ray.init(address='127.0.0.1:" in r.stderr
    assert "did not connect within init_timeout_s = 2 s" in r.stderr


@pytest.mark.parametrize("command", [["check"], ["serve", "--port", "0"]])
def test_cli_with_an_unreachable_address_fails_at_once(command):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "ray_ep", *command, "--address", "127.0.0.1:1"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"ray-ep {command[0]}: ")
    assert "EPClusterError: no Ray cluster answers at 127.0.0.1:1" in r.stderr
