"""examples/ray_job.py as a real Ray job: submitted through the Jobs SDK to a local Ray with
its dashboard (the job server), it starts the EP group, checks it, benchmarks it and writes
its artifacts, without matplotlib unless --plot asks for the plot. Every failure has its own
exit status (0 ok, 1 check failed, 2 bad arguments or config, 3 missing optional package,
4 cluster or worker error, 5 unexpected error), which Ray's job status reports.

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


def test_job_help_lists_the_exit_statuses(job_main, capsys):
    with pytest.raises(SystemExit) as exc:
        job_main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for line in ("0  the check passed", "1  the check failed", "2  bad arguments or config",
                 "3  an optional package is missing", "4  cluster or worker error", "5  unexpected error"):
        assert line in out


def test_job_bad_arguments_exit_2(job_main, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:  # argparse: usage line, "error: ...", status 2
        job_main(["--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "the following arguments are required: --config" in capsys.readouterr().err
    assert job_main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read --config" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert job_main(["--config", str(REPO / "configs/job-1node.yaml"), "--out", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot create --out" in err and len(err.strip().splitlines()) == 1


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
    # every wrong field in one line, before anything starts
    bad.write_text("ep: {preset: tiny}\ncheck: {routing: zipf, tolerance: 0}\nbench: {presets: [huge]}\n")
    assert job_main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ray_job: bad config")
    assert "check.routing" in err and "check.tolerance" in err and "bench.presets" in err
    for text in ("ep: [1\n", "- 1\n", "ep: {preset: tinyy}\n"):  # not YAML, not a mapping, unknown preset
        bad.write_text(text)
        assert job_main(["--config", str(bad)]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_job_missing_matplotlib_exit_3_before_any_work(job_main, capsys, monkeypatch, tmp_path):
    """--plot without matplotlib: one line naming the extra, status 3, nothing started or
    written (the job used to die on it after the whole benchmark, with status 1)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "artifacts"
    config = str(REPO / "configs/job-1node.yaml")
    ray_was_up = ray.is_initialized()
    assert job_main(["--config", config, "--out", str(out), "--plot"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'ray-ep[plot]'" in err
    assert not out.exists() and ray.is_initialized() == ray_was_up
    assert job_main(["--config", config, "--plot", "--dry-run"]) == 3
    assert job_main(["--config", config, "--dry-run"]) == 0  # no --plot: no matplotlib needed


def test_job_unexpected_error_exit_5(job_main, capsys, monkeypatch):
    def boom(args):
        raise RuntimeError("a bug")

    monkeypatch.setitem(job_main.__globals__, "check_optional_dependencies", boom)
    assert job_main(["--config", str(REPO / "configs/job-1node.yaml")]) == 5
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == "ray_job: unexpected error (a bug): RuntimeError: a bug"


def test_a_failed_benchmark_check_exits_1(ray_session, job_main, capsys, monkeypatch, tmp_path):
    """The check passes, then a benchmark row's own round-trip check fails (a stand-in
    benchmark that reports one): both artifacts written, status 1, the last line naming the
    run and where it went wrong."""
    from ray_ep import bench

    row = bench.BenchRow(preset="tiny", backend="ray_ep", op="dispatch", dtype="fp8", routing="uniform", tokens=32,
                         world_size=2, sms="16", median_us=1.0, p10_us=1.0, p90_us=1.0, per_rank_median_us=[1.0, 1.0],
                         remote_gbps=1.0, received_gbps=1.0, check_error=0.37, topology="1x2",
                         check_detail="rank 1: 1 of 32 tokens wrong")
    monkeypatch.setattr(bench, "run_bench", lambda ep, **kw: bench.BenchResult(rows=[row]))
    out = tmp_path / "artifacts"
    assert job_main(["--config", str(REPO / "configs/job-1node.yaml"), "--out", str(out)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("ray_job: the benchmark's check failed on 1 run(s): tiny ray_ep 1x2 fp8 uniform")
    assert last.endswith("rank 1: 1 of 32 tokens wrong")
    assert json.loads((out / "ray_ep_check.json").read_text())["passed"]
    assert json.loads((out / "ray_ep_bench.json").read_text())["rows"][0]["check_error"] == 0.37


@pytest.fixture(scope="module")
def job_cluster():
    """A local Ray with the dashboard (the Jobs API); yields (dashboard URL or None, GCS
    address). None where the dashboard cannot start: the test then runs the entrypoint as a
    plain driver against the cluster (RAY_ADDRESS set, as `ray job submit` does).

    The dashboard agent binds a port the OS picks (0): its default, 52365, is taken when
    another Ray runs on the machine, and a port chosen here and freed before the agent binds it
    can be taken in between (CI saw that once); either way the agent stays up without its HTTP
    server and the job server answers "No available agent" to every submission."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=free_port(),
        dashboard_agent_listen_port=0))
    try:
        ctx = ray.init(address=cluster.address, logging_level="WARNING")
        url = f"http://{ctx.dashboard_url}" if ctx.dashboard_url else None
        yield url, cluster.address, Path(cluster.head_node.get_logs_dir_path())
    finally:
        ray.shutdown()
        cluster.shutdown()


def submit(client, entrypoint: str, logs_dir: Path, wait_s: float = 90) -> str:
    """Submit, giving a slow agent (a loaded 2-core machine) ``wait_s`` to register; the job id.
    An agent that never registers fails with its own log's last lines, which say why."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(REPO), "excludes": EXCLUDES})
        except RuntimeError as e:
            if "No available agent" not in str(e):
                raise
            if time.monotonic() > deadline:
                log = logs_dir / "dashboard_agent.log"
                tail = "\n".join(log.read_text().splitlines()[-30:]) if log.exists() else f"(no {log})"
                pytest.fail(f"no dashboard agent registered within {wait_s:.0f} s; {log}:\n{tail}")
            time.sleep(2)


def run_job(dashboard_url: str | None, gcs_address: str, logs_dir: Path, entrypoint: str, exit_status: int = 0) -> str:
    """Submit through the Jobs SDK (or, without a dashboard, run as a driver), expect the
    entrypoint's ``exit_status``; the logs."""
    if dashboard_url is None:
        env = {**os.environ, "RAY_ADDRESS": gcs_address,
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        out = subprocess.run(entrypoint, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
        assert out.returncode == exit_status, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout + out.stderr
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(dashboard_url)
    job_id = submit(client, entrypoint, logs_dir)
    deadline = time.monotonic() + 420
    while not (status := client.get_job_status(job_id)).is_terminal():
        assert time.monotonic() < deadline, f"job still {status} after 420 s:\n{client.get_job_logs(job_id)[-3000:]}"
        time.sleep(1)
    logs = client.get_job_logs(job_id)
    if exit_status == 0:
        assert status == JobStatus.SUCCEEDED, logs[-4000:]
    else:  # Ray reports the entrypoint's status in the job's message
        info = client.get_job_info(job_id)
        assert status == JobStatus.FAILED and f"failed with exit code {exit_status}," in info.message, \
            f"{status}: {info.message}"[:4000]
    return logs


def test_ray_job_submit_produces_artifacts(job_cluster, tmp_path):
    """The documented job on a cluster without matplotlib (a package that cannot be imported
    is put first on the job's PYTHONPATH): it needs only ray_ep's dependencies."""
    out = tmp_path / "artifacts"
    blocker = tmp_path / "no-matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    # sys.executable: the job's shell would otherwise find whatever `python` comes first on PATH
    logs = run_job(*job_cluster, f"sh -c 'PYTHONPATH={blocker.parent}:$PYTHONPATH exec {sys.executable} "
                                 f"examples/ray_job.py --config configs/job-1node.yaml --out {out}'")

    assert "PASS" in logs and "gloo-pipeline" in logs  # the check table, then the bench table
    check = json.loads((out / "ray_ep_check.json").read_text())
    assert check["passed"] and check["backend"] == "torch" and len(check["per_rank_rel_error"]) == 2
    assert check["max_rel_error"] <= check["tolerance"]
    bench = json.loads((out / "ray_ep_bench.json").read_text())
    assert bench["meta"]["world_size"] == 2
    assert {(r["op"], r["tokens"]) for r in bench["rows"]} >= {("dispatch", 8), ("combine", 32)}
    assert all(r["median_us"] > 0 for r in bench["rows"])
    assert not (out / "ray_ep_bench.png").exists()  # no --plot
    print(logs)


def test_ray_job_submit_reports_the_exit_status(job_cluster):
    """A failed job's status message carries the entrypoint's own status (here 2: a bad
    config), and its logs end with the one-line reason."""
    logs = run_job(*job_cluster, f"{sys.executable} examples/ray_job.py --config configs/job-1node.yaml --nodes 0",
                   exit_status=2)
    assert logs.strip().splitlines()[-1].startswith("ray_job: bad config configs/job-1node.yaml: ep: n_nodes")


def test_job_plot_and_check_failure_and_cluster_error(job_main, job_cluster, capsys, tmp_path):
    """In this process, on the job cluster's Ray: --plot writes the PNG; a check above the
    config's tolerance exits 1 without the benchmark; a cluster that cannot host the config
    exits 4."""
    pytest.importorskip("matplotlib")
    config = tmp_path / "job.yaml"
    config.write_text("ep: {preset: tiny, gpus_per_node: 2, max_tokens_per_rank: 8}\n"
                      "check: {num_tokens: 8, rounds: 1}\n"
                      "bench: {presets: [tiny], tokens: [8], iters: 2, warmup: 0}\n")
    out = tmp_path / "plot"
    assert job_main(["--config", str(config), "--out", str(out), "--plot"]) == 0
    png = (out / "ray_ep_bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    capsys.readouterr()

    config.write_text("ep: {preset: tiny, gpus_per_node: 2, max_tokens_per_rank: 8}\n"
                      "check: {num_tokens: 8, rounds: 1, tolerance: 1.0e-9}\n")
    out = tmp_path / "strict"
    assert job_main(["--config", str(config), "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.out and "benchmark:" not in captured.out
    assert captured.err.strip().splitlines()[-1].startswith("ray_job: check failed: max rel error")
    check = json.loads((out / "ray_ep_check.json").read_text())
    assert not check["passed"] and check["tolerance"] == 1e-9
    assert not (out / "ray_ep_bench.json").exists()

    config.write_text("ep: {preset: tiny, gpus_per_node: 2, backend: nvshmem}\n")  # no GPUs here
    assert job_main(["--config", str(config), "--out", str(tmp_path / "nv")]) == 4
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("ray_job: cluster error: EPStateError")
