"""Several Ray nodes on one host: a multi-node topology you can run without a second machine.

``EPCluster`` starts one when the config has ``n_nodes > 1`` and no Ray address is given: one
raylet per node, each owning its own share of the host's GPUs (``CUDA_VISIBLE_DEVICES`` of
the raylet, which Ray maps its GPU ids through) or, without GPUs, its CPU slots. The worker
group then really spreads over n nodes (STRICT_SPREAD placement, per-node bookkeeping), and
the kernels treat ranks of other nodes as remote: NVSHMEM puts, never NVLink stores, even
though NVLink could reach them here.
"""

from __future__ import annotations

import logging
import math
import os

log = logging.getLogger(__name__)

# Ray 2.60 logs "Token authentication is enabled for this Ray cluster..." at WARNING from here
# whenever ray.init() starts a new local cluster while RAY_AUTH_MODE is unset (it then turns
# token auth on, as it does by default). Silenced only around a ray.init() that starts our own
# local Ray; auth stays on. Setting RAY_AUTH_MODE=token inside the process after `import ray`
# is not an option: the driver keeps its cached mode and its GCS refuses it.
_RAY_AUTH_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"


def plain_console() -> None:
    """No ANSI colours in Ray's "(Actor pid=N)" prefixes when the output is not a terminal
    (a log file, a pipe) or NO_COLOR is set; an explicit RAY_COLOR_PREFIX wins. Ray reads the
    variable in the driver for every forwarded line."""
    import sys

    tty = all(getattr(f, "isatty", lambda: False)() for f in (sys.stdout, sys.stderr))
    if not tty or os.environ.get("NO_COLOR"):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def start_local_ray(num_cpus: int, logging_level: int = logging.WARNING) -> None:
    """``ray.init`` of a fresh single-node Ray on this host, quiet: Ray's own INFO lines and
    its auth notice only at ``logging_level`` INFO (token auth itself stays on), and no colour
    codes in forwarded worker lines when the output is not a terminal (:func:`plain_console`)."""
    import ray

    plain_console()
    notice = logging.getLogger(_RAY_AUTH_NOTICE_LOGGER)
    previous = notice.level
    if logging_level >= logging.WARNING and "RAY_AUTH_MODE" not in os.environ:
        notice.setLevel(logging.ERROR)
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging_level)
    finally:
        notice.setLevel(previous)


