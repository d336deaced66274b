"""``.ci/failures.py``: a failed CI run ends with the failing test ids and their reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RECAP = Path(__file__).resolve().parents[1] / ".ci" / "failures.py"

FAILING = """
import pytest

def test_passes():
    pass

@pytest.mark.parametrize("world", [2])
def test_rank_fails(world):
    raise AssertionError("WorkerPool(2).run(step) failed\\n--- rank 1 ---\\nValueError: boom")

class TestGroup:
    def test_errors(self):
        assert 1 == 2
"""


def test_the_recap_names_each_failure_and_shows_the_rank_traceback(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(FAILING)
    report = tmp_path / "junit.xml"
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sample.py"]
    run = subprocess.run(
        [*pytest, f"--junitxml={report}", "-o", "junit_family=xunit1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1, run.stdout
    recap = subprocess.run(
        [sys.executable, str(RECAP), str(report)], capture_output=True, text=True, check=True
    ).stdout
    ids = recap.strip().split("\n\n")[0].splitlines()
    assert ids == [
        "==== 2 failing test(s) ====",
        "test_sample.py::test_rank_fails[2] (failure)",
        "test_sample.py::TestGroup::test_errors (failure)",
    ]
    assert "--- rank 1 ---" in recap and "ValueError: boom" in recap
    assert "test_passes" not in recap


def test_no_report_is_not_an_error(tmp_path: Path) -> None:
    recap = subprocess.run(
        [sys.executable, str(RECAP), str(tmp_path / "missing.xml")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert recap.startswith("no test report to summarise")
