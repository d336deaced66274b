"""One rank of a W-rank job in this process: ``fake_world``.

torch's fake process group (``backend="fake"``) answers every collective at once without
moving data, so one process can run the real runtime as rank ``r`` of ``W``: planning,
buffers, views, optimizer state and the schedule of gathers and frees are the real code, only
the bytes other ranks would send never arrive.

Two things a fake group cannot do by itself, ``fake_world`` does for it: it answers
``all_gather_object`` of rank lists (``comm.mesh.product_group``, which Muon's, Shampoo's and
SOAP's owners over dp × tp use, learns each member's ranks along another mesh dim that way),
and it forgets DTensor's cached sharding results on entry and exit (they are keyed by meshes,
which compare by rank layout, so a later fake world's mesh of the same layout would get a
spec back on an earlier mesh whose process groups are gone).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

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
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with mock.patch.object(dist, "all_gather_object", _gather_rank_lists):
            yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()


def _gather_rank_lists(rows: list, obj: object, group: Any = None) -> None:
    """``all_gather_object`` of a list of ranks on the fake group: what each member would
    send. Along one dim of a device mesh the other dims' groups are translates of each other,
    so a member's ranks are this rank's shifted by the member's offset (``product_group``'s
    precondition: its two groups are two dims of one mesh). Anything else is refused."""
    if not (isinstance(obj, list) and all(isinstance(r, int) for r in obj)):
        raise TypeError(
            f"a dry run answers all_gather_object of rank lists only, not {type(obj).__name__}"
        )
    me = dist.get_rank()
    for member in dist.get_process_group_ranks(group):
        rows[dist.get_group_rank(group, member)] = [r + member - me for r in obj]
