"""The benchmarks' static resident figure (what the resident set drops by when a system is
deleted) must see tensors freed inside glibc's heap: FSDP2's small per-parameter shards live
there, and an untrimmed reading missed ~1 MiB of them, which made its static resident memory
look 7-9 % below ours under TP and EP x TP with equal tensor bytes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.benchmarks.cli import BENCHMARKS, script
from tests.docs.ranks import run_script

# 1024 tensors of 32 KiB (under MALLOC_ENV's mmap threshold: in the heap), a small one above
# them so that their pages are not the heap's top, which free() would give back by itself
FREE_IN_HEAP = f"""
import gc, sys
sys.path.insert(0, {str(BENCHMARKS)!r})
import torch
from measure import status_kib, trimmed_rss_kib
small = [torch.ones(8192) for _ in range(1024)]
keeper = torch.ones(16)
before = trimmed_rss_kib()
del small
gc.collect()
print((before - status_kib("VmRSS")) / 1024, (before - trimmed_rss_kib()) / 1024)
"""


def test_trimmed_rss_sees_small_tensors_freed_inside_the_heap():
    env = {**os.environ, **script("measure").MALLOC_ENV}  # glibc reads it at start-up
    run = subprocess.run(
        [sys.executable, "-c", FREE_IN_HEAP], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    untrimmed, trimmed = map(float, run.stdout.split())
    assert untrimmed < 8, run.stdout  # the heap keeps the freed pages: why the trim is needed
    assert trimmed > 0.95 * 32, run.stdout


@pytest.mark.slow  # ~60 s: 4 ranks build both systems on 2 cores
def test_tp_memory_phases_static_reports_phases_and_drops():
    toy = ["--world-size", "4", "--tp", "2", "--dim", "64", "--layers", "2", "--heads", "4"]
    toy += ["--kv-heads", "2", "--vocab", "128", "--batch", "1", "--seq", "8"]
    run = run_script([str(BENCHMARKS / "tp_memory_phases.py"), "static", *toy], timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    for system in ("ours", "fsdp2"):
        for phase in ("build + fully_shard", "optimizer created", "step 1", "step 2"):
            assert any(line.startswith(f"{system}: {phase}") for line in lines), run.stdout
    ranks = [line.split() for line in lines if line[:1].isdigit()]
    assert sorted((int(r[0]), r[1]) for r in ranks) == [
        (rank, system) for rank in range(4) for system in ("fsdp2", "ours")
    ], run.stdout
