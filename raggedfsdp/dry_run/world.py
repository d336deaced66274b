"""One rank of a W-rank job in this process: ``fake_world``.

torch's fake process group (``backend="fake"``) answers every collective at once without
moving data, so one process can run the real runtime as rank ``r`` of ``W``: planning,
buffers, views, optimizer state and the schedule of gathers and frees are the real code, only
the bytes other ranks would send never arrive.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["check_rank", "fake_world"]


def check_rank(rank: int, world_size: int) -> None:
    """Refuse a rank outside ``[0, world_size)`` in one line, before any process-group work."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank} is outside [0, {world_size}): simulate a rank from 0 to {world_size - 1}"
        )


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """The default process group is the fake one, as ``rank`` of ``world_size``, inside."""
    check_rank(rank, world_size)
    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialised: a dry run needs its own fake one; run it "
            "in a fresh process or call torch.distributed.destroy_process_group() first"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
