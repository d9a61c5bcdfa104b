"""examples/ray_job.py as a real Ray job: submitted through the Jobs SDK to a local Ray with
its dashboard (the job server), it starts the EP group, checks it, benchmarks it and writes
its artifacts.

The job needs a Ray of its own (the session's Ray runs without a dashboard): a running Ray is
shut down first and this module's is shut down at its end; conftest's module fixture brings
the session's Ray back for the modules after this one.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

REPO = Path(__file__).resolve().parents[1]
EXCLUDES = [".venv", ".git", "__pycache__", ".pytest_cache", "artifacts", "out", "build", "dist", "*.egg-info",
            ".whl"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def job_main():
    """examples/ray_job.py's main(argv), loaded in this process (examples/ is no package)."""
    return runpy.run_path(str(REPO / "examples" / "ray_job.py"), run_name="ray_job")["main"]


@pytest.mark.parametrize("config, ranks", [("configs/job-1node.yaml", "1 node(s) x 2 rank(s)"),
                                           ("configs/job-2nodes.yaml", "2 node(s) x 2 rank(s)")])
def test_job_configs_validate(job_main, capsys, config, ranks):
    assert job_main(["--config", str(REPO / config), "--dry-run"]) == 0
    assert ranks in capsys.readouterr().out


def test_job_config_errors_name_the_field(job_main, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ep: {preset: tiny, gpus_per_node: 3}\n")  # 16 experts over 3 ranks
    assert job_main(["--config", str(bad), "--dry-run"]) == 2
    assert "n_experts" in capsys.readouterr().err
    bad.write_text("ep: {preset: tiny}\nbench: {iterations: 5}\n")
    assert job_main(["--config", str(bad), "--dry-run"]) == 2
    assert "iterations" in capsys.readouterr().err
    assert job_main(["--config", str(REPO / "configs/job-2nodes.yaml"), "--gpus-per-node", "4", "--dry-run"]) == 0
    assert "2 node(s) x 4 rank(s)" in capsys.readouterr().out


@pytest.fixture(scope="module")
def job_cluster():
    """A local Ray with the dashboard (the Jobs API); yields (dashboard URL or None, GCS
    address). None where the dashboard cannot start: the test then runs the entrypoint as a
    plain driver against the cluster (RAY_ADDRESS set, as `ray job submit` does).

    Every port is a free one, the dashboard agent's too (its default, 52365, is taken when
    another Ray runs on the machine, and the job server then finds no agent)."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=free_port(),
        dashboard_agent_listen_port=free_port()))
    try:
        ctx = ray.init(address=cluster.address, logging_level="WARNING")
        url = f"http://{ctx.dashboard_url}" if ctx.dashboard_url else None
        yield url, cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_job(dashboard_url: str | None, gcs_address: str, entrypoint: str) -> str:
    """Submit through the Jobs SDK (or, without a dashboard, run as a driver); the logs."""
    if dashboard_url is None:
        env = {**os.environ, "RAY_ADDRESS": gcs_address,
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        out = subprocess.run(entrypoint, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(dashboard_url)
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(REPO), "excludes": EXCLUDES})
    deadline = time.monotonic() + 420
    while not (status := client.get_job_status(job_id)).is_terminal():
        assert time.monotonic() < deadline, f"job still {status} after 420 s:\n{client.get_job_logs(job_id)[-3000:]}"
        time.sleep(1)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    return logs


def test_ray_job_submit_produces_artifacts(job_cluster, tmp_path):
    out = tmp_path / "artifacts"
    # sys.executable: the job's shell would otherwise find whatever `python` comes first on PATH
    logs = run_job(*job_cluster, f"{sys.executable} examples/ray_job.py --config configs/job-1node.yaml --out {out}")

    assert "PASS" in logs and "nccl-pipeline" in logs  # the check table, then the bench table
    check = json.loads((out / "ray_ep_check.json").read_text())
    assert check["passed"] and check["backend"] == "torch" and len(check["per_rank_rel_error"]) == 2
    assert check["max_rel_error"] <= check["tolerance"]
    bench = json.loads((out / "ray_ep_bench.json").read_text())
    assert bench["meta"]["world_size"] == 2
    assert {(r["op"], r["tokens"]) for r in bench["rows"]} >= {("dispatch", 8), ("combine", 32)}
    assert all(r["median_us"] > 0 for r in bench["rows"])
    png = (out / "ray_ep_bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    print(logs)
