"""Session-wide gloo worker pools, shared by every multi-process test.

``dist_pool(world_size)`` returns one pool per size, started on first use and closed when the
session ends, so process groups are created a handful of times per run instead of per test.
Requesting the ``world_size`` fixture runs a test at every size in ``WORLD_SIZES`` (override it
with ``@pytest.mark.parametrize("world_size", [...])``); ``pool`` is the pool of that size.
"""

from __future__ import annotations

import gc
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.support.distributed import WorkerPool

WORLD_SIZES = (1, 2, 3, 4)

# One thread in the test process, as in every pool rank (and every rank torchrun starts): MKL's
# multi-threaded GEMM sums a long inner dimension in another order than its one-thread kernel,
# and how many threads it takes can change with the machine's load (MKL_DYNAMIC), so a bitwise
# test in this process (e.g. batched Newton-Schulz against one matrix at a time) failed on a busy
# machine only. Bitwise claims hold for a fixed kernel configuration; this pins it.
torch.set_num_threads(1)

# torch's ~300k objects (and pytest's) out of the collector's sight in this process, as in every
# pool rank (tests/support/distributed.py): the automatic full collections that the in-process
# tests' allocations trigger scan only what tests made (tests/capacity and tests/sharding: -12 %).
gc.freeze()

# tmp_path and tmp_path_factory in memory where the machine has a tmpfs: the recipe tests save
# over a hundred checkpoints, and every save fsyncs each rank's shard, DCP's metadata, the
# marker and two directories, as it must for a checkpoint that survives a power cut. On this
# machine's disk that was 40-80 ms a call, over half of a save; on tmpfs fsync returns at once
# and the same code runs. PYTEST_DEBUG_TEMPROOT (or --basetemp) set by the caller wins.
SHM = Path("/dev/shm")
SHM_FREE_BYTES = 2 * 2**30  # tests/recipes writes ~220 MB a session; pytest keeps the last 3


def _on_tmpfs(path: Path) -> bool:
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    return any(line.split()[1:3] == [str(path), "tmpfs"] for line in mounts)


if (
    "PYTEST_DEBUG_TEMPROOT" not in os.environ
    and _on_tmpfs(SHM)
    and os.access(SHM, os.W_OK)
    and shutil.disk_usage(SHM).free > SHM_FREE_BYTES
):
    os.environ["PYTEST_DEBUG_TEMPROOT"] = str(SHM)


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[Callable[[int], WorkerPool]]:
    pools: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in pools:
            pools[world_size] = WorkerPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(params=WORLD_SIZES, ids=lambda w: f"W{w}")
def world_size(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture
def pool(dist_pool: Callable[[int], WorkerPool], world_size: int) -> WorkerPool:
    return dist_pool(world_size)


# Property tests draw the same examples on every run: CI must not turn red on a lucky draw.
# (Run `pytest --hypothesis-profile=explore` locally to search afresh.) Hypothesis's two clocks
# are off: the 200 ms per-example deadline and the too-slow health check fail a correct test when
# the machine is busy, so on a shared 2-core CI machine they only add flakes.
_NO_CLOCKS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("default", derandomize=True, **_NO_CLOCKS)
settings.register_profile("explore", derandomize=False, max_examples=1000, **_NO_CLOCKS)
settings.load_profile("default")
