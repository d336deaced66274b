"""The per-module overhead benchmark and the step profile at toy sizes: BENCHMARKS.md's
per-module figures come from them, so they must keep running and report what they say they
report; no figure is asserted (step times depend on the machine's load)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.benchmarks.cli import refusal
from tests.docs.ranks import run_script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
COUNTS = ("step_us", "optim_us", "python_calls", "optim_calls", "allocations")


def _run(script: str, *args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    return run_script([str(BENCHMARKS / script), *args], timeout=timeout)


def _json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _check_rows(rows: list[dict], expected: list[tuple[str, int, int]]) -> None:
    assert [(r["model"], r["world"], r["groups"]) for r in rows] == expected
    for row in rows:
        for system in ("ours", "fsdp2"):
            assert all(row[system][k] > 0 for k in COUNTS), row
        # the unwrapped model: its step and allocations, and what each wrapping adds to it
        assert row["bare"]["step_us"] > 0 and row["bare"]["python_calls"] > 0, row
        assert isinstance(row["added"], float)
        assert set(row["ratio"]) == set(COUNTS)
        # the same model, data and optimizer math: the two systems compute the same loss
        assert row["ours"]["loss"] == pytest.approx(row["fsdp2"]["loss"], rel=1e-5), row


@pytest.mark.slow  # ~1-3 min under load: two launches, each building both systems
def test_module_overhead_reports_the_moe_layer_at_one_and_two_ranks():
    args = ["--model", "moe", "--groups", "4", "--steps", "1", "--world-sizes", "1", "2"]
    run = _run("module_overhead.py", *args, timeout=480)
    assert run.returncode == 0, run.stdout + run.stderr
    _check_rows(_json_lines(run.stdout), [("moe", 1, 4), ("moe", 2, 4)])
    assert "per group, medians" in run.stdout


@pytest.mark.slow  # ~1-3 min under load: two launches, each building both systems
def test_module_overhead_reports_the_blocks_at_two_sizes():
    args = ["--model", "blocks", "--groups", "3", "6", "--steps", "1", "--world-sizes", "2"]
    args += ["--optim", "adamw"]  # each system's AdamW (the MoE test above runs SGD)
    run = _run("module_overhead.py", *args, timeout=480)
    assert run.returncode == 0, run.stdout + run.stderr
    _check_rows(_json_lines(run.stdout), [("blocks", 2, 3), ("blocks", 2, 6)])


def test_module_overhead_refuses_too_few_tokens_for_the_experts():
    last = refusal("module_overhead", "--model", "moe", "--groups", "8", "--tokens", "4")
    assert "--tokens 4 < --groups 8" in last, last


def test_step_profile_charges_every_category_per_rank():
    toy = ["--dim", "64", "--layers", "1", "--vocab", "256", "--batch", "1", "--seq", "16"]
    run = _run("step_profile.py", *toy, "--steps", "1")
    assert run.returncode == 0, run.stdout + run.stderr
    (result,) = _json_lines(run.stdout)
    assert len(result["ranks"]) == 2
    for rank in result["ranks"]:
        for system in ("ours", "fsdp2"):
            assert rank[system]["model"] > 0 and rank[system]["step (unprofiled)"] > 0, rank
            assert rank[system]["collectives"] > 0, rank  # W=2: both gather and reduce
    assert "hooks/bookkeeping" in run.stdout
