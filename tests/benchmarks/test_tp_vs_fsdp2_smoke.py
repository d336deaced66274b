"""The TP benchmark against FSDP2 x TP at a toy size (dp 2 x tp 2, one round), with AdamW and
with Muon (three systems and the same-gradient check): BENCHMARKS.md's TP figures come from it,
so it must keep running; the collectives and bytes it counts, the checks and the losses are
checked, not speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.cli import refusal
from tests.docs.ranks import run_script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TOY = ["--world-size", "4", "--tp", "2", "--steps", "1", "--dim", "64", "--layers", "2"]
TOY += ["--heads", "4", "--kv-heads", "2", "--vocab", "128", "--batch", "1", "--seq", "8"]


@pytest.mark.slow  # ~80 s: 4 ranks build both systems twice on 2 cores
def test_tp_vs_fsdp2_counts_collectives_and_matches_losses():
    run = run_script([str(BENCHMARKS / "tp_vs_fsdp2.py"), *TOY], timeout=280)
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


@pytest.mark.slow  # ~80 s: 4 ranks build three systems twice, and a one-block copy of each
def test_tp_vs_fsdp2_muon_runs_all_three_and_checks_them():
    run = run_script([str(BENCHMARKS / "tp_vs_fsdp2.py"), *TOY, "--optimizer", "muon"], timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    ours, peer, gather = result["ours"], result["fsdp2"], result["gather"]
    for system in (ours, peer, gather):  # the runtimes' collectives do not change with Muon
        assert system["calls"] == {"all_gather": 2 * 2 + 2, "reduce_scatter": 2 + 2}, system
        assert system["optimizer_bytes"] > 0, system
    # ours: every matrix is TP-split, so each travels to its owner (one exchange, no per-rank
    # full copies): fewer bytes than gathering every matrix on every rank
    assert ours["matrices"] == {"matrices": 2 * 7, "matrices_local": 0}, ours
    assert ours["optimizer_bytes"] < gather["optimizer_bytes"], result
    assert peer["optimizer_collectives"] and not ours["optimizer_collectives"], result
    # the same gradients: ours and gather-everything are one process's torch Muon + AdamW
    # bitwise; torch's Muon on FSDP2 x TP DTensors runs, within bf16 rounding of it (its
    # sharded NS matmuls round their partial sums in bf16: not bitwise)
    check = result["check"]
    assert check["ours"]["bitwise"] and check["gather"]["bitwise"], check
    assert check["fsdp2"]["error"] is None and check["fsdp2"]["rest_error"] == 0.0, check
    assert check["fsdp2"]["vs_fp64"] < 3 * check["bf16_vs_fp64"], check
    # end to end: ours and gather the same losses; FSDP2's DTensor Muon within bf16 NS noise
    assert result["loss_diff_gather"] < 1e-6, result
    assert result["loss_diff"] < 1e-3, result
    assert {"step", "optim", "transient", "optimizer_bytes"} <= set(result["ratio"]), result
    table = run.stdout.split("\n\n", 1)[1]
    for row in ("optimizer step (ms)", "optimizer MiB sent", "same gradients", "FSDP2+gather"):
        assert row in table, table


def test_tp_vs_fsdp2_refuses_a_tp_the_heads_cannot_split():
    last = refusal("tp_vs_fsdp2", *TOY, "--kv-heads", "1")
    assert "--tp 2 does not divide model.n_kv_heads=1" in last, last
