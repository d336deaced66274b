"""``benchmarks/moe_plan_table.py`` at toy sizes, in this process: BENCHMARKS.md's MoE capacity
table and its padding-budget table come from it, so both modes must keep running and report
the fields the tables read (the figures themselves are not asserted beyond their bounds)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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
    row = _script().row("gpt-oss-120b", 8)
    for key in ("padding_pct", "fsdp2_padding_pct", "persistent_gib", "all_gather_gib"):
        assert row[key] >= 0, key


def test_budget_rows_count_expert_matrices_and_stay_within_the_budget():
    table = _script()
    shapes = table.load_model("gpt-oss-120b")
    for budget in (0.0, 0.01):
        row = table.budget_row(shapes, 8, budget)
        assert 0 <= row["whole"] <= row["matrices"] == 36 * (128 + 128 + 128 + 128)
        assert 0 <= row["extra_padding_pct"] <= 100 * budget
