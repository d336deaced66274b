"""Session-wide gloo worker pools, shared by every multi-process test.

``dist_pool(world_size)`` returns one pool per size, started on first use and closed when the
session ends, so process groups are created a handful of times per run instead of per test.
Requesting the ``world_size`` fixture runs a test at every size in ``WORLD_SIZES`` (override it
with ``@pytest.mark.parametrize("world_size", [...])``); ``pool`` is the pool of that size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from hypothesis import settings

from tests.support.distributed import WorkerPool

WORLD_SIZES = (1, 2, 3, 4)


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
# (Run `pytest --hypothesis-profile=explore` locally to search afresh.)
settings.register_profile("default", derandomize=True)
settings.register_profile("explore", derandomize=False, max_examples=1000)
settings.load_profile("default")
