"""The suite's own plumbing (tests/conftest.py)."""

import os
import subprocess
import sys
from pathlib import Path


def test_failure_reports_are_written_as_they_happen(tmp_path):
    # RAY_EP_TEST_REPORTS: a run cut short on a GPU host still leaves each failure's report
    (tmp_path / "conftest.py").write_text(Path(__file__).with_name("conftest.py").read_text())
    (tmp_path / "test_x.py").write_text("def test_fails():\n    assert 1 == 2, 'boom'\n\n\ndef test_ok():\n    pass\n")
    reports = tmp_path / "reports.txt"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_x.py"],
                          cwd=tmp_path, env={**os.environ, "RAY_EP_TEST_REPORTS": str(reports)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = reports.read_text()
    assert "== test_x.py::test_fails (call)" in text and "boom" in text
    assert "test_ok" not in text
