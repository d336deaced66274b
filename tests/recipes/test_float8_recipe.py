"""The recipe's ``--all-gather fp8|mxfp8``: block-wise FP8 weights gathered, fewer bytes
logged."""

from __future__ import annotations

import json
import math

import pytest

from recipes.llama.config import ConfigError, parse_args
from tests.support.recipe_runs import args, run_train

WIDE = ["--model.dim", "128", "--steps", "3", "--eval-every", "0", "--mixed-precision", "bf16"]


def _gathered_mib(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["all_gather_mib"] for line in lines if "all_gather_mib" in line]


def test_fp8_all_gather_trains_and_logs_fewer_bytes(dist_pool, data_dir, tmp_path):
    runs = {}
    for kind in ("param", "fp8", "mxfp8"):
        argv = args(data_dir, tmp_path / kind, *WIDE, "--all-gather", kind)
        runs[kind] = dist_pool(2).run(run_train, argv, timeout=120)[0].losses
    bf16 = _gathered_mib(tmp_path / "param")
    for kind in ("fp8", "mxfp8"):
        assert all(math.isfinite(loss) for loss in runs[kind].values())  # no NaN, no ±inf
        assert abs(runs[kind][3] - runs["param"][3]) < 0.05 * runs["param"][3]
        fp8 = _gathered_mib(tmp_path / kind)
        assert len(fp8) == 3 and all(a < 0.7 * b for a, b in zip(fp8, bf16, strict=True))


def test_fp8_all_gather_needs_raggedfsdp():
    with pytest.raises(ConfigError, match="all_gather=fp8 needs --fsdp raggedfsdp"):
        parse_args(["--all-gather", "fp8", "--fsdp", "fsdp2"]).check()
    with pytest.raises(ConfigError, match="all_gather=mxfp8 needs --fsdp raggedfsdp"):
        parse_args(["--all-gather", "mxfp8", "--fsdp", "fsdp2"]).check()
