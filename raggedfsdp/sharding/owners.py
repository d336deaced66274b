"""Owners: which rank works on each whole matrix that ragged shards spread over several ranks.

Muon's Newton–Schulz (and Shampoo's blocks when a forced layout cuts them) need whole matrices,
but a rank holds only its consecutive piece of the flat parameters. Instead of every rank gathering
every matrix and repeating all the work, each matrix becomes a :class:`Job` with one *owner*:

* a matrix that lies entirely on one rank is owned there and needs no communication;
* the others are assigned by longest-processing-time (LPT) balancing on their cost, preferring
  the rank that already holds most of the matrix when that costs little balance.

This is plain Python, identical on every rank (it depends only on shapes and shards), so no
communication decides who does what, and the capacity planner calls the same function the
optimizer does. It runs in O(jobs · log W), so the planner can ask it at 100,000 ranks.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

__all__ = ["Job", "assign_owners", "ns_flops"]


@dataclass(frozen=True)
class Job:
    """One matrix to work on whole: ``numel`` elements that are, in the global flat order of the
    matrix, split into per-rank ``pieces`` ``(rank, length)`` in rank order (empty ones left
    out), plus its cost (e.g. Newton–Schulz FLOPs)."""

    pieces: tuple[tuple[int, int], ...]
    cost: float

    @classmethod
    def spanning(cls, start: int, stop: int, bounds: Sequence[int], cost: float) -> Job:
        """The job of the flat interval ``[start, stop)`` when rank ``r`` holds
        ``[bounds[r], bounds[r + 1])`` (``bounds`` non-decreasing, ``W + 1`` entries; a
        ``range`` works for equal segments). Found by bisection: the cost is the ranks the
        interval touches, not the world size."""
        pieces = []
        r = bisect_right(bounds, start) - 1
        last = len(bounds) - 2
        while r <= last and bounds[r] < stop:
            n = min(stop, bounds[r + 1]) - max(start, bounds[r])
            if n > 0:
                pieces.append((r, n))
            r += 1
        return cls(tuple(pieces), cost)

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.pieces)

    @property
    def sole_holder(self) -> int | None:
        return self.pieces[0][0] if len(self.pieces) == 1 else None

    def held_by(self, rank: int) -> int:
        return sum(n for r, n in self.pieces if r == rank)

    @cached_property
    def main_holder(self) -> int:
        """The rank holding most of the job (the lowest such rank; rank 0 for an empty job)."""
        if not self.pieces:
            return 0
        return max(self.pieces, key=lambda piece: (piece[1], -piece[0]))[0]


def assign_owners(jobs: Sequence[Job], world: int, holder_slack: float = 0.1) -> list[int]:
    """One owner per job, balancing total cost over ranks.

    Jobs held whole by one rank stay there. The rest go, largest first, to the rank whose load
    would be lowest; if the rank holding most of the job would end within ``holder_slack`` of that
    (relative), it wins instead, saving the transfer of its piece. Ties go to the lower rank, so
    the result is deterministic.
    """
    owners = [-1] * len(jobs)
    load = [0.0] * world
    for i, job in enumerate(jobs):
        if job.sole_holder is not None:
            owners[i] = job.sole_holder
            load[job.sole_holder] += job.cost
    heap = [(cost, r) for r, cost in enumerate(load)]  # least loaded first; stale entries skipped
    heapq.heapify(heap)
    rest = sorted((i for i in range(len(jobs)) if owners[i] < 0), key=lambda i: -jobs[i].cost)
    for i in rest:
        job = jobs[i]
        while heap[0][0] != load[heap[0][1]]:
            heapq.heappop(heap)
        best = heap[0][1]
        holder = job.main_holder
        if load[holder] + job.cost <= (load[best] + job.cost) * (1 + holder_slack):
            best = holder
        owners[i] = best
        load[best] += job.cost
        heapq.heappush(heap, (load[best], best))
    return owners


def ns_flops(m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of ``steps`` Newton–Schulz iterations on an m×n matrix: with s = min,
    l = max, each iteration is X·Xᵀ (2s²l), A·A (2s³) and B·X (2s²l). Muon and the capacity
    planner balance owners on it."""
    s, big = min(m, n), max(m, n)
    return steps * (4 * s * s * big + 2 * s**3)
