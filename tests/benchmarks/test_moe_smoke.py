"""The MoE benchmark against FSDP2 at a toy size (W=2, one round): BENCHMARKS.md's MoE figures
come from it, so it must keep running; the exact counts it reports are checked, not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TOY = ["--world-size", "2", "--steps", "1", "--dim", "64", "--moe-hidden", "32", "--layers", "2"]
TOY += ["--vocab", "128", "--batch", "1", "--seq", "8", "--experts", "3"]


def test_moe_vs_fsdp2_counts_collectives_and_matches_losses():
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "moe_vs_fsdp2.py"), *TOY],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    ours, peer = result["ours"], result["fsdp2"]
    assert result["loss_diff"] < 1e-5, result
    # per block a gather in forward and one in backward; the root once (its embedding apart)
    assert ours["calls"]["all_gather"] == 2 * 2 + 2 and peer["calls"]["all_gather"] == 2 * 2 + 1
    # E=3 over W=2: FSDP2 pads the fused experts, we do not
    assert ours["bytes"]["all_gather"] < peer["bytes"]["all_gather"], result
    assert ours["static_tensors"] < peer["static_tensors"], result
    assert {"step", "transient", "all_gather_bytes", "reduce_scatter_bytes"} <= set(result["ratio"])


def test_moe_vs_fsdp2_refuses_a_top_k_above_the_experts():
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "moe_vs_fsdp2.py"), *TOY, "--top-k", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0 and "top_k=4" in run.stderr.splitlines()[-1], run.stderr
