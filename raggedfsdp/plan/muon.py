"""Muon owner balance: which rank runs Newton–Schulz on which matrix, and what that costs.

Muon orthogonalizes every hidden matrix whole (veScale-FSDP Algorithm 2): each matrix gets an
owner rank that receives the pieces the other ranks hold, runs Newton–Schulz and sends the
update pieces back. Newton–Schulz costs ``m * n * min(m, n)`` per iteration, so the step takes as
long as the most loaded rank. Owners are assigned longest-processing-time first (LPT: biggest
matrix first, to the least loaded rank; within 4/3 of optimal), except that a matrix goes to the
rank already holding most of it whenever that keeps the busiest rank within
``max(total / W, largest matrix)``, the lower bound of any assignment; a matrix that lies whole in
its owner's segment then needs no communication at all.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raggedfsdp.plan.policies import is_muon
from raggedfsdp.sharding.planner import Layout

__all__ = ["MuonBalance", "muon_balance"]

#: One Muon matrix of one group instance: (cost, start, numel, segment size, holder, holder's
#: elements of it).
_Matrix = tuple[float, int, int, int, int, int]


@dataclass(frozen=True)
class MuonBalance:
    """Newton–Schulz cost per rank (in ``m*n*min(m,n)`` units) and redistribution traffic."""

    matrices: int
    max_cost: float
    mean_cost: float
    bound_cost: float
    local_matrices: int
    moved_bytes_max: float
    moved_bytes_mean: float

    @property
    def max_over_mean(self) -> float:
        return self.max_cost / self.mean_cost if self.mean_cost else 1.0

    @property
    def bound_over_mean(self) -> float:
        return self.bound_cost / self.mean_cost if self.mean_cost else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "matrices": self.matrices,
            "max_cost": self.max_cost,
            "mean_cost": self.mean_cost,
            "max_over_mean": self.max_over_mean,
            "bound_over_mean": self.bound_over_mean,
            "local_matrices": self.local_matrices,
            "moved_bytes_max_rank": self.moved_bytes_max,
            "moved_bytes_mean_rank": self.moved_bytes_mean,
        }


def _matrices(layout: Layout) -> list[_Matrix]:
    """Every Muon matrix of a layout (each slice of a stacked tensor is one) with the rank that
    holds most of it."""
    seg, found = layout.segment_size, []
    for t in layout.tensors:
        if not is_muon(t.name, t.shape) or not t.numel:
            continue
        m, n = t.shape[-2:]
        for k in range(math.prod(t.shape[:-2])):
            start = layout.offsets[t.name] + k * m * n
            first, last = start // seg, (start + m * n - 1) // seg
            head, tail = (first + 1) * seg - start, start + m * n - last * seg
            if first == last:
                holder, own = first, m * n
            elif last - first >= 2:
                holder, own = first + 1, seg
            else:
                holder, own = (first, head) if head >= tail else (last, tail)
            found.append((float(m * n * min(m, n)), start, m * n, seg, holder, own))
    return found


def muon_balance(sequence: Sequence[tuple[Any, bool]], world: int, state_bytes: int) -> MuonBalance:
    """Assign the owners of every Muon matrix of the model over ``world`` shard ranks.

    ``sequence`` holds one ``(GroupPlan, is_root)`` per FSDP group instance; instances of one
    group share its plan, so their matrices sit on the same ranks. Redistribution moves the
    matrices in ``state_bytes`` per element, counted in both directions.
    """
    cache: dict[int, list[_Matrix]] = {}
    items: list[_Matrix] = []
    for plan, _ in sequence:
        if id(plan) not in cache:
            cache[id(plan)] = _matrices(plan.layout)
        items += cache[id(plan)]
    items.sort(key=lambda m: -m[0])
    total = sum(m[0] for m in items)
    bound = max(total / world, items[0][0] if items else 0.0)
    loads = [0.0] * world
    heap = [(0.0, r) for r in range(world)]
    busiest = 0.0
    owners = []
    for cost, *_, holder, _ in items:
        if loads[holder] + cost <= max(bound, busiest):
            rank = holder
        else:
            while heap[0][0] != loads[heap[0][1]]:  # drop entries made stale by holder picks
                heapq.heappop(heap)
            rank = heap[0][1]
        loads[rank] += cost
        heapq.heappush(heap, (loads[rank], rank))
        busiest = max(busiest, loads[rank])
        owners.append(rank)
    moved = _moved(items, owners, world)
    local = sum(o == m[4] and m[5] == m[2] for m, o in zip(items, owners, strict=True))
    return MuonBalance(
        matrices=len(items),
        max_cost=busiest,
        mean_cost=total / world,
        bound_cost=bound,
        local_matrices=local,
        moved_bytes_max=2 * state_bytes * float(moved.max()),
        moved_bytes_mean=2 * state_bytes * float(moved.mean()),
    )


def _moved(items: list[_Matrix], owners: list[int], world: int) -> np.ndarray:
    """Elements each rank sends to owners (and gets back as updates): every holder its piece,
    every owner the part of its matrix it did not hold."""
    direct, ramp = np.zeros(world), np.zeros(world + 1)
    for (_, a, numel, seg, holder, own), owner in zip(items, owners, strict=True):
        if owner == holder and own == numel:
            continue
        b = a + numel
        first, last = a // seg, (b - 1) // seg
        if first == last:
            direct[first] += numel
        else:
            direct[first] += (first + 1) * seg - a
            direct[last] += b - last * seg
            ramp[first + 1] += seg
            ramp[last] -= seg
        mine = max(0, min(b, (owner + 1) * seg) - max(a, owner * seg))
        direct[owner] += numel - 2 * mine
    return direct + np.cumsum(ramp[:world])
