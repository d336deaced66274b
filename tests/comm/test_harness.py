"""The multi-process harness itself: results, error reports, hangs and recovery."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import GLOO_TIMEOUT, WorkerPool

# A blocked rank here stays blocked for HANG_S (its sleep, or gloo's timeout for the collective
# another rank skipped), so a run that did not cut it short would take that long. The bound that
# tells the two apart is half of it: far above the seconds that killing and reaping take on a
# loaded 2-core machine, where a bound of "the grace period plus a few seconds" flaked.
HANG_S = GLOO_TIMEOUT.total_seconds()
CUT_SHORT_S = HANG_S / 2


def _rank_info(tag: str, *, scale: int) -> tuple[str, int, int, torch.Tensor]:
    rank = dist.get_rank()
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)  # the group is live, not just the processes
    return tag, rank, dist.get_world_size(), t * scale


def _raise_on(bad_rank: int) -> str:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    return "fine"


def _raise_while_others_block(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        raise RuntimeError("failed before the barrier")
    dist.barrier()


def _sleep_on(bad_rank: int, seconds: float) -> int:
    if dist.get_rank() == bad_rank:
        time.sleep(seconds)
    return dist.get_rank()


def _skip_collective(bad_rank: int) -> int:
    if dist.get_rank() != bad_rank:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def _exit_on(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        os._exit(3)


def _assert_recovered(pool: WorkerPool) -> None:
    assert not pool.alive, "a failed run must kill the pool"
    results = pool.run(_rank_info, "again", scale=1)
    assert [rank for _, rank, _, _ in results] == list(range(pool.world_size))


def test_results_come_back_per_rank(pool: WorkerPool) -> None:
    world = pool.world_size
    results = pool.run(_rank_info, "hello", scale=2)
    total = float(sum(range(world)))
    assert [r[:3] for r in results] == [("hello", rank, world) for rank in range(world)]
    for *_, t in results:
        assert torch.equal(t, torch.full((2,), 2 * total))


def test_raising_rank_traceback_is_reported(dist_pool) -> None:
    pool = dist_pool(2)
    with pytest.raises(AssertionError) as info:
        pool.run(_raise_on, 1)
    message = str(info.value)
    assert "--- rank 1 ---" in message
    assert "Traceback" in message
    assert "ValueError: boom from rank 1" in message
    assert "_raise_on" in message  # the frame, not just the exception line
    assert "--- rank 0 ---" not in message
    _assert_recovered(pool)


def test_failure_while_others_block_kills_after_grace(dist_pool) -> None:
    pool = dist_pool(3)
    pool.run(_rank_info, "warm", scale=1)
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        pool.run(_raise_while_others_block, 0, timeout=HANG_S)
    assert time.monotonic() - start < CUT_SHORT_S  # the grace period, not the whole timeout
    message = str(info.value)
    assert "RuntimeError: failed before the barrier" in message
    assert "ranks [1, 2] did not answer" in message
    _assert_recovered(pool)


@pytest.mark.parametrize("hang", [_sleep_on, _skip_collective], ids=["sleep", "skip-collective"])
def test_hang_times_out_and_pool_respawns(dist_pool, hang) -> None:
    pool = dist_pool(2)
    pool.run(_rank_info, "warm", scale=1)
    start = time.monotonic()
    args = (1, HANG_S) if hang is _sleep_on else (1,)
    with pytest.raises(TimeoutError) as info:
        pool.run(hang, *args, timeout=1.0)
    assert time.monotonic() - start < CUT_SHORT_S  # the 1 s timeout, not the hang
    stuck = 1 if hang is _sleep_on else 0
    assert f"ranks [{stuck}] did not answer within 1 s" in str(info.value)
    _assert_recovered(pool)


def test_dead_rank_is_reported(dist_pool) -> None:
    pool = dist_pool(2)
    with pytest.raises(AssertionError, match=r"rank 1 died \(exit code 3\)"):
        pool.run(_exit_on, 1)
    _assert_recovered(pool)


def test_unpicklable_task_fails_in_parent(dist_pool) -> None:
    pool = dist_pool(1)
    with pytest.raises(Exception, match="pickle"):
        pool.run(lambda: None)
    assert pool.run(_rank_info, "still fine", scale=1)[0][:2] == ("still fine", 0)


def test_close_is_clean_and_reusable() -> None:
    pool = WorkerPool(1)
    try:
        assert pool.run(_rank_info, "a", scale=1)[0][1] == 0
        procs = list(pool._procs)
        pool.close()
        assert not pool.alive
        assert [p.exitcode for p in procs] == [0]
        assert pool.run(_rank_info, "b", scale=1)[0][0] == "b"
    finally:
        pool.close()