def gpu_split(n_nodes: int, gpus_per_node: int, visible: str | None) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of each emulated node: consecutive slices of the visible GPUs.

    >>> gpu_split(2, 2, None)
    ['0,1', '2,3']
    >>> gpu_split(2, 1, "4,5,6")
    ['4', '5']
    """
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    need = n_nodes * gpus_per_node
    if ids is None:
        ids = [str(i) for i in range(need)]
    if len(ids) < need:
        raise ValueError(f"{n_nodes} nodes x {gpus_per_node} GPUs need {need} GPUs; CUDA_VISIBLE_DEVICES "
                         f"lists {len(ids)} ({visible!r})")
    return [",".join(ids[n * gpus_per_node:(n + 1) * gpus_per_node]) for n in range(n_nodes)]


class LocalCluster:
    """``n_nodes`` raylets on this host (``ray.cluster_utils.Cluster``), each with
    ``gpus_per_node`` GPUs (use_gpu) or enough CPU slots for its workers."""

    def __init__(self, n_nodes: int, gpus_per_node: int, *, use_gpu: bool, num_cpus_per_node: float | None = None,
                 object_store_bytes: int = 2 * 2**30):
        self.n_nodes, self.gpus_per_node, self.use_gpu = n_nodes, gpus_per_node, use_gpu
        # whole CPU slots, at least 2 per rank (its worker and Ray's helpers). On the 64-core
        # GPU host, 3.0 slots per node (what EPCluster asked for before) left every raylet
        # unregistered after 30 s while the default started in 6 s; cause not pinned down
        self.num_cpus_per_node = max(2 * gpus_per_node, math.ceil(num_cpus_per_node or 0))
        # EP moves tensors through NVSHMEM, not the object store: a small one per node, so
        # n raylets do not each claim 30% of the host's memory
        self.object_store_bytes = object_store_bytes
        self._cluster = None

    @property
    def address(self) -> str:
        if self._cluster is None:
            raise RuntimeError("the local cluster is not started")
        return self._cluster.address

    def start(self) -> "LocalCluster":
        splits = gpu_split(self.n_nodes, self.gpus_per_node, os.environ.get("CUDA_VISIBLE_DEVICES")) \
            if self.use_gpu else [None] * self.n_nodes
        # Ray gives a raylet 30 s to register; on a cold host (first start, bytecode not yet
        # compiled) several at once can miss that: one more try, with warm caches
        for attempt in (1, 2):
            try:
                self._cluster = self._start(splits)
                break
            except RuntimeError as e:
                if attempt == 2 or "timed out during startup" not in str(e):
                    raise
                log.warning("ray_ep: a raylet was slow to start (%s); trying once more", e)
        log.info("ray_ep: local cluster of %d nodes at %s (GPUs %s)", self.n_nodes, self._cluster.address, splits)
        return self

    def _start(self, splits: list[str | None]):
        from ray.cluster_utils import Cluster

        cluster = Cluster()
        try:
            for devices in splits:
                # one host: NVSHMEM needs no network transport between these nodes
                args = dict(num_cpus=self.num_cpus_per_node, include_dashboard=False,
                            object_store_memory=self.object_store_bytes,
                            env_vars={"NVSHMEM_REMOTE_TRANSPORT": "none"})
                if devices is not None:
                    args.update(num_gpus=self.gpus_per_node, env_vars={**args["env_vars"],
                                                                        "CUDA_VISIBLE_DEVICES": devices})
                else:
                    args["num_gpus"] = 0
                cluster.add_node(**args)
            cluster.wait_for_nodes()
        except Exception as e:
            cluster.shutdown()
            raise RuntimeError(f"could not start {self.n_nodes} Ray nodes on this host ({type(e).__name__}: {e}); "
                               f"the raylets' logs are under /tmp/ray/session_latest/logs") from e
        except BaseException:
            cluster.shutdown()
            raise
        return cluster

    def shutdown(self) -> None:
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None


def init_ray_bounded(address: str, timeout_s: float, **kwargs) -> None:
    """``ray.init(address=...)`` that fails within ``timeout_s`` (EPConfig.init_timeout_s).

    ray.init keeps retrying a GCS that does not answer for many minutes (822 s were seen for
    ``127.0.0.1:1``). A ``host:port`` is first probed with one TCP connect, so a refused or
    unreachable address fails at once; then ray.init runs in a helper thread and is given
    ``timeout_s``. Past it, EPTimeoutError (the helper thread may still be connecting; the
    caller is expected to give up, as the CLI does)."""
    import socket
    import threading

    import ray

    from .errors import EPClusterError, EPTimeoutError

    if address not in ("auto", "local") and "://" not in address:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise EPClusterError(f"Ray address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379), 'auto' or ray://...")
        try:
            socket.create_connection((host, int(port)), timeout=min(timeout_s, 10.0)).close()
        except OSError as e:
            raise EPClusterError(f"no Ray cluster answers at {address} ({type(e).__name__}: {e}); start one there "
                                 f"(`ray start --head --port {port}`) or fix the address") from None
    outcome: dict = {}

    def connect() -> None:
        try:
            ray.init(address=address, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = e

    # outside the main thread ray.init only skips its SIGTERM handler (sys.exit on SIGTERM; the
    # default action stops the process as well) and warns about it: that line is dropped
    ray_worker_log = logging.getLogger("ray._private.worker")
    quiet = _DropMessage("SIGTERM handler is not set")
    ray_worker_log.addFilter(quiet)
    thread = threading.Thread(target=connect, name="ray_ep-ray-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    ray_worker_log.removeFilter(quiet)
    if thread.is_alive():
        raise EPTimeoutError(f"ray.init(address={address!r}) did not connect within init_timeout_s = {timeout_s:g} s; "
                             f"check that a Ray head runs there and that this machine reaches it, or raise "
                             f"init_timeout_s")
    if "error" in outcome:
        raise outcome["error"]


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()
