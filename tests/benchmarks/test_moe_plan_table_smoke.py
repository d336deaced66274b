"""``benchmarks/moe_plan_table.py`` at toy sizes, in this process: BENCHMARKS.md's MoE capacity
table and its padding-budget table come from it, so both modes must keep running and report
the fields the tables read, with values that follow from the model's size."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script():
    spec = importlib.util.spec_from_file_location(
        "_bench_moe_plan_table", BENCHMARKS / "moe_plan_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_capacity_row_has_the_table_fields():
    """The fields hold what the table says: persistent bytes are 16 per parameter (fp32 weight,
    gradient, two AdamW moments) over W with the padding, and the all-gather sends between one
    and two (forward, backward re-gather; the root gathers once) bf16 copies of the model."""
    table, world = _script(), 8
    row = table.row("gpt-oss-120b", world)
    params = row["params"]
    assert 110e9 < params < 125e9, params  # gpt-oss-120b: 116.8B parameters
    assert 0 <= row["padding_pct"] <= row["fsdp2_padding_pct"] < 1, row
    padded = params * (1 + row["padding_pct"] / 100)
    assert row["persistent_gib"] == pytest.approx(padded * 16 / world / table.GIB, rel=1e-6)
    one_gather = padded * 2 * (world - 1) / world / table.GIB
    assert one_gather < row["all_gather_gib"] <= 2 * one_gather, row


def test_budget_rows_count_expert_matrices_and_stay_within_the_budget():
    table = _script()
    shapes = table.load_model("gpt-oss-120b")
    for budget in (0.0, 0.01):
        row = table.budget_row(shapes, 8, budget)
        assert 0 <= row["whole"] <= row["matrices"] == 36 * (128 + 128 + 128 + 128)
        assert 0 <= row["extra_padding_pct"] <= 100 * budget
