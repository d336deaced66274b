"""Muon owner balance: which rank runs Newton–Schulz on which matrix, and what that costs.

Muon orthogonalises every Muon matrix whole on one owner rank (veScale-FSDP Algorithm 2). The
owners here are the optimizer's own: every matrix (every expert of a stacked tensor) of every
FSDP group instance becomes a :class:`~raggedfsdp.sharding.owners.Job` in the order ``Muon``
sees its parameters (the model's order; all groups share one process group, so one
``assign_owners`` call), costed with ``ns_flops`` as ``Muon`` does, and assigned by the same
``assign_owners``. A step takes as long as the most loaded rank; a matrix held whole by its owner
needs no communication, the others travel to the owner in the Newton–Schulz dtype and back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raggedfsdp.sharding.owners import Job, assign_owners, ns_flops
from raggedfsdp.sharding.planner import Layout
from raggedfsdp.sharding.units import is_muon_matrix

__all__ = ["MuonBalance", "muon_balance"]

#: Bytes per element of the pieces exchanged: ``Muon``'s default ``ns_dtype`` is bfloat16.
NS_BYTES = 2


@dataclass(frozen=True)
class MuonBalance:
    """Newton–Schulz FLOPs per rank (as ``Muon.last_step_stats`` counts them) and the bytes each
    rank sends to owners and back per step (as many received)."""

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


@dataclass(frozen=True)
class _Matrix:
    """One Muon matrix of a group's layout: its flat interval in the group's buffer."""

    start: int
    numel: int
    job: Job


def group_matrices(
    layout: Layout, names: Sequence[str], shapes: Sequence[Sequence[int]], steps: int
) -> list[_Matrix]:
    """The Muon matrices of one group in the model's order (``names``, ``shapes``): one per 2-D
    tensor, one per expert of a stacked ``(E, m, n)`` one; where each lies in the layout."""
    seg = layout.segment_size
    bounds = range(0, (layout.world_size + 1) * seg, seg)
    found = []
    for name, shape in zip(names, shapes, strict=True):
        if not is_muon_matrix(name, shape):
            continue
        count, (m, n) = (shape[0], tuple(shape[1:])) if len(shape) == 3 else (1, tuple(shape))
        cost = float(ns_flops(m, n, steps))
        for e in range(count):
            start = layout.offsets[name] + e * m * n
            found.append(_Matrix(start, m * n, Job.spanning(start, start + m * n, bounds, cost)))
    return found


def muon_balance(sequence: Sequence[tuple[Any, bool]], world: int, steps: int) -> MuonBalance:
    """Assign the owners of every Muon matrix of the model over ``world`` shard ranks.

    ``sequence`` holds one ``(GroupPlan, is_root)`` per FSDP group instance in model order;
    instances of one group share its plan (so their matrices sit on the same ranks).
    """
    cache: dict[int, list[_Matrix]] = {}
    items: list[tuple[_Matrix, int]] = []
    for plan, _ in sequence:
        if id(plan) not in cache:
            names, shapes = zip(*plan.group.tensors, strict=True)
            cache[id(plan)] = group_matrices(plan.layout, names, shapes, steps)
        items += [(mat, plan.segment) for mat in cache[id(plan)]]
    jobs = [mat.job for mat, _ in items]
    owners = assign_owners(jobs, world)
    loads = np.zeros(world)
    np.add.at(loads, owners, [job.cost for job in jobs])
    total = float(loads.sum())
    bound = max(total / world, max((job.cost for job in jobs), default=0.0))
    moved = _moved(items, owners, world)
    return MuonBalance(
        matrices=len(jobs),
        max_cost=float(loads.max()),
        mean_cost=total / world,
        bound_cost=bound,
        local_matrices=sum(job.sole_holder == o for job, o in zip(jobs, owners, strict=True)),
        moved_bytes_max=NS_BYTES * float(moved.max()),
        moved_bytes_mean=NS_BYTES * float(moved.mean()),
    )


def _moved(items: Sequence[tuple[_Matrix, int]], owners: Sequence[int], world: int) -> np.ndarray:
    """Elements each rank sends per step, as ``Muon`` counts them (its pieces of matrices owned
    elsewhere and, back, the pieces of the matrices it owns that others hold), O(1) per matrix:
    a matrix covers a partial first segment, whole middle ones (a range update) and a partial
    last one."""
    direct, ramp = np.zeros(world), np.zeros(world + 1)
    for (mat, seg), owner in zip(items, owners, strict=True):
        if mat.job.sole_holder == owner or not mat.numel:
            continue
        a, b = mat.start, mat.start + mat.numel
        first, last = a // seg, (b - 1) // seg
        if first == last:
            direct[first] += mat.numel
        else:
            direct[first] += (first + 1) * seg - a
            direct[last] += b - last * seg
            ramp[first + 1] += seg
            ramp[last] -= seg
        mine = max(0, min(b, (owner + 1) * seg) - max(a, owner * seg))
        direct[owner] += mat.numel - 2 * mine
    return direct + np.cumsum(ramp[:world])
