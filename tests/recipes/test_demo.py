"""The sharding-core tour (`python examples/demo.py`) runs and all its checks pass."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_at_three_ranks_with_block_units():
    out = subprocess.run(
        [sys.executable, "examples/demo.py", "--world-size", "3", "--rows", "32"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("[ok]") == 4 and "FAILED" not in out.stdout, out.stdout
    assert "units per rank" in out.stdout
