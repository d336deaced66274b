"""The start-up banner says how the run computes (issue 28): the all-gather format and the
thread count, which ``python -m recipes.llama.train`` picks itself when ``OMP_NUM_THREADS`` is
unset (one thread per idle core, shared among the node's processes), since torch's one thread
per core is 13-19x slower on a loaded machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.llama.config import parse_args
from recipes.llama.parallel import set_threads, thread_count
from recipes.llama.train import all_gather_format

ROOT = Path(__file__).resolve().parents[2]
UNSET = "OMP_NUM_THREADS unset"


def _unset(idle: int, cores: int, load: str, local: str) -> str:
    return f"{UNSET}: {idle} of {cores} cores idle (load {load}) / {local}"


@pytest.mark.parametrize(
    ("environ", "cores", "load", "expected"),
    [
        ({"OMP_NUM_THREADS": "4"}, 2, 9.0, (None, "OMP_NUM_THREADS=4")),
        ({"MKL_NUM_THREADS": "3"}, 8, 0.0, (None, "MKL_NUM_THREADS=3")),
        ({}, 8, 0.3, (8, _unset(8, 8, "0.3", "1 local process"))),
        ({}, 2, 9.4, (1, _unset(1, 2, "9.4", "1 local process"))),
        ({"OMP_NUM_THREADS": ""}, 4, 1.2, (3, _unset(3, 4, "1.2", "1 local process"))),
        ({"LOCAL_WORLD_SIZE": "4"}, 16, 0.0, (4, _unset(16, 16, "0.0", "4 local processes"))),
        ({"LOCAL_WORLD_SIZE": "4"}, 2, 0.0, (1, _unset(2, 2, "0.0", "4 local processes"))),
    ],
    ids=["omp-set", "mkl-set", "idle", "loaded", "omp-empty", "four-ranks", "few-cores"],
)
def test_thread_count_honours_the_user_then_takes_the_idle_cores(environ, cores, load, expected):
    assert thread_count(environ, cores, load) == expected


def test_set_threads_leaves_an_explicit_count_alone():
    before = torch.get_num_threads()
    assert set_threads({"OMP_NUM_THREADS": "7"}) == f"threads: {before} (OMP_NUM_THREADS=7)"
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ([], "fp32"),
        (["--mixed-precision", "bf16"], "bf16"),
        (["--all-gather", "fp8"], "fp8"),
        (["--all-gather", "mxfp8", "--mixed-precision", "bf16"], "mxfp8"),
    ],
)
def test_all_gather_format(extra, expected):
    assert all_gather_format(parse_args(extra)) == expected


@pytest.mark.slow  # ~10 s: one process starts torch; the rule itself is tested above
def test_one_process_picks_its_threads_and_says_so(data_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    run = [sys.executable, "-m", "recipes.llama.train", "--config", "debug", "--steps", "1"]
    run += ["--data-dir", data_dir, "--run-dir", str(tmp_path / "run"), "--eval-every", "0"]
    run += ["--checkpoint-every", "0"]  # the banner is all this run is for
    out = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    banner = out.stdout.splitlines()[0]
    assert ", all-gather fp32, " in banner, banner
    pattern = rf"threads: \d+ \({UNSET}: \d+ of \d+ cores idle \(load [\d.]+\) / 1 local process\)"
    assert re.search(pattern, banner), banner
