"""benchmarks/scale_sim.py at a toy size, in this process: BENCHMARKS.md's "Scale, simulated"
figures come from it, so every case must parse and the dry-run path must keep running (the
figures themselves are not asserted beyond being measured)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from recipes.llama.config import parse_args

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script():
    spec = importlib.util.spec_from_file_location("_bench_scale_sim", BENCHMARKS / "scale_sim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", list(_script().CASES))
def test_every_case_is_a_valid_recipe_command_line(name: str) -> None:
    case = _script().CASES[name]
    for runtime in case.runtimes:
        argv = case.fsdp2_argv if runtime == "fsdp2" and case.fsdp2_argv else case.argv
        assert parse_args([*argv, "--fsdp", runtime]).fsdp == runtime


def test_a_toy_case_runs_both_runtimes_and_plots(tmp_path: Path) -> None:
    bench = _script()
    case = bench.Case(("--config", "debug", "--micro-batch-size", "2"), 16)
    rows = bench.run_case("gpt_oss_120b@16", case)
    assert [r["runtime"] for r in rows] == ["raggedfsdp", "fsdp2"]
    for row in rows:
        assert row["world_size"] == 16 and row["params"] > 0 and row["all_gather"] > 0
        assert row["peak"] >= row["static"] > 0
    (tmp_path / "scale_sim.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench.plot(rows, tmp_path / "scale_sim.png")
    assert (tmp_path / "scale_sim.png").stat().st_size > 0
