"""The gloo all-gather benchmark at a toy size: every method's gathered buffer is checked bit
for bit inside the ranks (the script fails otherwise); times are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benchmarks.cli import BENCHMARKS, refusal


def test_runs_and_reports_every_method() -> None:
    argv = ["--world-sizes", "3", "--mib", "0.001", "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gloo_gather.py"), *argv],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(row["world"], row["mib"]) for row in rows] == [(3, 0.001)]
    assert all(rows[0][m] > 0 for m in ("exchange", "or_all_reduce", "all_gather_single"))


@pytest.mark.parametrize(
    ("argv", "fix"),
    [(["--world-sizes", "1"], "needs 2 or more ranks"), (["--repeats", "0"], "must be positive")],
)
def test_bad_arguments_are_refused(argv: list[str], fix: str) -> None:
    assert fix in refusal("gloo_gather", *argv)
