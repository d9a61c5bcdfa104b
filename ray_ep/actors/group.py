"""One Ray actor per rank: placement, rank assignment, group calls, health and teardown.

:class:`EPWorkerGroup` turns any plain Python class whose constructor takes one
:class:`WorkerContext` into R = n_nodes * gpus_per_node Ray actors, one per GPU (or one per
CPU slot on the torch backend), and calls methods on all of them at once.

Placement
    One placement group with one node-sized bundle per node
    (``{"CPU": gpus_per_node * num_cpus_per_worker, "GPU": gpus_per_node}``), STRICT_SPREAD
    over nodes (STRICT_PACK when n_nodes == 1). ``placement_strategy`` overrides it, e.g.
    ``"PACK"`` lets one 4-GPU host play a 2 nodes x 2 GPUs topology.

Ranks (node-major)
    node_rank is the bundle index; local_rank is the position of the worker inside its bundle,
    sorted by its GPU id (ray.get_accelerator_ids) so that local rank order follows the
    physical GPU order. rank = node_rank * gpus_per_node + local_rank. The node a bundle landed
    on is read back from the actors themselves (``get_node_id()``) and recorded as a Ray node
    id, never grouped by IP: several raylets may share one IP (ray.cluster_utils, containers).

Two-step construction, invisible to the worker class
    A rank is only known once Ray has placed the actor and granted its GPU, but the worker's
    constructor wants its rank. The group therefore makes remote a small subclass of the
    worker class whose ``__init__`` does nothing; the group then asks every actor where it
    runs (``_ep_probe``), assigns ranks, and runs the real ``worker_cls.__init__(self, ctx)``
    in the actor (``_ep_setup``). Compared with throw-away probe actors this reads the GPU id
    of the very actor that keeps it, and compared with a wrapper actor the handles in
    :attr:`EPWorkerGroup.actors` are true handles of the worker class (``h.method.remote()``
    works, and the dashboard shows the worker's class name).

Health pings while a method runs
    The actor has a second concurrency group (one thread) that only serves ``_ep_ping``, so
    :meth:`EPWorkerGroup.health` answers while a long method is running. The worker's own
    methods, its constructor included, still run one at a time on one thread (not the
    process's main thread). Set per-thread state (e.g. the CUDA device) in the constructor.

Failure model (docs/design.md, "Ray")
    A start-up failure tears everything down (actors killed, placement group removed) and
    raises. A dead rank, or a call that runs past its timeout (the ranks are then out of step),
    marks the group failed: every later call raises :class:`EPStateError`, because NVSHMEM
    state cannot be patched; rebuild with ``shutdown()`` then ``start()`` (``EPCluster.restart``
    does both). So does a worker that raises EPTimeoutError (a silent peer) or a
    DistBackendError (a broken collective); when some ranks time out while others are still
    running, the error names the running ones as the silent ranks.
    Any other exception raised by a worker
    method is re-raised on the driver as its own type (a ``ValueError`` in a worker is a
    ``ValueError`` here) and leaves the group usable.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.actor import ActorClass, ActorHandle
from ray.exceptions import GetTimeoutError, RayError, RayTaskError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group_table,
    remove_placement_group,
)
from ray.util.placement_group import placement_group as create_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_ep.config import EPConfig
from ray_ep.errors import EPClusterError, EPStateError, EPTimeoutError, EPWorkerError

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
HEALTH_TIMEOUT_S = 5.0
"""Default limit for one health ping round."""
ERROR_GRACE_S = 1.0
"""After the first rank fails, how long to wait for the others so one message names them all."""

_CONTROL_GROUP = "ep_control"  # concurrency group of the health ping
_RESERVED_METHODS = ("_ep_probe", "_ep_setup", "_ep_ping")


@dataclass(frozen=True)
class WorkerContext:
    """Where one rank sits in the group; handed to the worker's constructor.

    Picklable (plain fields only). ``master_addr`` / ``master_port`` stay None here: the
    worker fills its rendezvous later (``dataclasses.replace``).
    """

    rank: int
    """Global rank, node-major: node_rank * gpus_per_node + local_rank."""
    world_size: int
    """R = n_nodes * gpus_per_node."""
    local_rank: int
    """Position inside the node (sorted by GPU id when use_gpu)."""
    node_rank: int
    """Index of the node (placement-group bundle) the rank belongs to."""
    n_nodes: int
    """Nodes of the group."""
    gpus_per_node: int
    """Ranks per node."""
    node_id: str
    """Ray node id (hex) of the node the actor runs on."""
    node_ip: str
    """IP of that node; not unique (several raylets can share an IP)."""
    use_gpu: bool
    """Whether the actor holds one GPU (Ray sets CUDA_VISIBLE_DEVICES to it)."""
    gpu_ids: tuple[str, ...] = ()
    """Ray's accelerator ids of the actor's GPU (empty without GPU)."""
    master_addr: str | None = None
    """Rendezvous address, filled by the worker (None here)."""
    master_port: int | None = None
    """Rendezvous port, filled by the worker (None here)."""


@dataclass(frozen=True)
class _Placement:
    """What an actor reports about where Ray put it."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]
    pid: int


