"""examples/train_moe.py on CPU workers through Ray Train (2 ranks): the loss goes down, a run
resumed from its Ray Train checkpoint continues where it stopped, and expert-parallel
training takes the same steps as one process training on the whole batch; and
examples/torchrun_moe.py under torch.distributed.run (no Ray)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

from spawn_ranks import run_ranks

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# |loss on 2 ranks - loss in one process| per step: fp32 everywhere, the same math summed in
# another order (per-rank partial sums, the gradients' all-reduce); measured 9.5e-7 at worst
# over 30 Adam steps on 2 ranks (4.8e-7 on 4), far below the loss's step-to-step motion (~0.1)
LOSS_TOL = 1e-4


def _example():
    spec = importlib.util.spec_from_file_location("train_moe", EXAMPLES / "train_moe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_moe"] = module
    spec.loader.exec_module(module)
    return module


def _train_one_process(rank: int, settings: dict) -> list[float]:
    from ray_ep import EPCommunicator

    ex = _example()
    s = ex.Settings(**settings)
    with EPCommunicator(ex.ep_config(s, 1)) as comm:
        return ex.train(comm, s)["losses"]


def test_ray_train_example_learns_resumes_and_matches_one_process(ray_session, tmp_path):
    ex = _example()
    s = ex.Settings(steps=8, checkpoint_every=4)
    first = ex.run(s, 2, str(tmp_path), "ep")
    assert first["resumed_at"] is None and first["checkpoint"]
    resumed = ex.run(ex.Settings(steps=10, checkpoint_every=4), 2, str(tmp_path), "ep")  # same name: resumes
    assert resumed["resumed_at"] == 8
    ep = first["history"]["losses"] + resumed["history"]["losses"]
    one = run_ranks(_train_one_process, 1, {**vars(s), "steps": 10})[0]
    assert len(ep) == len(one) == 10
    for step, (a, b) in enumerate(zip(ep, one), 1):
        assert abs(a - b) <= LOSS_TOL, (step, a, b)
    assert sum(ep[-3:]) / 3 < ep[0] - 0.3, ep  # from ln(64) = 4.16 towards the strides' patterns
    assert first["summary"]["tokens_per_s"] > 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_torchrun_example_without_ray():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(EXAMPLES / "torchrun_moe.py"), "--steps", "3"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("torchrun_moe: 2 ranks, backend torch"), out.stdout
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step ") and "loss" in line]
    assert len(losses) == 3
    assert "tokens/s" in lines[-1]


def test_readme_shows_the_own_model_example_as_it_is():
    """The README's "Use it in your own model" block is examples/own_model.py (which the README
    test runs under torchrun), so the two cannot drift apart."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    section = readme[readme.index("## Use it in your own model"):]
    start = section.index("```python\n") + len("```python\n")
    shown = section[start:section.index("\n```", start)]
    code = (EXAMPLES / "own_model.py").read_text()
    assert code.rstrip("\n").endswith(shown), "README block and examples/own_model.py differ"
    assert shown.startswith("import torch")
