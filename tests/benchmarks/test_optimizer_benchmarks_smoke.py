"""The Muon and Shampoo step benchmarks at toy sizes: BENCHMARKS.md's optimizer figures come
from them, so they must keep running and keep reporting what the tables read (the figures
themselves are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.docs.ranks import run_script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _json_lines(script: str, *args: str) -> list[dict]:
    run = run_script([str(BENCHMARKS / script), *args], timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_muon_step_reports_batched_and_per_matrix_and_the_worlds():
    tiny = ["--rounds", "1", "--dim", "32", "--layers", "1", "--worlds", "2"]
    moe = ["--moe-dim", "32", "--moe-layers", "1", "--experts", "2", "--expert-hidden", "16"]
    rows = _json_lines("muon_step.py", "--part", "all", *tiny, *moe)
    moe_row = next(r["moe"] for r in rows if "moe" in r)
    assert moe_row["ns_calls"]["batched"] < moe_row["ns_calls"]["per-matrix"]  # experts stacked
    assert set(moe_row["median_cpu_s"]) >= {"batched", "per-matrix", "torch"}
    world = next(r["worlds"]["2"] for r in rows if "worlds" in r)
    assert world["bytes_received_rank0"]["ours"] == 0  # tiny matrices: each whole on its owner


def test_shampoo_step_reports_batched_per_block_and_the_eigh_share():
    # one of the 4 layers, in 64x64 blocks (192; 768 at B = 32): the per-block step is
    # Python-bound at these sizes, so fewer blocks is the quicker run of the same code
    args = ["--blocks", "64", "--frequencies", "2", "--repeats", "1", "--worlds", "2"]
    args += ["--layers", "1"]
    (row,) = _json_lines("shampoo_step.py", *args, "--steps", "2")
    case = row["side_by_side"]["freq2_B64"]
    assert set(case["over_per_block"]) == {"batched", "batch_blocks"}
    assert 0 < case["eigh_share"]["per_block"] < 1
    assert row["worlds"]["2"]["64"]["bytes"] == 0  # blocks whole on ranks: nothing moves