def _breaks_the_group(exc: object) -> bool:
    """Errors after which the ranks are out of step: a receive that timed out on a silent peer
    (EPTimeoutError), a collective that broke (EPWorkerError raised by a worker) or a
    collective of the process group that failed (DistBackendError)."""
    if isinstance(exc, (EPTimeoutError, EPWorkerError)):
        return True
    try:
        from torch.distributed import DistBackendError
    except ImportError:
        return False
    return isinstance(exc, DistBackendError)


class _State(enum.Enum):
    NEW = "not started"
    RUNNING = "running"
    FAILED = "failed"
    SHUTDOWN = "shut down"


@dataclass
class _Outcome:
    """Results of one round of calls, by position in the list of refs."""

    values: dict[int, Any] = field(default_factory=dict)
    task_errors: dict[int, RayTaskError] = field(default_factory=dict)
    """The method raised: the actor is fine."""
    deaths: dict[int, RayError] = field(default_factory=dict)
    """The actor died or could not be reached."""
    pending: list[int] = field(default_factory=list)
    """Still running at the deadline."""
    aborted: str | None = None
    """Why the wait stopped early: the group was marked failed from outside."""


# ---- pure helpers (no Ray calls; unit-tested) -----------------------------------------------
def _gpu_sort_key(gpu_ids: Sequence[str]) -> tuple[int, int, str]:
    """Sort key of a worker by its lowest GPU id: numeric ids numerically ("2" < "10")."""
    if not gpu_ids:
        return (0, 0, "")
    if all(str(g).isdigit() for g in gpu_ids):
        return (0, min(int(g) for g in gpu_ids), "")
    return (1, 0, min(str(g) for g in gpu_ids))


def _assign_ranks(
    placements: Sequence[_Placement],
    bundle_ids: Sequence[int],
    *,
    n_nodes: int,
    gpus_per_node: int,
    use_gpu: bool,
) -> list[tuple[int, WorkerContext]]:
    """Ranks for workers created in order ``i`` in bundle ``bundle_ids[i]``.

    Returns ``(i, context)`` pairs in rank order. Workers of a bundle are sorted by lowest GPU
    id (then creation order); every worker of a bundle must report the same node id.
    """
    world_size = n_nodes * gpus_per_node
    out: list[tuple[int, WorkerContext]] = []
    for node_rank in range(n_nodes):
        members = [i for i, b in enumerate(bundle_ids) if b == node_rank]
        if len(members) != gpus_per_node:
            raise EPClusterError(
                f"bundle {node_rank} holds {len(members)} workers, expected gpus_per_node = "
                f"{gpus_per_node}"
            )
        node_ids = {placements[i].node_id for i in members}
        if len(node_ids) != 1:
            raise EPClusterError(
                f"the workers of bundle {node_rank} report several nodes {sorted(node_ids)}; "
                f"a bundle lives on one node"
            )
        if use_gpu:
            members.sort(key=lambda i: (_gpu_sort_key(placements[i].gpu_ids), i))
        for local_rank, i in enumerate(members):
            p = placements[i]
            ctx = WorkerContext(
                rank=node_rank * gpus_per_node + local_rank,
                world_size=world_size,
                local_rank=local_rank,
                node_rank=node_rank,
                n_nodes=n_nodes,
                gpus_per_node=gpus_per_node,
                node_id=p.node_id,
                node_ip=p.node_ip,
                use_gpu=use_gpu,
                gpu_ids=tuple(p.gpu_ids),
            )
            out.append((i, ctx))
    return out


def _fmt_resources(res: dict[str, float], keys: Sequence[str] | None = None) -> str:
    keys = list(keys) if keys is not None else sorted(res)
    parts = []
    for k in keys:
        v = float(res.get(k, 0.0))
        parts.append(f"{k}={int(v) if v.is_integer() else round(v, 3)}")
    return ", ".join(parts)


def _fits(have: dict[str, float], need: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) >= v for k, v in need.items())


