"""The README's CPU command blocks, extracted from README.md and run as written, so the
README cannot drift from the code.

Markers (HTML comments, invisible on GitHub) on the line before a fenced block:

- ``<!-- test: run -->``: run the block; ``python`` blocks with the interpreter, others with
  bash, from the repository root. Commands that set up the environment (``python3 -m venv``,
  activating it, ``pip install``) are skipped: this test runs inside the environment that
  the README's test command (``bash .ci/run``) built with the same install line.
- ``<!-- test: output -->``: a block showing what the run block before it prints. Every line
  of it must appear in the real output, compared with each number replaced by ``#`` and runs
  of spaces folded (timings and errors differ from run to run; words and layout must not).

Blocks without a marker (GPU sections, long-running servers) are not run here: the GPU suite
and tests/test_serve.py cover them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SETUP = (re.compile(r"^python3? -m venv\b"), re.compile(r"^(\.|source) \S*activate$"), re.compile(r"^pip install\b"))
NUMBER = re.compile(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?")


def blocks(text: str) -> list[tuple[str, str, str, int]]:
    """(marker, info string, body, line number) of every marked fenced block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"<!-- test: (\w+) -->", lines[i].strip())
        if m and i + 1 < len(lines) and lines[i + 1].startswith("```"):
            info = lines[i + 1][3:].strip()
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            out.append((m.group(1), info, "\n".join(lines[i + 2:end]), i + 1))
            i = end
        i += 1
    return out


def without_setup(script: str) -> str:
    """The script minus its environment set-up commands (see the module docstring)."""
    kept = []
    for line in script.splitlines():
        parts = [p.strip() for p in line.split("&&")]
        parts = [p for p in parts if not any(r.match(p) for r in SETUP)]
        if parts:
            kept.append(" && ".join(parts))
    return "\n".join(kept)


def normalise(line: str) -> str:
    return " ".join(NUMBER.sub("#", line).split())


def cases() -> list:
    found = blocks(README.read_text())
    out = []
    for k, (marker, info, body, line) in enumerate(found):
        if marker != "run":
            continue
        expect = found[k + 1][2] if k + 1 < len(found) and found[k + 1][0] == "output" else None
        out.append(pytest.param(info, body, expect, id=f"README.md:{line}"))
    return out


def test_markers_are_found():
    markers = [b[0] for b in blocks(README.read_text())]
    assert markers.count("run") >= 4 and set(markers) <= {"run", "output"}, markers


@pytest.mark.parametrize("info, body, expect", cases())
def test_readme_block(info, body, expect):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # ray-ep of this env
    if info == "python":
        cmd = [sys.executable, "-c", body]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", without_setup(body)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"exit status {run.returncode}:\n{output[-3000:]}"
    if expect is not None:
        got = {normalise(line) for line in output.splitlines()}
        missing = [line for line in expect.splitlines() if line.strip() and normalise(line) not in got]
        assert not missing, f"lines the README shows but the run did not print: {missing}\n--- output:\n{output[-3000:]}"
