"""The ``ray-ep`` command: bad flags and configs end in one line on stderr and exit status 2;
``--version`` and ``python -m ray_ep``; ``plan`` reports the memory of a rank."""

import subprocess
import sys

import pytest

from ray_ep import __version__, cli
from ray_ep.config import EPConfig, format_bytes, plan_memory


@pytest.mark.parametrize("argv, words", [
    (["plan", "--preset", "deepseek-v3", "--gpus", "3"], "--preset deepseek-v3: n_experts (E) = 256 must be divisible"),
    (["plan", "--config", "no/such.yaml"], "--config no/such.yaml: No such file or directory"),
    (["plan", "--topology", "2y2"], "--topology: a topology looks like 2x4"),
    (["check", "--preset", "tiny", "--world", "3"], "must be divisible by the world size"),
])
def test_bad_flags_and_configs_are_one_line(argv, words, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ray-ep {argv[0]}: ") and words in err, err


def test_bad_yaml_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hidden_size: [\n")
    assert cli.main(["plan", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err


def test_plan_reports_the_memory_of_a_rank(capsys):
    assert cli.main(["plan", "--preset", "mixtral", "--world", "2"]) == 0
    out = capsys.readouterr().out
    plan = plan_memory(EPConfig.preset("mixtral", gpus_per_node=2))
    for label, nbytes in (("expert weights (1 layer)", plan.experts_per_layer), ("expert scratch", plan.scratch),
                          ("all 2 ranks on one host", 2 * plan.per_rank())):
        line = next(line for line in out.splitlines() if line.startswith(label))
        assert line.endswith(format_bytes(nbytes)), line


def test_version_and_module_entry_point():
    for cmd in ([sys.executable, "-m", "ray_ep", "--version"], ["ray-ep", "--version"]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except FileNotFoundError:  # the console script is missing where the package is not installed
            continue
        assert out.returncode == 0 and out.stdout.strip() == f"ray-ep {__version__}", out


@pytest.mark.parametrize("argv, words", [
    (["check", "--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    (["check", "--rounds", "-1"], "argument --rounds: must be at least 1, got -1"),
    (["check", "--tokens", "0"], "argument --tokens: must be at least 1, got 0"),
    (["plan", "--gpus", "0"], "argument --gpus: must be at least 1, got 0"),
    (["plan", "--world", "x"], "argument --world: 'x' is not an integer"),
    (["bench", "--world", "0"], "argument --world: must be at least 1, got 0"),
    (["nope"], "invalid choice: 'nope'"),
])
def test_bad_flags_are_one_line_too(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "--help" in err, err
