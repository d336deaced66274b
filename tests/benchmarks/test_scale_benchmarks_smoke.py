"""The planner and rank-query scale benchmarks at toy sizes, in this process: BENCHMARKS.md's
planning-time and 100,000-rank figures come from them, so every case must keep running (the
figures themselves are not asserted)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", list(_script("rank_queries").CASES))
def test_every_rank_query_case_runs(case):
    rank_queries = _script("rank_queries")
    seconds = rank_queries.run_case(case, 96)
    assert math.isfinite(seconds) and 0 < seconds < 30, seconds  # a measured time, not a stub


def test_rank_queries_time_one_rank_of_a_real_layout():
    """The cases' parameters are the timed rank's pieces of a layout of every rank: each
    tensor's pieces cover it exactly, and the rank holds its share (about 160 elements)."""
    world = 96
    params = _script("rank_queries")._params(world)
    assert len(params) == 9
    for _, p in params:
        spec = p.ragged_shard
        assert p.rank == world // 3 and p.local.numel() == spec.length(p.rank)
        assert sum(spec.lengths) == p.numel() and len(spec.lengths) == world
    held = sum(p.local.numel() for _, p in params)
    assert 0 < held <= 2 * sum(p.numel() for _, p in params) // world, held


def test_planner_scale_plans_the_1166_tensor_group():
    planner_scale = _script("planner_scale")
    kimi = planner_scale.kimi_k2()
    assert max(len(g.tensors) for g in kimi.groups) == 1166
    row = planner_scale.measure("kimi-k2", kimi, 64, 128, repeat=2)
    assert row["tensors"] == sum(g.repeat * len(g.tensors) for g in kimi.groups) == 69_975
    assert row["max_group_plan_ms"] > 0