def _describe_shortfall(
    *,
    bundle: dict[str, float],
    n_bundles: int,
    strategy: str,
    nodes: Sequence[dict[str, Any]],
    available: dict[str, float],
    timeout_s: float,
) -> str:
    """Why a placement group of ``n_bundles`` x ``bundle`` could not be placed.

    ``nodes`` is ``ray.nodes()``, ``available`` is ``ray.available_resources()``.
    """
    keys = list(bundle)
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    big_enough = [n for n in alive if _fits(n.get("Resources", {}), bundle)]
    total_need = {k: v * n_bundles for k, v in bundle.items()}
    total_have = {k: sum(n.get("Resources", {}).get(k, 0.0) for n in alive) for k in keys}

    want = f"it needs {n_bundles} node(s) with {_fmt_resources(bundle)} each ({strategy})"
    node_list = "; ".join(
        f"{n.get('NodeID', '?')[:12]} ({n.get('NodeManagerAddress', '?')}): "
        f"{_fmt_resources(n.get('Resources', {}), keys)}"
        for n in alive
    )
    have = f"the cluster has {len(alive)} alive node(s)" + (f" [{node_list}]" if alive else "")

    if not big_enough:
        lack = f"no node has {_fmt_resources(bundle)}"
    elif strategy == "STRICT_SPREAD" and len(big_enough) < n_bundles:
        lack = (
            f"missing {n_bundles - len(big_enough)} node(s): only {len(big_enough)} distinct "
            f"node(s) have {_fmt_resources(bundle)}"
        )
    elif strategy == "STRICT_PACK" and not any(
        _fits(n.get("Resources", {}), total_need) for n in alive
    ):
        lack = f"no single node has {_fmt_resources(total_need)} for all {n_bundles} bundles"
    elif not _fits(total_have, total_need):
        lack = (
            f"the cluster holds {_fmt_resources(total_have)} in all, less than "
            f"{_fmt_resources(total_need)}"
        )
    else:
        lack = (
            f"the nodes are large enough but their resources are taken by other work "
            f"(free now: {_fmt_resources(available, keys)}); free them or raise init_timeout_s"
        )
    return (
        f"cannot place the worker group within init_timeout_s = {timeout_s:g} s: {want}; "
        f"{have}; {lack}. Lower n_nodes / gpus_per_node / num_cpus_per_worker or add nodes"
    )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _cause_text(err: BaseException, max_line: int = 300) -> str:
    """One-line summary of an error for messages; the full error is chained (``from``)."""
    cause = getattr(err, "cause", None)
    if isinstance(err, RayTaskError) and isinstance(cause, BaseException):
        err = cause
    lines = [ln.strip() for ln in _ANSI.sub("", str(err)).splitlines()]
    lines = [ln[:max_line] for ln in lines if ln and set(ln) != {"^"}]
    text = lines[0] if len(lines) <= 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(err).__name__}: {text}"


def _make_remote_class(worker_cls: type) -> ActorClass:
    """``worker_cls`` made remote with a deferred constructor and a ping (module docstring)."""

    class _Deferred(worker_cls):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            # The real constructor runs in _ep_setup once the rank is known.
            pass

        def _ep_probe(self) -> _Placement:
            runtime = ray.get_runtime_context()
            gpu_ids = runtime.get_accelerator_ids().get("GPU", [])
            return _Placement(
                node_id=runtime.get_node_id(),
                node_ip=ray.util.get_node_ip_address(),
                gpu_ids=tuple(str(g) for g in gpu_ids),
                pid=os.getpid(),
            )

        def _ep_setup(self, ctx: WorkerContext) -> None:
            worker_cls.__init__(self, ctx)

        @ray.method(concurrency_group=_CONTROL_GROUP)
        def _ep_ping(self) -> bool:
            return True

    _Deferred.__name__ = worker_cls.__name__
    _Deferred.__qualname__ = worker_cls.__qualname__
    _Deferred.__doc__ = worker_cls.__doc__
    return ray.remote(concurrency_groups={_CONTROL_GROUP: 1})(_Deferred)


