"""benchmarks/tokenize_throughput.py at a toy size: it must keep running and tokenize the same
documents as the library (the speeds themselves are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.docs.ranks import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tokenize_throughput.py"
TOY = ["--mb", "0.3", "--vocab", "1000", "--train-mb", "0.3", "--workers", "2", "--repeats", "1"]


def test_tokenize_throughput_reports_ours_beside_the_library():
    run = run_script([str(SCRIPT), *TOY], timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["tokens_match"] and result["vocab_size"] == 1000 and result["workers"] == 2
    assert result["mb"] >= 0.3 and result["documents"] > 100
    for key in ("ours_mb_s", "encode_batch_mb_s", "encode_batch_fast_mb_s", "ratio"):
        assert result[key] > 0, key
