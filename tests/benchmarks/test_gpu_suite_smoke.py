"""benchmarks/gpu_suite.py is what runs when a GPU machine is lent, on a budget of minutes: its
CPU self-test must keep passing so that time is never lost to a broken script."""

from __future__ import annotations

import json
from pathlib import Path

from tests.docs.ranks import run_script

SUITE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"


def test_gpu_suite_cpu_self_test_passes(tmp_path):
    out = tmp_path / "suite.json"
    run = run_script([str(SUITE), "--cpu-smoke", "--json-out", str(out)], timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    assert results["failures"] == [], results
    checks = (
        "comm_collectives",
        "fully_shard_training",
        "fully_shard_controls",
        "fully_shard_meta_init",
    )
    assert all(results[name]["ok"] for name in checks), results
