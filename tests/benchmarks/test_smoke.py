"""The fully_shard vs FSDP2 benchmark scripts, at toy sizes: BENCHMARKS.md's figures come from
them, so they must keep running (the figures themselves are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.docs.ranks import run_script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TOY = ["--dim", "64", "--layers", "1", "--vocab", "256", "--batch", "1", "--seq", "16"]


def _run(script: str, *args: str) -> str:
    run = run_script([str(BENCHMARKS / script), *args, *TOY], timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_fsdp_vs_fsdp2_reports_ratios_and_equal_losses():
    out = _run("fsdp_vs_fsdp2.py", "--steps", "1", "--gather-repeats", "1", "--wrap", "torchtitan")
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert set(result["ratio"]) == {
        "unshard_reshard",
        "step",
        "peak_memory",
        "peak_allocated",
        "floor_peak_memory",
        "floor_peak_allocated",
        "bound_peak_memory",
    }
    assert result["ours"]["loss"] == result["fsdp2"]["loss"]
    floor = result["floor"]  # the bound adds gathered weights to the floor's phases
    assert floor["bound"] > floor["mem"] and floor["bound"] <= result["fsdp2"]["mem"], result


def test_memory_phases_floor_reports_the_bound():
    out = _run("memory_phases.py", "floor")
    assert "bound for blocks wrapping" in out and "optimizer step" not in out


def test_memory_phases_marks_the_summit():
    out = _run("memory_phases.py", "ours", "--mixed-precision")
    phases = [line.split() for line in out.splitlines()]
    phases = [
        w for w in phases if w[:1] in (["forward"], ["backward"]) and w[2] in ("start", "end")
    ]
    assert len(phases) == 4 * 4  # embed, one block, norm, head: start and end, both passes
    assert sum("<==" in line for line in out.splitlines()) >= 1
