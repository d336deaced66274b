"""benchmarks/fp8_all_gather.py at a toy size: BENCHMARKS.md's FP8 figures come from it, so it
must keep running; its byte counts are checked, not its speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_all_gather.py"


def test_fp8_all_gather_halves_the_bytes_of_fsdp2():
    toy = ["--dim", "128", "--layers", "1", "--vocab", "256", "--seq", "16", "--steps", "1"]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *toy], capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    gathered = result["all_gather_bytes_per_step"]
    assert gathered["bf16"] == gathered["fsdp2"]  # no padding at this size: same bf16 bytes
    assert 0.5 < result["all_gather_ratio_fp8_vs_fsdp2"] < 0.55, result
    assert abs(result["last_loss"]["fp8"] - result["last_loss"]["fsdp2"]) < 0.05, result
