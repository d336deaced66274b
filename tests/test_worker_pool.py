"""The session-wide gloo pool ends every group a task made: a group left alive keeps its threads
and a TCP event loop that wakes every few milliseconds, and hundreds of them slowed every later
test of the session. The collection that ends them scans only what tasks made: each rank
froze torch's objects out of the collector's sight when it started."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.support.distributed import WorkerPool


def _redistribute_on_a_new_mesh() -> list[float]:
    """What a TP step does: a DTensor resharded on the tp dimension of a dp 1 x tp 2 mesh made
    for this task (DTensor caches the plan, keyed by the mesh, which holds its dp group)."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))["tp"]
    full = torch.arange(8.0).reshape(4, 2)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    return sharded.redistribute(mesh, [Replicate()]).to_local().sum(0).tolist()


def _gloo_event_loops() -> int:
    """Live gloo event-loop threads in this rank (one per live group)."""
    tasks = os.listdir("/proc/self/task")
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop" for t in tasks)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_tasks_groups_end_with_it(dist_pool) -> None:
    pool: WorkerPool = dist_pool(2)
    before = pool.run(_gloo_event_loops)
    for _ in range(3):
        assert pool.run(_redistribute_on_a_new_mesh) == [[12.0, 16.0]] * 2
    assert pool.run(_gloo_event_loops) == before


def test_the_collection_after_a_task_skips_what_the_rank_started_with(dist_pool) -> None:
    # torch and the library are frozen (~300k objects): a full collection per task scanned them
    # all, 150 ms of CPU per rank per task. (What tasks leave alive grows over a session, so
    # only the frozen count is a fixed figure.)
    assert all(frozen > 100_000 for frozen in dist_pool(2).run(gc.get_freeze_count))
