"""benchmarks/fp8_all_gather.py at a toy size: BENCHMARKS.md's FP8 figures come from it, so it
must keep running; its byte counts are checked, not its speed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.docs.ranks import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_all_gather.py"


def test_fp8_all_gather_halves_the_bytes_of_fsdp2():
    toy = ["--dim", "128", "--layers", "1", "--vocab", "256", "--seq", "16", "--steps", "1"]
    run = run_script([str(SCRIPT), *toy], timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    gathered = result["all_gather_bytes_per_step"]
    assert gathered["bf16"] == gathered["fsdp2"]  # no padding at this size: same bf16 bytes
    assert 0.5 < result["all_gather_ratio_fp8_vs_fsdp2"] < 0.55, result
    assert 0.5 < result["all_gather_ratio_mxfp8_vs_fsdp2"] < 0.55, result
    assert abs(result["last_loss"]["fp8"] - result["last_loss"]["fsdp2"]) < 0.05, result


def test_fp8_training_compares_paired_runs(tmp_path):
    """benchmarks/fp8_training.py on a 1-block model with one 128x128 tile per matrix, 2 steps:
    the FP8 run is paired with the bf16 one and differs from it (the gather is quantized)."""
    plot = tmp_path / "curves.png"
    run = run_script(
        [
            str(SCRIPT.with_name("fp8_training.py")),
            *("--seeds", "0", "--steps", "2", "--nproc", "1", "--modes", "bf16", "fp8"),
            *("--plot", str(plot), "--recipe-args=--config debug --model.dim 128 --seq-len 16"),
        ],
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    seed = result["runs"]["0"]
    assert seed["fp8"]["final"] != seed["bf16"]["final"], result
    assert abs(result["vs_bf16"]["fp8"]["final"][0]) < 0.05, result
    assert plot.stat().st_size > 0
