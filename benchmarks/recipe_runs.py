"""Run the LLaMA recipe as a user would and read back its per-step metrics.

The loss benchmarks (``optimizer_losses.py``, ``fp8_training.py``) compare whole training runs,
so they start the recipe's own command line in a fresh process (one thread per rank), on one
process or, through ``recipes.llama.launch`` (torchrun), on several ranks over 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["train_recipe"]

REPO = Path(__file__).resolve().parent.parent
LAUNCH = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--local-addr", "127.0.0.1"]
QUIET = ["--wandb-mode", "disabled", "--progress", "false", "--checkpoint-every", "0"]


def train_recipe(args: Sequence[str], run_dir: Path, nproc: int = 1) -> list[dict]:
    """Train with ``args`` (the recipe's flags) into ``run_dir``; its metrics.jsonl records."""
    train = ["-m", "recipes.llama.train", "--run-dir", str(run_dir), "--resume", "never"]
    if nproc > 1:
        head = ["-m", "recipes.llama.launch", "--nnodes", "1", "--nproc-per-node", str(nproc)]
        cmd = [sys.executable, *head, *LAUNCH, *train]
    else:
        cmd = [sys.executable, *train]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*cmd, *QUIET, *args], check=True, env=env, cwd=REPO)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
