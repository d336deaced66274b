"""The gloo collectives benchmark at a toy size: every method's gathered buffer and reduced
segment is checked bit for bit inside the ranks (the script fails otherwise); times are not
asserted."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.cli import BENCHMARKS, refusal
from tests.docs.ranks import run_script


def test_runs_and_reports_every_method() -> None:
    argv = ["--world-sizes", "2", "3", "--mib", "0.001", "--repeats", "1"]
    done = run_script([str(BENCHMARKS / "gloo_gather.py"), *argv], timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(row["world"], row["mib"]) for row in rows] == [(2, 0.001), (3, 0.001)]
    methods = ("exchange", "or_all_reduce", "all_gather_single")
    methods += ("reduce_scatter_flat", "all_reduce", "reduce_scatter_single")
    assert all(row[m] > 0 for row in rows for m in methods)


@pytest.mark.parametrize(
    ("argv", "fix"),
    [(["--world-sizes", "1"], "needs 2 or more ranks"), (["--repeats", "0"], "must be positive")],
)
def test_bad_arguments_are_refused(argv: list[str], fix: str) -> None:
    assert fix in refusal("gloo_gather", *argv)
