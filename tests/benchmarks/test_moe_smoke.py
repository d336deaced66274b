"""The MoE benchmark against FSDP2 at a toy size (W=2, one round; W=4 with --ep 2):
BENCHMARKS.md's MoE figures come from it, so it must keep running; the exact counts it reports
are checked, not speed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.benchmarks.cli import refusal
from tests.docs.ranks import run_script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TOY = ["--world-size", "2", "--steps", "1", "--dim", "64", "--moe-hidden", "32", "--layers", "2"]
TOY += ["--vocab", "128", "--batch", "1", "--seq", "8", "--experts", "3"]


def _run(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run_script([str(BENCHMARKS / "moe_vs_fsdp2.py"), *argv], timeout=timeout)


def test_moe_vs_fsdp2_counts_collectives_and_matches_losses():
    run = _run(*TOY)
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


@pytest.mark.slow  # 4 ranks build both systems twice: over a minute on 2 shared cores
def test_moe_vs_fsdp2_with_ep_counts_all_to_alls_and_matches_losses():
    """W=4 as (dp_shard_mod_ep 2 x ep 2), E=4 (2 per EP rank), one MoE block behind the dense
    one: ours (shard_ep_block) against FSDP2 x EP (shard_ep_block_fsdp2), same dispatch."""
    assert TOY[:2] == ["--world-size", "2"] and TOY[-2] == "--experts"
    run = _run("--world-size", "4", *TOY[2:-1], "4", "--ep", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    ours, peer = result["ours"], result["fsdp2"]
    assert result["args"]["ep"] == 2 and result["loss_diff"] < 1e-5, result
    assert abs(ours["loss"] - result["one_process_loss"]) < 1e-5, result  # EP trains as one
    # forward: counts, dispatch, combine; backward: the two row exchanges inverted
    assert ours["calls"]["all_to_all"] == peer["calls"]["all_to_all"] == 5
    assert ours["bytes"]["all_to_all"] == peer["bytes"]["all_to_all"] > 0
    # reduce-scatters: root (ours: its embedding apart), dense block, MoE block, its experts
    assert ours["calls"]["reduce_scatter"] == 5 and peer["calls"]["reduce_scatter"] == 4
    # 2 experts per EP rank over 2 dp_shard_mod_ep ranks: neither side pads
    assert ours["bytes"]["all_gather"] == peer["bytes"]["all_gather"], result
    assert {"all_to_all_bytes", "all_gather_bytes", "static_tensors"} <= set(result["ratio"])


def test_moe_vs_fsdp2_refuses_an_ep_the_experts_or_world_cannot_take():
    for argv, message in (
        ((*TOY, "--ep", "2"), "--ep 2: expert parallelism: ep=2 does not divide n_experts=3"),
        ((*TOY[:-1], "4", "--ep", "4"), "--ep 4: expert parallelism: ep=4 does not divide the 2"),
        ((*TOY, "--tp", "2"), "--tp 2 needs --ep: use benchmarks/tp_vs_fsdp2.py"),
        ((*TOY[:-1], "4", "--ep", "2", "--tp", "2"), "--tp 2 does not divide model.n_heads=1"),
        ((*TOY[:-1], "4", "--ep", "2", "--tp", "2", "--dim", "256"), "--ep 2 x --tp 2 does not"),
    ):
        last = refusal("moe_vs_fsdp2", *argv)
        assert message in last, last


def test_moe_vs_fsdp2_refuses_a_top_k_above_the_experts():
    last = refusal("moe_vs_fsdp2", *TOY, "--top-k", "4")
    assert "top_k=4" in last, last
