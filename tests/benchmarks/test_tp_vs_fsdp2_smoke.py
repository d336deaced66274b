"""The TP benchmark against FSDP2 x TP at a toy size (dp 2 x tp 2, one round): BENCHMARKS.md's
TP figures come from it, so it must keep running; the collectives it counts and the losses are
checked, not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TOY = ["--world-size", "4", "--tp", "2", "--steps", "1", "--dim", "64", "--layers", "2"]
TOY += ["--heads", "4", "--kv-heads", "2", "--vocab", "128", "--batch", "1", "--seq", "8"]


@pytest.mark.slow  # ~80 s: 4 ranks build both systems twice on 2 cores
def test_tp_vs_fsdp2_counts_collectives_and_matches_losses():
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "tp_vs_fsdp2.py"), *TOY],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    ours, peer = result["ours"], result["fsdp2"]
    assert result["loss_diff"] < 1e-5, result
    # per block a gather in forward and one in backward, the embedding and [norm, output] once
    # each; a reduce-scatter per group (the root holds no parameter of its own)
    for system in (ours, peer):
        assert system["calls"] == {"all_gather": 2 * 2 + 2, "reduce_scatter": 2 + 2}, system
    # both shard the same TP-local tensors over dp 2: the same bytes (no padding at this shape)
    assert result["ratio"]["all_gather_bytes"] == pytest.approx(1.0, abs=0.01), result
    assert result["ratio"]["reduce_scatter_bytes"] == pytest.approx(1.0, abs=0.01), result
    assert {"step", "transient", "static_tensors"} <= set(result["ratio"])  # static: ~0 here
    table = run.stdout.split("\n\n", 1)[1]
    for row in ("training step", "all-gather MiB", "reduce-scatter MiB", "transient peak"):
        assert row in table, table


def test_tp_vs_fsdp2_refuses_a_tp_the_heads_cannot_split():
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "tp_vs_fsdp2.py"), *TOY, "--kv-heads", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    last = run.stderr.splitlines()[-1]
    assert run.returncode == 2 and "--tp 2 does not divide model.n_kv_heads=1" in last, run.stderr
