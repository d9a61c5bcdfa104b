"""Shared fixtures and marker handling of the test suite.

``ray_session``
    One local Ray for every test that needs a plain local Ray (EPCluster connects to it and
    then leaves it running). Started on first use, shut down at the end of the session.
    Modules that need a Ray of their own (tests/test_group.py starts a two-node
    ``ray.cluster_utils.Cluster``) shut a running Ray down first and their own at their end;
    a module using ``ray_session`` after such a module gets a local Ray again, because a
    module-scoped autouse fixture re-initialises it (a session fixture runs only once).

Markers (declared in pyproject.toml)
    ``gpu``: skipped without CUDA. ``multi_gpu(n)``: skipped with fewer than n GPUs.

Failure reports as they happen
    With ``RAY_EP_TEST_REPORTS=<file>`` each failed test's report is appended to that file the
    moment it fails. pytest prints its reports at the end of the session, after the session's
    fixtures are torn down; on a GPU host under a time limit, a run cut short (or a Ray and
    NVSHMEM teardown that stalls after a failure) otherwise leaves only an ``F``.

Triton interpreter
    Without CUDA the kernels run in Triton's CPU interpreter, which ``@triton.jit`` picks when
    the kernel modules are imported. pytest imports every test module before running any, and
    ``import ray_ep`` (test_config, test_driver, ...) imports the kernels, so a kernel test
    module setting TRITON_INTERPRET itself is too late: it is set here, before collection
    (unless the caller set it). CPU workers inherit it and never launch a kernel.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Logical CPU slots, not cores: CPU workers reserve half a slot each, so a 2-core machine can
# host several small clusters at once (a 2-rank and a 4-rank one need 3 slots).
RAY_INIT_KWARGS = dict(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING")


class RaySession:
    """The local Ray of the test session: starts it when none is running."""

    def __init__(self) -> None:
        self.started = 0  # how many times this session had to start Ray

    def ensure(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(**RAY_INIT_KWARGS)
            self.started += 1

    def close(self) -> None:
        import ray

        # Only a Ray this session started: a Ray that was running before the session (or one
        # connected by the user around pytest) is left alone.
        if self.started and ray.is_initialized():
            ray.shutdown()


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray (8 logical CPUs, no dashboard) for the whole session; yields RaySession."""
    session = RaySession()
    session.ensure()
    try:
        yield session
    finally:
        session.close()


@pytest.fixture(scope="module", autouse=True)
def _ray_session_alive(request):
    """Re-start the local Ray for a module that uses ``ray_session`` if an earlier module
    (with a Ray cluster of its own) shut it down. Modules that do not use it are untouched."""
    module = request.module
    uses = any("ray_session" in getattr(item, "fixturenames", ())
               for item in request.session.items if getattr(item, "module", None) is module)
    if uses:
        request.getfixturevalue("ray_session").ensure()
    yield


def pytest_runtest_logreport(report):
    path = os.environ.get("RAY_EP_TEST_REPORTS")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if it.get_closest_marker("gpu") or it.get_closest_marker("multi_gpu")]
    if not gpu_items:
        return
    has_cuda = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if has_cuda else 0
    for item in gpu_items:
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        multi = item.get_closest_marker("multi_gpu")
        if multi is not None:
            need = int(multi.args[0]) if multi.args else int(multi.kwargs.get("n", 2))
            if n_gpus < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} GPUs, found {n_gpus}"))


@pytest.fixture(scope="module")
def ship_module_by_value(request):
    """Functions and classes of the test module handed to Ray workers (``EPCluster.run``,
    actors) travel by value: workers cannot import tests/, which is no package on their path.
    Use it with ``pytestmark = pytest.mark.usefixtures("ship_module_by_value")``."""
    import ray

    ray.cloudpickle.register_pickle_by_value(request.module)
    yield
    ray.cloudpickle.unregister_pickle_by_value(request.module)