# ---- the group ------------------------------------------------------------------------------
class EPWorkerGroup:
    """R actors of ``worker_cls``, one per rank, placed node-major on one placement group.

    >>> group = EPWorkerGroup(MyWorker, cfg, use_gpu=False)  # doctest: +SKIP
    >>> with group:                                          # doctest: +SKIP
    ...     group.execute("rank")                            # [0, 1, ..., R-1]

    Args:
        worker_cls: a plain class (not ``@ray.remote``) whose constructor takes one
            :class:`WorkerContext`. Its methods are called by name.
        config: topology (n_nodes, gpus_per_node) and limits (init_timeout_s, call_timeout_s).
        use_gpu: one GPU per actor; bundles then ask for gpus_per_node GPUs.
        runtime_env: Ray runtime environment of the actors (None: the job's).
        num_cpus_per_worker: CPUs reserved per actor.
        placement_strategy: one of PLACEMENT_STRATEGIES; None: STRICT_SPREAD over nodes, or
            STRICT_PACK when n_nodes == 1.
    """

    def __init__(
        self,
        worker_cls: type,
        config: EPConfig,
        *,
        use_gpu: bool,
        runtime_env: dict | None = None,
        num_cpus_per_worker: float = 1,
        placement_strategy: str | None = None,
    ) -> None:
        if isinstance(worker_cls, ActorClass):
            raise TypeError(
                "worker_cls is already a Ray actor class (@ray.remote); pass the plain class, "
                "the group makes it remote"
            )
        if not isinstance(worker_cls, type):
            raise TypeError(f"worker_cls must be a class, got {type(worker_cls).__name__}")
        clashes = [m for m in _RESERVED_METHODS if hasattr(worker_cls, m)]
        if clashes:
            raise TypeError(
                f"{worker_cls.__name__} defines {clashes}, names the group reserves; rename them"
            )
        if num_cpus_per_worker < 0:
            raise ValueError(f"num_cpus_per_worker = {num_cpus_per_worker} must be >= 0")
        if not use_gpu and num_cpus_per_worker == 0:
            raise ValueError(
                "num_cpus_per_worker = 0 with use_gpu=False leaves the placement bundles empty; "
                "reserve some CPU (e.g. num_cpus_per_worker=1) or set use_gpu=True"
            )
        if placement_strategy is not None and placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy = {placement_strategy!r} must be one of "
                f"{PLACEMENT_STRATEGIES} or None (STRICT_SPREAD, STRICT_PACK on one node)"
            )
        self._worker_cls = worker_cls
        self._config = config
        self._use_gpu = bool(use_gpu)
        self._runtime_env = runtime_env
        self._num_cpus_per_worker = float(num_cpus_per_worker)
        self._strategy = placement_strategy or (
            "STRICT_SPREAD" if config.n_nodes > 1 else "STRICT_PACK"
        )
        self._state = _State.NEW
        self._failure: str | None = None
        self._pg: PlacementGroup | None = None
        self._actors: list[ActorHandle] = []
        self._contexts: list[WorkerContext] = []

    # ---- properties ---------------------------------------------------------------------
    @property
    def config(self) -> EPConfig:
        return self._config

    @property
    def world_size(self) -> int:
        """R = n_nodes * gpus_per_node."""
        return self._config.world_size

    @property
    def bundle(self) -> dict[str, float]:
        """Resources of one node-sized placement bundle."""
        g = self._config.gpus_per_node
        out: dict[str, float] = {}
        if self._num_cpus_per_worker > 0:
            out["CPU"] = g * self._num_cpus_per_worker
        if self._use_gpu:
            out["GPU"] = float(g)
        return out

    @property
    def placement_strategy(self) -> str:
        return self._strategy

    @property
    def alive(self) -> bool:
        """Started, not shut down, and no failure seen. Makes no remote call: see health()."""
        return self._state is _State.RUNNING

    @property
    def failure(self) -> str | None:
        """Why the group failed (a dead rank, a timed-out call, a broken collective), else None."""
        return self._failure if self._state is _State.FAILED else None

    @property
    def contexts(self) -> list[WorkerContext]:
        """The WorkerContext of every rank, in rank order."""
        self._check_started()
        return list(self._contexts)

    @property
    def actors(self) -> list[ActorHandle]:
        """Actor handles of the worker class, in rank order."""
        self._check_started()
        return list(self._actors)

    @property
    def placement_group(self) -> PlacementGroup | None:
        return self._pg

    def __repr__(self) -> str:
        c = self._config
        return (
            f"EPWorkerGroup({self._worker_cls.__name__}, {c.n_nodes} node(s) x "
            f"{c.gpus_per_node}, use_gpu={self._use_gpu}, {self._state.value})"
        )

    # ---- start --------------------------------------------------------------------------
    def start(self) -> "EPWorkerGroup":
        """Reserve the placement group, start one actor per rank and construct the workers.

        Raises:
            EPClusterError: the cluster cannot host the topology within init_timeout_s.
            EPWorkerError: an actor died or a worker constructor raised (ranks named).
            EPTimeoutError: actors did not start or construct within init_timeout_s.
        Nothing is left running when it raises.
        """
        if self._state in (_State.RUNNING, _State.FAILED):
            raise EPStateError(
                f"the group is already started ({self._state.value}); call shutdown() first"
            )
        if not ray.is_initialized():
            raise EPStateError(
                "Ray is not initialized: call ray.init() (or ray.init(address='auto') to join "
                "a running cluster) before starting the group"
            )
        self._failure = None
        try:
            self._start()
        except BaseException:
            self._teardown()
            self._state = _State.SHUTDOWN
            raise
        self._state = _State.RUNNING
        return self

    def _start(self) -> None:
        cfg = self._config
        timeout_s = cfg.init_timeout_s
        deadline = time.monotonic() + timeout_s
        bundle = self.bundle
        logger.info(
            "starting %d x %s: %d bundle(s) of {%s}, %s",
            cfg.world_size, self._worker_cls.__name__, cfg.n_nodes,
            _fmt_resources(bundle), self._strategy,
        )
        self._pg = create_placement_group(
            [dict(bundle) for _ in range(cfg.n_nodes)], strategy=self._strategy
        )
        try:
            ray.get(self._pg.ready(), timeout=max(deadline - time.monotonic(), 0.0))
        except GetTimeoutError:
            msg = _describe_shortfall(
                bundle=bundle,
                n_bundles=cfg.n_nodes,
                strategy=self._strategy,
                nodes=ray.nodes(),
                available=ray.available_resources(),
                timeout_s=timeout_s,
            )
            raise EPClusterError(msg) from None

        remote_cls = _make_remote_class(self._worker_cls)
        options: dict[str, Any] = dict(
            num_cpus=self._num_cpus_per_worker,
            num_gpus=1 if self._use_gpu else 0,
            max_restarts=0,
            max_task_retries=0,
        )
        if self._runtime_env is not None:
            options["runtime_env"] = self._runtime_env
        handles: list[ActorHandle] = []
        bundle_ids: list[int] = []
        for node_rank in range(cfg.n_nodes):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=node_rank
            )
            for _ in range(cfg.gpus_per_node):
                handles.append(remote_cls.options(scheduling_strategy=strategy, **options).remote())
                bundle_ids.append(node_rank)
        # Kept here at once so that a failure below kills them.
        self._actors = handles

        # Step 1: where did each actor land, which GPU does it hold?
        labels = [
            f"worker {i % cfg.gpus_per_node} of node_rank {b}" for i, b in enumerate(bundle_ids)
        ]
        outcome = self._gather([h._ep_probe.remote() for h in handles], deadline=deadline)
        self._raise_startup(outcome, labels, "starting the actors")
        placements = [outcome.values[i] for i in range(len(handles))]
        self._check_bundle_nodes(placements, bundle_ids)

        ranked = _assign_ranks(
            placements, bundle_ids,
            n_nodes=cfg.n_nodes, gpus_per_node=cfg.gpus_per_node, use_gpu=self._use_gpu,
        )
        self._actors = [handles[i] for i, _ in ranked]
        self._contexts = [ctx for _, ctx in ranked]

        # Step 2: the worker's own constructor, now that each actor knows its rank.
        refs = [h._ep_setup.remote(ctx) for h, ctx in zip(self._actors, self._contexts)]
        outcome = self._gather(refs, deadline=deadline)
        self._raise_startup(
            outcome, [self._label(r) for r in range(len(refs))],
            f"{self._worker_cls.__name__}(ctx)",
        )
        logger.info(
            "started %d x %s:\n%s", cfg.world_size, self._worker_cls.__name__,
            "\n".join(
                f"  rank {c.rank}: node_rank {c.node_rank} local_rank {c.local_rank} "
                f"node {c.node_id[:12]} ({c.node_ip}) gpu {list(c.gpu_ids)} pid {p.pid}"
                for c, p in zip(self._contexts, (placements[i] for i, _ in ranked))
            ),
        )

    def _check_bundle_nodes(self, placements: list[_Placement], bundle_ids: list[int]) -> None:
        """Cross-check the node each actor reports with the placement group table."""
        try:
            table = placement_group_table(self._pg).get("bundles_to_node_id", {})
        except Exception as e:  # a debugging aid only; the actors' own report is authoritative
            logger.debug("placement_group_table unavailable: %s", e)
            return
        for p, b in zip(placements, bundle_ids):
            expected = table.get(b)
            if expected and expected != p.node_id:
                logger.warning(
                    "bundle %d is on node %s per the placement group table, but its actor "
                    "reports node %s; using the actor's report", b, expected, p.node_id,
                )

    def _raise_startup(self, outcome: _Outcome, labels: list[str], what: str) -> None:
        limit = self._config.init_timeout_s
        failed = {**outcome.task_errors, **outcome.deaths}
        if failed:
            first = failed[min(failed)]
            detail = "; ".join(f"{labels[i]}: {_cause_text(failed[i])}" for i in sorted(failed))
            raise EPWorkerError(
                f"{what} failed on {len(failed)} of {len(labels)} worker(s) - {detail}. "
                f"The group was shut down"
            ) from first
        if outcome.pending:
            names = ", ".join(labels[i] for i in outcome.pending)
            raise EPTimeoutError(
                f"{what} did not finish within init_timeout_s = {limit:g} s on {names}; "
                f"the group was shut down. Raise init_timeout_s if start-up is just slow "
                f"(runtime_env set-up, first CUDA/NVSHMEM init)"
            )

    # ---- calls --------------------------------------------------------------------------
    def execute_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method(*args, **kwargs)`` on every rank; ObjectRefs in rank order.

        Arguments are serialized once per rank: ``ray.put`` a large one first and pass its
        ObjectRef (Ray hands every actor the value).
        """
        return self.execute_per_rank_async(
            method, [args] * self.world_size, [kwargs] * self.world_size
        )

    def execute_per_rank_async(
        self,
        method: str,
        args_per_rank: Sequence[Sequence[Any]],
        kwargs_per_rank: Sequence[dict[str, Any]] | None = None,
    ) -> list[ray.ObjectRef]:
        """Call ``method(*args_per_rank[r], **kwargs_per_rank[r])`` on each rank r; refs."""
        self._check_usable()
        self._check_method(method)
        R = self.world_size
        if len(args_per_rank) != R:
            raise ValueError(
                f"args_per_rank has {len(args_per_rank)} entries; need one per rank ({R})"
            )
        if kwargs_per_rank is None:
            kwargs_per_rank = [{}] * R
        if len(kwargs_per_rank) != R:
            raise ValueError(
                f"kwargs_per_rank has {len(kwargs_per_rank)} entries; need one per rank ({R})"
            )
        return [
            getattr(h, method).remote(*a, **kw)
            for h, a, kw in zip(self._actors, args_per_rank, kwargs_per_rank)
        ]

    def execute(
        self, method: str, *args: Any, call_timeout_s: float | None = None, **kwargs: Any
    ) -> list:
        """Call ``method(*args, **kwargs)`` on every rank; results in rank order.

        ``call_timeout_s`` (keyword, not passed to the method) overrides config.call_timeout_s.
        Raises the worker's own exception type if a method raised, EPWorkerError if a rank
        died, EPTimeoutError naming the ranks still running at the limit.
        """
        return self.get(self.execute_async(method, *args, **kwargs),
                        call_timeout_s=call_timeout_s, what=repr(method))

    def execute_per_rank(
        self,
        method: str,
        args_per_rank: Sequence[Sequence[Any]],
        kwargs_per_rank: Sequence[dict[str, Any]] | None = None,
        *,
        call_timeout_s: float | None = None,
    ) -> list:
        """Call ``method(*args_per_rank[r], **kwargs_per_rank[r])`` on each rank r; results."""
        refs = self.execute_per_rank_async(method, args_per_rank, kwargs_per_rank)
        return self.get(refs, call_timeout_s=call_timeout_s, what=repr(method))

    def execute_single(
        self, rank: int, method: str, *args: Any, call_timeout_s: float | None = None, **kwargs: Any
    ) -> Any:
        """Call ``method`` on one rank only (e.g. rank 0 makes the NVSHMEM unique id)."""
        self._check_usable()
        self._check_method(method)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank = {rank} is outside 0..{self.world_size - 1}")
        ref = getattr(self._actors[rank], method).remote(*args, **kwargs)
        return self._get({rank: ref}, call_timeout_s, repr(method))[0]

    def get(
        self,
        refs: Sequence[ray.ObjectRef],
        *,
        call_timeout_s: float | None = None,
        what: str = "the call",
    ) -> list:
        """Wait for refs from :meth:`execute_async` (one per rank, rank order); results.

        Same error mapping as :meth:`execute`; ``what`` names the call in error messages.
        """
        self._check_usable()
        if len(refs) != self.world_size:
            raise ValueError(
                f"got {len(refs)} refs; need one per rank ({self.world_size}) in rank order"
            )
        return self._get(dict(enumerate(refs)), call_timeout_s, what)

    def _get(
        self, refs_by_rank: dict[int, ray.ObjectRef], call_timeout_s: float | None, what: str
    ) -> list:
        timeout_s = self._config.call_timeout_s if call_timeout_s is None else call_timeout_s
        if timeout_s <= 0:
            raise ValueError(f"call_timeout_s = {timeout_s} must be > 0")
        ranks = list(refs_by_rank)
        deadline = time.monotonic() + timeout_s
        outcome = self._gather([refs_by_rank[r] for r in ranks], deadline=deadline,
                               failed=lambda: self._failure if self._state is _State.FAILED else None)
        by_rank = lambda d: {ranks[i]: v for i, v in d.items()}  # noqa: E731
        deaths, task_errors = by_rank(outcome.deaths), by_rank(outcome.task_errors)
        pending = [ranks[i] for i in outcome.pending]

        if deaths:
            detail = "; ".join(
                f"{self._label(r)}: {_cause_text(deaths[r])}" for r in sorted(deaths)
            )
            self._fail(f"rank(s) {sorted(deaths)} died during {what}")
            # ranks still running may be the cause (NCCL's watchdog ends a rank that waited
            # on a silent one)
            running = f"; rank(s) {pending} were still running" if pending else ""
            raise EPWorkerError(
                f"{len(deaths)} rank(s) died during {what} - {detail}{running}. The group is "
                f"unusable and must be rebuilt (EPCluster.restart(), or shutdown() then start())"
            ) from deaths[min(deaths)]
        if task_errors:
            rank = min(task_errors)
            err = task_errors[rank]
            cause = getattr(err, "cause", None)
            exc: BaseException = err
            if isinstance(cause, BaseException) and not isinstance(err, type(cause)):
                exc = err.as_instanceof_cause()
            if _breaks_the_group(cause):
                # a peer stayed silent or a collective broke: the ranks are out of step (epochs,
                # process group), so no later call can succeed; say so instead of looking healthy
                if isinstance(cause, EPTimeoutError) and pending:
                    self._fail(f"rank(s) {pending} stayed silent during {what} (rank(s) "
                               f"{sorted(task_errors)} timed out waiting for them)")
                else:
                    self._fail(f"{type(cause).__name__} during {what} on rank {rank}")
                if isinstance(cause, EPTimeoutError) and pending:
                    # the ranks still running when their peers gave up are the silent ones (a
                    # stalled process, a rank slow in earlier work, a peer in another call)
                    raise EPTimeoutError(
                        f"{what}: rank(s) {pending} stayed silent: rank(s) {sorted(task_errors)} "
                        f"timed out waiting for them ({_cause_text(cause)}). The ranks are out of "
                        f"step, so the group is unusable and must be rebuilt (EPCluster.restart())"
                    ) from exc
            others = sorted(set(task_errors) - {rank})
            note = f"raised by {what} on {self._label(rank)}"
            if others:
                note += f"; rank(s) {others} raised too"
            if pending:  # left running: a later call queues behind them
                note += f"; rank(s) {pending} were still running"
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(note)
            logger.debug("%s: %s", note, _cause_text(exc))
            raise exc
        if pending and outcome.aborted:
            raise EPTimeoutError(f"{what} was abandoned on rank(s) {pending}: {outcome.aborted}. The group is "
                                 f"unusable and must be rebuilt (EPCluster.restart())")
        if pending:
            done = sorted(set(ranks) - set(pending))
            self._fail(f"{what} timed out on rank(s) {pending}")
            raise EPTimeoutError(
                f"{what} did not finish within call_timeout_s = {timeout_s:g} s on rank(s) "
                f"{pending} (finished: {done}). The ranks are out of step, so the group is "
                f"unusable and must be rebuilt (EPCluster.restart(), or shutdown() then start())"
            )
        return [outcome.values[i] for i in range(len(ranks))]

    @staticmethod
    def _gather(refs: list[ray.ObjectRef], *, deadline: float,
                failed: Callable[[], str | None] = lambda: None) -> _Outcome:
        """Wait for refs until all are done, the deadline passes, ERROR_GRACE_S after the
        first failure (so that ranks blocked on a failed peer do not hold the caller), or the
        group is marked failed from outside (``failed()`` gives the reason: a health check
        found a rank stalled while this call waited on it)."""
        index = {ref: i for i, ref in enumerate(refs)}
        out = _Outcome()
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            out.aborted = failed()
            if out.aborted:
                break
            # short waits: Python sees a Ctrl-C only between them (ray.wait blocks in C++)
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, 0.5))
            for ref in ready:
                i = index[ref]
                try:
                    out.values[i] = ray.get(ref)
                except RayTaskError as e:
                    out.task_errors[i] = e
                except RayError as e:  # actor died, unavailable, object lost, ...
                    out.deaths[i] = e
                else:
                    continue
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        out.pending = sorted(index[r] for r in pending)
        return out

    # ---- health and teardown ------------------------------------------------------------
    def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> list[bool]:
        """Ping every rank; True where the actor answered within ``timeout_s``.

        The ping runs in its own concurrency group, so a busy rank still answers: this
        checks liveness, not progress (call timeouts catch hung methods). A dead rank marks
        the group failed. (Whether the group can still serve is :attr:`alive`; the driver's
        ``EPCluster.health`` combines both.)
        """
        if self._state in (_State.NEW, _State.SHUTDOWN):
            raise EPStateError(f"the group is {self._state.value}; nothing to check")
        refs = [h._ep_ping.remote() for h in self._actors]
        index = {ref: r for r, ref in enumerate(refs)}
        ok = [False] * len(refs)
        dead: list[int] = []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            r = index[ref]
            try:
                ok[r] = bool(ray.get(ref))
            except RayError:
                dead.append(r)
        if dead:
            self._fail(f"rank(s) {sorted(dead)} found dead by health()")
        return ok

    def shutdown(self, wait_s: float = 0.0) -> None:
        """Kill every actor and remove the placement group. Idempotent. ``wait_s``: wait up to
        that long until Ray reports every actor dead (its process gone, so its GPU memory and
        ports are free again: a group rebuilt at once on the same GPUs needs them)."""
        if self._state in (_State.NEW, _State.SHUTDOWN):
            return  # start() cleans up after itself when it fails
        self._teardown(wait_s)
        self._state = _State.SHUTDOWN
        logger.info("shut down %s", self)

    def _teardown(self, wait_s: float = 0.0) -> None:
        actors, pg = self._actors, self._pg
        self._actors, self._contexts, self._pg = [], [], None
        if not ray.is_initialized():  # Ray is gone, and with it every actor and group
            return
        for h in actors:
            try:
                ray.kill(h, no_restart=True)
            except Exception as e:  # already dead
                logger.debug("ray.kill: %s", e)
        if wait_s > 0 and actors:
            # a ping to a killed actor fails once Ray knows its process is gone
            pings = [h._ep_ping.remote() for h in actors]
            _, alive = ray.wait(pings, num_returns=len(pings), timeout=wait_s)
            if alive:
                logger.warning("%d killed worker(s) not reported dead within %g s", len(alive), wait_s)
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception as e:
                logger.warning("could not remove placement group %s: %s", pg.id.hex(), e)

    def __enter__(self) -> "EPWorkerGroup":
        if self._state is not _State.RUNNING:
            self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    # ---- internals ----------------------------------------------------------------------
    def _label(self, rank: int) -> str:
        if rank < len(self._contexts):
            c = self._contexts[rank]
            return (
                f"rank {rank} (node_rank {c.node_rank}, local_rank {c.local_rank}, "
                f"node {c.node_id[:12]} {c.node_ip})"
            )
        return f"rank {rank}"

    def mark_failed(self, reason: str) -> None:
        """Mark a running group failed from outside (a health check that found a rank stalled):
        calls waiting on it stop within a poll (0.5 s) with EPTimeoutError, and it reports
        ``failure`` until it is rebuilt."""
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        if self._state is _State.RUNNING:
            self._state = _State.FAILED
            self._failure = reason
            logger.error("%s failed: %s", self, reason)

    def _check_started(self) -> None:
        if self._state in (_State.NEW, _State.SHUTDOWN):
            raise EPStateError(
                f"the group is {self._state.value}: call start() or use it as a context manager"
            )

    def _check_usable(self) -> None:
        if self._state is _State.FAILED:
            raise EPStateError(
                f"the group is unusable since {self._failure}: NVSHMEM state cannot be patched, "
                f"so the group must be rebuilt (EPCluster.restart(), or shutdown() then start())"
            )
        self._check_started()

    def _check_method(self, method: str) -> None:
        if not isinstance(method, str) or method.startswith("_ep_"):
            raise ValueError(f"method must be the name of a worker method, got {method!r}")
        if not callable(getattr(self._worker_cls, method, None)):
            public = sorted(
                m for m in dir(self._worker_cls)
                if not m.startswith("_") and callable(getattr(self._worker_cls, m, None))
            )
            raise AttributeError(
                f"{self._worker_cls.__name__} has no method {method!r}; it has {public}"
            )
