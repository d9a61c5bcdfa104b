"""The command line (plan, check, info, bench) and the benchmark code, on CPU workers."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from ray_ep import bench, cli
from ray_ep.bench import accuracy, runner
from ray_ep.config import EPConfig, plan_buffers

DOCS = Path(__file__).resolve().parents[1] / "docs"
INTERRUPTED = "ray-ep bench: interrupted; workers stopped"


def test_plan_prints_bytes_per_gpu(capsys):
    assert cli.main(["plan", "--preset", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    total = plan_buffers(EPConfig.preset("deepseek-v3")).total_bytes
    assert "total per GPU" in out and f"({total} bytes)" in out
    assert "dispatch.recv.x" in out and "combine.recv.x" in out


def test_plan_topology_and_yaml(tmp_path, capsys):
    assert cli.main(["plan", "--preset", "qwen3-moe", "--topology", "2x4", "--dispatch-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "2 node(s) x 4 GPU(s)" in out and "dispatch.recv.scales" in out
    path = tmp_path / "ep.yaml"
    path.write_text("ep:\n  preset: tiny\n  gpus_per_node: 4\n  max_tokens_per_rank: 64\n")
    assert cli.main(["plan", "--config", str(path)]) == 0
    assert "N_max=64" in capsys.readouterr().out


def test_plan_nvfp4_wire_rows(capsys):
    # one uint8 wire row per token (packed codes, then block scales): 4032 B at H 7168, no scales buffer
    assert cli.main(["plan", "--preset", "deepseek-v3", "--dispatch-dtype", "nvfp4"]) == 0
    out = capsys.readouterr().out
    assert "dispatch nvfp4" in out and "dispatch.recv.scales" not in out
    assert "[4, 4096, 4032]" in out and "u8" in out
    plan = plan_buffers(EPConfig.preset("deepseek-v3", dispatch_dtype="nvfp4"))
    fp8 = plan_buffers(EPConfig.preset("deepseek-v3", dispatch_dtype="fp8"))
    # 4032 B against fp8's 7168 + 224: 0.545x the receive bytes
    assert plan["dispatch.recv.x"].nbytes / (fp8["dispatch.recv.x"].nbytes + fp8["dispatch.recv.scales"].nbytes) < 0.55


def test_bench_nvfp4_rows(ray_session, tmp_path, capsys):
    js = tmp_path / "b.json"
    rc = cli.main(["bench", "--backend", "torch", "--preset", "tiny", "--world", "2", "--iters", "2", "--warmup", "1",
                   "--dispatch-dtype", "nvfp4,fp8", "--json", str(js), "--quiet"])
    assert rc == 0
    rows = json.loads(js.read_text())["rows"]
    assert [(r["dtype"], r["op"]) for r in rows] == [("nvfp4", "dispatch"), ("nvfp4", "combine"),
                                                     ("fp8", "dispatch"), ("fp8", "combine")]
    for r in rows:  # the round trip against the twin's quantised tokens: bf16 roundings only
        assert r["check_error"] < 2e-2 and r["misplaced_rows"] == 0
    assert " nvfp4 " in capsys.readouterr().out
    assert cli.main(["bench", "--backend", "torch", "--preset", "tiny", "--dispatch-dtype", "fp4", "--quiet"]) == 2
    assert "--dispatch-dtype: unknown fp4" in capsys.readouterr().err


def test_bench_layer_rows_by_expert_dtype(ray_session, tmp_path, capsys):
    # --layer with bf16 and fp8 experts: per expert dtype a layer row and the experts' two GEMMs
    # (ours, and torch._grouped_mm where torch has one: CPU torch has a bf16 one, no fp8 one)
    js = tmp_path / "layer.json"
    rc = cli.main(["bench", "--backend", "torch", "--preset", "tiny", "--world", "2", "--iters", "2", "--warmup", "1",
                   "--dispatch-dtype", "fp8", "--layer", "--expert-dtype", "bf16,fp8", "--json", str(js), "--quiet"])
    assert rc == 0
    rows = json.loads(js.read_text())["rows"]
    have_bf16 = hasattr(__import__("torch"), "_grouped_mm")
    want = [("dispatch", "-"), ("combine", "-"), ("layer", "bf16"), ("layer-mb2", "bf16"), ("experts", "bf16"),
            ("gemm", "bf16")]
    want += [("gemm-torch", "bf16")] if have_bf16 else []
    want += [("layer", "fp8"), ("layer-mb2", "fp8"), ("experts", "fp8"), ("gemm", "fp8")]
    assert [(r["op"], r["experts"]) for r in rows] == want
    for r in rows:
        assert r["median_us"] > 0 and r["dtype"] == "fp8"
        gemm = r["op"].startswith("gemm")
        assert (r["weight_gbps"] is not None and r["weight_gbps"] > 0) == gemm
        # TFLOP/s: the GEMMs' work for GEMM rows, the experts' whole work for layer / experts rows
        assert (r["tflops"] is not None and r["tflops"] > 0) == (r["op"] not in ("dispatch", "combine"))
    # the pipelined layer against the serial one, within its expert dtype's tolerance
    checked = {r["experts"]: (r["check_error"], r["check_tol"]) for r in rows if r["op"] == "layer-mb2"}
    assert {e: tol for e, (_, tol) in checked.items()} == {"bf16": 2e-2, "fp8": 5e-2}
    assert all(err <= tol for err, tol in checked.values())
    out = capsys.readouterr().out
    assert "gemm-torch" in out or not have_bf16
    assert cli.main(["bench", "--backend", "torch", "--preset", "tiny", "--expert-dtype", "fp4", "--quiet"]) == 2
    assert "--expert-dtype: unknown fp4" in capsys.readouterr().err


def test_accuracy_against_bf16_dispatch(ray_session, tmp_path, capsys):
    # python -m ray_ep.bench.accuracy on 2 CPU workers: the layer's error grows fp8 < nvfp4
    js = tmp_path / "acc.json"
    assert accuracy.main(["--preset", "tiny", "--world", "2", "--tokens", "64", "--json", str(js)]) == 0
    rows = {r["dtype"]: r for r in json.loads(js.read_text())}
    assert set(rows) == {"fp8", "nvfp4"} and rows["nvfp4"]["tokens"] == 128
    # measured at 256 tokens per rank: fp8 0.038, nvfp4 0.137 (docs/benchmarking.md)
    assert 0.01 < rows["fp8"]["rel"] < 0.06 < rows["nvfp4"]["rel"] < 0.2
    assert rows["nvfp4"]["token_rel_mean"] <= rows["nvfp4"]["token_rel_max"] < 0.5
    assert "nvfp4" in capsys.readouterr().out


def test_accuracy_of_fp8_experts(ray_session, tmp_path, capsys):
    # fp8 experts (the bf16 ones quantised per 128 x 128 block) against bf16 experts; the GEMM
    # quantises bf16 rows exactly as fp8 dispatch does, so both dispatch dtypes give one output
    js = tmp_path / "acc.json"
    assert accuracy.main(["--preset", "tiny", "--world", "2", "--tokens", "32", "--intermediate-size", "128",
                          "--dispatch-dtype", "fp8", "--expert-dtype", "bf16,fp8", "--json", str(js)]) == 0
    rows = {(r["dtype"], r["experts"]): r for r in json.loads(js.read_text())}
    assert set(rows) == {("fp8", "bf16"), ("bf16", "fp8"), ("fp8", "fp8")}
    assert rows[("bf16", "fp8")]["rel"] == rows[("fp8", "fp8")]["rel"]
    # measured at 256 tokens per rank: 0.064 (docs/benchmarking.md)
    assert 0.02 < rows[("bf16", "fp8")]["rel"] < 0.12
    with pytest.raises(SystemExit):  # the tiny preset's F = 64 cannot hold 128 x 128 blocks
        accuracy.main(["--preset", "tiny", "--expert-dtype", "fp8"])
    assert "intermediate_size % 128 == 0" in capsys.readouterr().err


def test_accuracy_refuses_experts_that_do_not_fit(ray_session, capsys):
    # F = 2^23 on the tiny preset: ~100 GB of experts; refused in one line before any worker
    # builds them (a real case: deepseek-v3 on a 24 GB host, where Ray then killed a worker)
    assert accuracy.main(["--preset", "tiny", "--world", "2", "--tokens", "4", "--dispatch-dtype", "fp8",
                          "--intermediate-size", str(2**23)]) == 1
    err = capsys.readouterr().err
    assert "EPClusterError: not enough memory for the accuracy run of tiny" in err and "Traceback" not in err
    # a config that cannot be built at all: one line, exit 2, no worker started
    with pytest.raises(SystemExit) as e:
        accuracy.main(["--preset", "tiny", "--world", "2", "--tokens", "4", "--intermediate-size", str(2**26)])
    assert e.value.code == 2 and "too large for 32-bit offsets" in capsys.readouterr().err


def test_plan_rejects_a_bad_topology(capsys):
    assert cli.main(["plan", "--preset", "mixtral", "--gpus", "3"]) == 2  # one line, not a traceback
    assert "n_experts" in capsys.readouterr().err


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "ray_ep" in out and "presets:" in out


def test_check_tiny_world_4(ray_session, capsys):
    # the acceptance command: `ray-ep check --preset tiny --world 4`
    assert cli.main(["check", "--preset", "tiny", "--world", "4", "--rounds", "1", "--routing", "skewed"]) == 0
    out = capsys.readouterr().out
    assert "max rel error" in out and "PASS" in out


def test_bench_cli_torch_tiny_world_2(ray_session, tmp_path, capsys):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = cli.main(["bench", "--backend", "torch", "--preset", "tiny", "--world", "2", "--iters", "3", "--warmup", "1",
                   "--tokens", "8,32", "--routing", "uniform,skewed", "--json", str(js), "--plot", str(png), "--quiet",
                   "--num-sms", "4,all"])
    assert rc == 0
    captured = capsys.readouterr()
    out = captured.out
    # on CPU workers the torch backend's pipeline runs over gloo, and says so
    assert "gloo-pipeline" in out and "nccl-pipeline" not in out and "dispatch" in out and "combine" in out
    assert "starting" not in captured.err and "cases" not in captured.err  # --quiet: no progress
    data = json.loads(js.read_text())
    # 2 dtypes x 2 routings x 2 token counts x (dispatch, combine); the pipeline has no SM
    # budget, so a sweep of budgets runs it once
    assert len(data["rows"]) == 16
    assert {r["backend"] for r in data["rows"]} == {"gloo-pipeline"}
    assert data["meta"]["world_size"] == 2 and "torch" in data["meta"]["versions"]
    for row in data["rows"]:
        assert row["median_us"] > 0 and len(row["per_rank_median_us"]) == 2
        assert row["check_error"] < 2e-2 and row["misplaced_rows"] == 0
        assert row["p10_us"] <= row["p90_us"]
    assert png.stat().st_size > 1000


def test_layer_rows_with_experts_alone(ray_session, tmp_path, capsys):
    js = tmp_path / "layer.json"
    rc = cli.main(["bench", "--backend", "torch", "--preset", "tiny", "--world", "2", "--iters", "2", "--warmup", "1",
                   "--layer", "--dispatch-dtype", "bf16", "--json", str(js), "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    rows = {r["op"]: r for r in json.loads(js.read_text())["rows"]}
    assert {"dispatch", "combine", "layer", "experts", "layer-mb2"} <= set(rows)
    assert rows["layer-mb2"]["tflops"] > 0  # the pipelined layer (2 micro-batches, the default)
    # the same work in both rows; the layer adds the communication
    assert rows["experts"]["tflops"] > 0 and rows["layer"]["tflops"] > 0
    assert rows["experts"]["tflops"] * rows["experts"]["median_us"] == pytest.approx(
        rows["layer"]["tflops"] * rows["layer"]["median_us"])
    assert "TFLOP/s" in out.splitlines()[0] and " experts " in out
    # the host's time to return from each eager layer call: on CPU workers the host does the
    # work itself, so it is most of the row's time; other rows time no host
    for op in ("layer", "experts", "layer-mb2"):
        assert 0 < rows[op]["host_us"] <= rows[op]["median_us"] * 1.05, rows[op]
    assert rows["dispatch"]["host_us"] is None and "host us" in out.splitlines()[0]
    # the pipelined layer is checked against the serial layer on the same input; the serial
    # layer and the experts alone are not checked here (the serial layer: in the GPU suite)
    assert 0 <= rows["layer-mb2"]["check_error"] <= 2e-2 and rows["layer-mb2"]["check_detail"] == ""
    assert rows["layer"]["check_error"] is None and rows["experts"]["check_error"] is None


def test_expert_flops_counts_routed_rows_and_shared_experts():
    from ray_ep.bench.loops import expert_flops

    cfg = EPConfig.preset("tiny", gpus_per_node=2, n_shared_experts=1)
    H, F = cfg.hidden_size, cfg.intermediate_size
    assert expert_flops(cfg, 10, 4) == 2 * H * 3 * F * (10 + 4)
    assert expert_flops(cfg.model_copy(update={"n_shared_experts": 0}), 10, 4) == 2 * H * 3 * F * 10


def test_cuda_graph_flag_needs_gpus(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    assert cli.main(["bench", "--cuda-graph", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert "--cuda-graph" in err and "needs GPUs" in err and "Traceback" not in err


def test_nvshmem_backend_without_gpus_is_one_line(capsys, monkeypatch):
    # refused before any worker starts; the API says the same as an input error
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    assert cli.main(["bench", "--backend", "nvshmem", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert "--backend nvshmem needs GPU workers" in err and "--backend torch" in err and "Traceback" not in err


def test_pull_combine_across_nodes_is_one_line(capsys):
    # refused by the config before any worker starts
    assert cli.main(["bench", "--topology", "2x2", "--backend", "torch", "--combine-mode", "pull", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "combine_mode 'pull'" in err and "n_nodes = 2" in err and "Traceback" not in err


def test_sm_budget_sweep_flag():
    assert runner.sm_budgets("24") == [24]
    assert runner.sm_budgets("16, 24,all") == [16, 24, None]


@pytest.mark.parametrize("value", ["0", "-4", "24,x", "2.5"])
def test_bad_sm_budget_is_one_line(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--num-sms", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "SM budgets are positive integers or 'all'" in err and "Traceback" not in err


def test_aggregate_takes_the_slowest_rank():
    cfg = EPConfig.preset("tiny", gpus_per_node=2)
    per_rank = [
        {"times_us": {"dispatch": [10.0, 11.0, 12.0]}, "remote_rows": 100, "received_rows": 150,
         "check_error": 1e-3, "misplaced_rows": 0},
        {"times_us": {"dispatch": [20.0, 21.0, 22.0]}, "remote_rows": 300, "received_rows": 350,
         "check_error": 2e-3, "misplaced_rows": 0},
    ]
    row = runner.aggregate(per_rank, "dispatch", cfg, 256, preset="tiny", backend="x", dtype="bf16",
                          routing="uniform", tokens=8, sms="-")
    assert row.median_us == 21.0 and row.per_rank_median_us == [11.0, 21.0]
    assert row.p10_us == 10.0 and row.p90_us == 22.0
    # mean remote rows (200) x 256 bytes over 21 us
    assert row.remote_gbps == pytest.approx(200 * 256 / 21.0 / 1e3)
    assert row.check_error == 2e-3


def test_unknown_bench_preset_is_refused():
    with pytest.raises(ValueError, match="unknown benchmark preset"):
        bench.run_bench(None, presets=["nope"])  # checked before the cluster is touched


def test_backend_labels_say_what_ran():
    assert runner.backend_label("torch", gpu_workers=False) == "gloo-pipeline"
    assert runner.backend_label("torch", gpu_workers=True) == "nccl-pipeline"
    assert runner.backend_label("nvshmem", gpu_workers=True) == "ray_ep"


def _row(**kw) -> bench.BenchRow:
    base = dict(preset="tiny", backend="gloo-pipeline", op="dispatch", dtype="bf16", routing="uniform", tokens=8,
                world_size=2, sms="-", median_us=100.0, p10_us=90.0, p90_us=120.0, per_rank_median_us=[90.0, 100.0],
                remote_gbps=0.5, received_gbps=0.8, check_error=1e-3, topology="1x2")
    return bench.BenchRow(**{**base, **kw})


def test_json_round_trip_and_plots(tmp_path):
    res = bench.BenchResult(rows=[_row(), _row(op="combine", median_us=80.0), _row(tokens=32, median_us=300.0)],
                            meta={"device": "cpu", "world_size": 2, "commit": "abc"})
    res.to_json(str(tmp_path / "r.json"))
    back = bench.BenchResult.from_json(str(tmp_path / "r.json"))
    assert back.rows == res.rows and back.meta == res.meta
    back.plot(str(tmp_path / "sweep.png"))  # two token counts: lines
    # a published GPU run: one token count per preset (bars), all_to_all and peer-copy references
    gpu = bench.BenchResult.from_json(str(DOCS / "bench-4xh200-v4.json"))
    assert len(gpu.rows) == 19 and gpu.meta["device"] == "NVIDIA H200"
    assert {r.op for r in gpu.rows} == {"dispatch", "combine", "all_to_all", "peer_copy"}
    gpu.plot(str(tmp_path / "gpu.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 1000 and (tmp_path / "gpu.png").stat().st_size > 1000


def test_table_says_the_sms_each_launch_used(tmp_path):
    # a pull combine at 24 SMs: the pass on the 108 SMs the budget leaves, the receive on 24
    pull = _row(backend="ray_ep", op="combine", sms="24",
                launches=[["_combine_send_kernel", 108, 108], ["_combine_recv_kernel", 24, 24]])
    res = bench.BenchResult(rows=[pull, _row()], meta={"device": "x", "combine_mode": "pull"})
    lines = res.table().splitlines()
    assert "SMs used" in lines[0]
    assert "  108/24 " in lines[2] and lines[2].split()[9] == "108/24"
    assert lines[3].split()[9] == "-"  # nothing recorded (the torch pipeline)
    assert lines[-1].endswith("combine by pull")
    res.to_json(str(tmp_path / "r.json"))
    assert bench.BenchResult.from_json(str(tmp_path / "r.json")).rows[0].launches == pull.launches


def test_table_says_the_time_of_each_launch(tmp_path):
    # a dispatch at 24 SMs: each launch's time is the slowest rank's (a receive waits for peers)
    per_rank = [dict(times_us={"dispatch": [330.0, 340.0]}, remote_rows=10, received_rows=12, check_error=0.0,
                     misplaced_rows=0, launches={"dispatch": [["_chunk_count_kernel", 24, 24],
                                                              ["_dispatch_send_kernel", 24, 24]]},
                     launch_us={"dispatch": us}) for us in ([8.6, 301.2], [9.4, 296.0])]
    cfg = EPConfig.preset("tiny", gpus_per_node=2)
    row = runner.aggregate(per_rank, "dispatch", cfg, 100, preset="tiny", backend="ray_ep", dtype="fp8",
                           routing="uniform", tokens=8, sms="24")
    assert row.launch_us == [9.4, 301.2]
    res = bench.BenchResult(rows=[row, _row()], meta={"device": "x"})
    lines = res.table().splitlines()
    assert lines[0].split()[-3:] == ["us", "per", "launch"]
    assert lines[2].split()[-1] == "9/301" and lines[3].split()[-1] == "-"
    res.to_json(str(tmp_path / "r.json"))
    assert bench.BenchResult.from_json(str(tmp_path / "r.json")).rows[0].launch_us == row.launch_us
    # ranks that launched differently (or timed nothing) give no per-launch figure
    per_rank[1]["launch_us"] = {"dispatch": [9.4]}
    assert runner.aggregate(per_rank, "dispatch", cfg, 100, preset="tiny", backend="ray_ep", dtype="fp8",
                            routing="uniform", tokens=8, sms="24").launch_us == []


def test_plot_of_an_sm_budget_sweep_draws_each_budget(tmp_path):
    # a published --num-sms all,24,16 run: every (dtype, budget) is a series of its own, not
    # three budgets drawn over one another
    from ray_ep.bench.runner import _plot

    res = bench.BenchResult.from_json(str(DOCS / "bench-4xh200-v13.json"))
    assert {r.sms for r in res.rows} == {"132", "24", "16"}
    labels = _plot(res, str(tmp_path / "sweep.png"))
    assert labels == [f"ray_ep {d} @{b} SMs" for d in ("bf16", "fp8", "nvfp4") for b in ("132", "24", "16")]
    # one budget (and the NCCL pipeline, which has none): no budget in the labels
    assert _plot(bench.BenchResult.from_json(str(DOCS / "bench-4xh200-v4.json")), str(tmp_path / "v4.png"))[:2] == [
        "ray_ep bf16", "NCCL pipeline bf16"]


class FakeCluster:
    """Stands in for EPCluster where no worker is needed."""

    backend = "torch"
    actors: list = []

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def _teardown(self):
        pass


def test_plot_without_matplotlib_fails_before_any_cluster(monkeypatch, tmp_path, capsys):
    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(runner, "EPCluster", no_cluster)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--preset", "tiny", "--world", "2", "--plot", str(tmp_path / "f.png"), "--quiet"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "ray-ep bench: --plot needs matplotlib: pip install 'ray-ep[plot]'"


def test_a_failing_plot_keeps_the_table_and_the_json(monkeypatch, tmp_path, capsys):
    res = bench.BenchResult(rows=[_row(), _row(op="combine")], meta={"device": "cpu", "world_size": 2})
    monkeypatch.setattr(runner, "EPCluster", FakeCluster)
    monkeypatch.setattr(runner, "run_bench", lambda cluster, **kw: res)

    def broken_plot(self, path):
        raise RuntimeError("no display")

    monkeypatch.setattr(bench.BenchResult, "plot", broken_plot)
    js = tmp_path / "r.json"
    rc = cli.main(["bench", "--preset", "tiny", "--world", "2", "--json", str(js), "--plot", str(tmp_path / "f.png"),
                   "--quiet"])
    assert rc == 1
    captured = capsys.readouterr()
    assert "gloo-pipeline" in captured.out and "combine" in captured.out
    assert len(json.loads(js.read_text())["rows"]) == 2
    assert "the plot failed (RuntimeError: no display)" in captured.err and len(captured.err.splitlines()) == 1


def test_a_failed_check_says_where_and_fails_the_command(monkeypatch, tmp_path, capsys):
    """A run whose round trip is wrong: FAIL in the check column of its dispatch and combine
    rows, one line under the table naming the run and where each rank went wrong, the table
    and JSON kept, exit status 1. A passing run keeps its figure, a misplaced row MISPLACED."""
    where = "rank 1: 3 of 8 tokens wrong; the worst, token 5: 128 of 256 channels in 1 group(s) of 128 (1)"
    bad = {"dtype": "fp8", "sms": "16", "check_error": 0.37, "check_detail": where}
    layer = {"op": "layer-mb2", "experts": "fp8", "check_error": 0.05, "check_detail": "rank 0: 1 of 8 tokens wrong"}
    res = bench.BenchResult(rows=[_row(), _row(op="combine"), _row(**bad), _row(op="combine", **bad),
                                  _row(dtype="nvfp4", misplaced_rows=2), _row(op="layer", check_error=None),
                                  _row(**layer)], meta={"device": "cpu", "world_size": 2})
    assert [r.check_failed for r in res.rows] == [False, False, True, True, True, False, True]
    table = res.table()
    checks = [line.split()[-5] for line in table.splitlines()[2:9]]  # then TFLOP/s, wt GB/s, host us, launches
    assert checks == ["1.0e-03", "1.0e-03", "FAIL", "FAIL", "MISPLACED", "-", "FAIL"]
    failed = [line for line in table.splitlines() if line.startswith("# check FAILED: ")]
    assert len(failed) == 3  # one per run (its dispatch and combine rows share one check), one per layer row
    assert "tiny gloo-pipeline 1x2 fp8 uniform 8 tokens/rank 16 SMs: round-trip error 3.70e-01" in failed[0]
    assert failed[0].endswith(where) and "misplaced rows 2" in failed[1]
    assert "layer-mb2 (fp8 experts) against the serial layer: difference 5.00e-02" in failed[2]

    monkeypatch.setattr(runner, "EPCluster", FakeCluster)
    monkeypatch.setattr(runner, "run_bench", lambda cluster, **kw: res)
    js = tmp_path / "r.json"
    assert cli.main(["bench", "--preset", "tiny", "--world", "2", "--json", str(js), "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "# check FAILED: " in captured.out
    assert "the correctness check failed on 3 run(s)" in captured.err and len(captured.err.splitlines()) == 1
    rows = json.loads(js.read_text())["rows"]
    assert [r["check_detail"] for r in rows][2] == where
    assert bench.BenchResult.from_json(str(js)).rows == res.rows


def test_a_row_is_checked_before_timing_and_on_its_last_timed_round():
    from ray_ep.bench.loops import _both_checks

    passed = (1e-3, 0, 10, 12, "")
    assert _both_checks(passed, (2e-3, 0, 10, 12, "")) == (2e-3, 0, "")
    assert _both_checks(passed, (0.3, 0, 10, 12, "1 of 8 tokens wrong")) == (
        0.3, 0, "last timed round: 1 of 8 tokens wrong")
    assert _both_checks((0.2, 3, 10, 12, "3 rows"), (0.3, 0, 10, 12, "1 token")) == (
        0.3, 3, "first round: 3 rows; last timed round: 1 token")


def test_bench_help_lists_the_exit_statuses(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for line in ("0    every row ran and every check passed", "1    a check failed (FAIL or MISPLACED",
                 "2    bad flags", "130  Ctrl-C"):
        assert line in out


def test_where_a_round_trip_went_wrong():
    """where_wrong names the tokens and channels off by more than ROUND_TRIP_TOL: a wrong fp8
    scale shows as one 128-channel group with one ratio, a lost expert share as the whole row
    with one ratio, and its experts' ranks; a right round trip gives ''."""
    import torch

    from ray_ep.bench.loops import ROUND_TRIP_TOL, expected_round_trip, where_wrong
    from ray_ep.inputs import rank_inputs

    cfg = EPConfig(hidden_size=512, n_experts=16, top_k=4, intermediate_size=128, max_tokens_per_rank=64,
                   gpus_per_node=2, dispatch_dtype="fp8")
    x, ids, w = rank_inputs(cfg, 16, 0, 3, "uniform")
    exp = expected_round_trip(x, w, cfg)
    assert where_wrong(exp.to(torch.bfloat16), x, ids, w, cfg) == ""
    out = exp.clone()
    out[5, 128:256] *= 0.5  # one group's scale halved
    text = where_wrong(out, x, ids, w, cfg)
    assert text.startswith("1 of 16 tokens wrong; the worst, token 5: ")
    assert "in 1 group(s) of 128 (1), out / expected 0.5 (0.5 to 0.5)" in text
    ranks = sorted({int(e) // cfg.experts_per_rank for e in ids[5].tolist() if e >= 0})
    assert text.endswith(f"its experts on ranks {ranks}")
    out = exp.clone()
    share = 1 - w[9, 0] / w[9].sum()  # token 9 without its first expert's share
    out[9] *= share
    out[2, 0] += 3 * ROUND_TRIP_TOL * exp.abs().max()  # a smaller error elsewhere
    text = where_wrong(out, x, ids, w, cfg)  # (token 9's channels near 0 stay within the tolerance)
    assert text.startswith("2 of 16 tokens wrong; the worst, token 9: ")
    assert f"channels in 4 group(s) of 128 (0-3), out / expected {share:.3g} ({share:.3g} to {share:.3g})" in text


def test_where_rows_are_misplaced():
    """placement counts expert-major rows whose token did not choose the segment's expert and
    says how many of them name a row past what its source sent this round (a position this
    round's receive never wrote: stale from an earlier round), and their local experts; a
    right receive gives (0, '')."""
    from types import SimpleNamespace

    import torch

    from ray_ep.bench.loops import placement
    from ray_ep.kernels.dispatch import expert_major_torch
    from ray_ep.kernels.layout import compute_layout_torch

    cfg = EPConfig(hidden_size=512, n_experts=8, top_k=2, intermediate_size=128, max_tokens_per_rank=8,
                   gpus_per_node=2)
    R, N, K, L = 2, 8, 2, 4
    sent = {0: torch.tensor([[0, 1], [1, 2], [0, 3], [2, 1], [3, 0]]), 1: torch.tensor([[1, 0], [2, 3], [1, 3]])}
    meta = torch.zeros(R * N, 3 * K, dtype=torch.int32)
    meta[:, :K] = 7  # rows no round wrote: tokens of rank 1's expert 7
    counts = torch.zeros(R, L + 1, dtype=torch.int32)
    for src, ids in sent.items():  # every token has its experts on rank 0: its slot there is its index
        lay = compute_layout_torch(topk_ids_TK=ids.int(), world_size=R, experts_per_rank=L)
        meta[src * N:src * N + len(ids), :2 * K] = torch.cat([ids.int(), lay.ordinals_TK], dim=1)
        counts[src, 0] = len(ids)
        counts[src, 1:] = lay.expert_counts_E[:L]
    recv = expert_major_torch(cfg=cfg, rank=0, counts_RL1=counts, meta_rows=meta,
                              row_base_R=torch.arange(R, dtype=torch.int32) * N)
    h = SimpleNamespace(recv=recv, meta_rows=meta)
    assert placement(h, cfg, 0) == (0, "")
    offs = recv.row_offsets_L1.tolist()
    recv.row_ids_M[offs[1]] = 5  # expert 1's first row: source 0's row 5, which it did not send
    recv.row_ids_M[offs[2]] = N + 0  # expert 2's first row: source 1's token 0, which chose 1 and 0
    assert placement(h, cfg, 0) == (2, "2 expert-major rows of tokens that did not choose the expert (1 of them "
                                       "name a row past what its source sent this round), local experts 1-2")


def _assert_dead(actors, within_s: float = 30.0):
    """Every actor stops answering within ``within_s``: ray.kill is asynchronous, so a ping that
    reaches an actor before its kill lands is still answered (seen once in CI); poll until the
    pings fail."""
    import ray
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + within_s
    for h in actors:
        while True:
            try:
                ray.get(h._ep_ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except RayActorError:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"{h} still answers {within_s:g} s after the workers were stopped")
            time.sleep(0.2)


def test_ctrl_c_inside_run_bench_stops_the_workers(ray_session, monkeypatch, capsys):
    seen = {}

    def interrupted_run(cluster, **kwargs):
        seen["actors"] = cluster.actors  # the cluster is up
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_bench", interrupted_run)
    rc = cli.main(["bench", "--backend", "torch", "--preset", "tiny", "--world", "2", "--quiet"])
    assert rc == 130
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == INTERRUPTED and captured.out == ""
    _assert_dead(seen["actors"])


def test_ctrl_c_during_a_long_row_kills_the_workers(ray_session, monkeypatch, capsys):
    # a real SIGINT to this process while every worker sits in a 60 s call: the driver must not
    # wait for it (nor for a clean shutdown queued behind it): its waits poll, and the interrupted
    # cluster kills its workers
    seen = {}

    def long_row(cluster, **kwargs):
        seen["actors"] = cluster.actors
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        seen["t0"] = time.monotonic()
        cluster.run(lambda worker, s: time.sleep(s), 60)

    monkeypatch.setattr(runner, "run_bench", long_row)
    rc = cli.main(["bench", "--backend", "torch", "--preset", "tiny", "--world", "2", "--quiet"])
    elapsed = time.monotonic() - seen["t0"]
    assert rc == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == INTERRUPTED
    assert elapsed < 20, f"took {elapsed:.1f} s after Ctrl-C"
    _assert_dead(seen["actors"])


def test_soak_rounds_including_empty_ones(ray_session):
    """The soak loop (the GPU suite's 200 rounds) on CPU workers: fresh inputs each round, and
    rounds where no rank has a token (nothing arrives anywhere) check as exact."""
    from ray_ep import EPCluster
    from ray_ep.bench.loops import run_row

    with EPCluster(EPConfig.preset("tiny", gpus_per_node=2)) as ep:
        for tokens in (16, 0):
            res = ep.run(run_row, "soak", rounds=2, num_tokens=tokens, routing="skewed", fused=True)
            assert [r["misplaced_rows"] for r in res] == [0, 0]
            assert all(r["max_rel_error"] < 2e-2 for r in res) and (tokens or all(r["max_rel_error"] == 0 for r in res))


def test_source_commit_names_the_tree_it_runs(tmp_path, monkeypatch):
    # the commit the benchmark's JSON records: '+dirty' once a tracked file differs from it
    # (a copied tree with an older .git must not pass for that commit); RAY_EP_COMMIT wins
    import subprocess

    monkeypatch.delenv("RAY_EP_COMMIT", raising=False)
    assert runner.source_commit(str(tmp_path)) == "unknown"  # not a checkout
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run(git + ["init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run(git + ["add", "a.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "a"], check=True)
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert runner.source_commit(str(tmp_path)) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert runner.source_commit(str(tmp_path)) == head + "+dirty"
    monkeypatch.setenv("RAY_EP_COMMIT", "abc1234")
    assert runner.source_commit(str(tmp_path)) == "abc1234"


def test_experts_world_gives_rank_0_the_rows_of_its_experts():
    """The one-device stand-in for an R-rank world's experts: rank 0 holds, per local expert,
    exactly the (token, expert) pairs of every rank's tokens that name that expert."""
    import torch

    from ray_ep.bench import experts_world
    from ray_ep.inputs import rank_inputs

    cfg, tokens = experts_world.config_for("tiny", 4, tokens=24)
    world, h, x0 = experts_world.rank0_rows(cfg, tokens, seed=3, routing="skewed", device=torch.device("cpu"))
    L = cfg.experts_per_rank
    ids = [rank_inputs(cfg, tokens, r, 3, "skewed")[1] for r in range(cfg.world_size)]
    want = [sum(int((i == e).sum()) for i in ids) for e in range(L)]
    assert h.recv.num_tokens_L.tolist() == want and sum(want) > 0
    assert x0.shape == (tokens, cfg.hidden_size)


def test_experts_world_command_prints_a_row_per_expert_dtype(tmp_path, capsys):
    from ray_ep.bench import experts_world

    path = tmp_path / "ew.json"
    assert experts_world.main(["--world", "2", "--expert-dtype", "bf16,fp8", "--iters", "1", "--warmup", "0",
                               "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "rank 0 of 2 ranks" in out
    rows = json.loads(path.read_text())
    assert [r["expert_dtype"] for r in rows] == ["bf16", "fp8"]
    for r in rows:
        assert set(r["us"]) == set(experts_world.OPS) and r["rows"] > 0 and r["check_error"] <= r["tolerance"]


@pytest.mark.parametrize("flags", [["--expert-dtype", "fp4"], ["--world", "0"], ["--iters", "0"]])
def test_experts_world_refuses_bad_flags(flags, capsys):
    from ray_ep.bench import experts_world

    with pytest.raises(SystemExit) as e:
        experts_world.main(flags)
    assert e.value.code == 2 and "--expert-dtype takes" in capsys.readouterr().err
