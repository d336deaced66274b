"""Muon owner balance: which rank runs Newton–Schulz on which matrix, and what that costs.

Muon orthogonalises every Muon matrix whole on one owner rank (veScale-FSDP Algorithm 2). The
owners here are the optimizer's own: every matrix (every expert of a stacked tensor) of every
FSDP group instance becomes a :class:`~raggedfsdp.sharding.owners.Job` in the order ``Muon``
sees its parameters (the model's order; all groups share one process group, so one
``assign_owners`` call), costed with ``ns_flops`` as ``Muon`` does, and assigned by the same
``assign_owners``. A step takes as long as the most loaded rank; a matrix held whole by its owner
needs no communication, the others travel to the owner in the Newton–Schulz dtype and back.

With a tp dim of degree ``T`` the owners are chosen over the ``S x T`` dp_shard x tp ranks
(issue 29: one exchange over dp x tp gathers each whole matrix): a matrix split by TP is one
job costed as the global matrix, its pieces on every TP rank's share of the dp ranks (rank
``dp * T + tp``, torchtitan's order); a matrix TP leaves replicated is updated on each TP rank,
so its owner is chosen over the dp ranks of each TP coordinate, as ``Muon`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raggedfsdp.capacity.tp_plan import global_shape, tp_dim
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


def muon_balance(
    sequence: Sequence[tuple[Any, bool]], world: int, steps: int, tp: int = 1
) -> MuonBalance:
    """Assign the owners of every Muon matrix of the model over ``world`` shard ranks (times
    ``tp`` tensor-parallel ones, see the module docstring).

    ``sequence`` holds one ``(GroupPlan, is_root)`` per FSDP group instance in model order;
    instances of one group share its plan (so their matrices sit on the same ranks).
    """
    if tp > 1:
        return _tp_balance(sequence, world, steps, tp)
    cache: dict[int, list[_Matrix]] = {}
    items: list[tuple[_Matrix, int]] = []
    for plan, _ in sequence:
        if id(plan) not in cache:
            names, shapes = zip(*plan.group.tensors, strict=True)
            cache[id(plan)] = group_matrices(plan.layout, names, shapes, steps)
        items += [(mat, plan.segment) for mat in cache[id(plan)]]
    jobs = [mat.job for mat, _ in items]
    owners = assign_owners(jobs, world)
    return _balance(jobs, owners, world, _moved(items, owners, world))


def _balance(
    jobs: Sequence[Job],
    owners: Sequence[int],
    world: int,
    moved: np.ndarray,
    copies: Sequence[int] | None = None,
) -> MuonBalance:
    """The summary of ``jobs`` assigned to ``owners`` over ``world`` ranks, ``moved``
    elements sent per rank. ``copies[i]``: how many jobs job ``i``'s matrix is (a matrix TP
    replicates is updated on every TP rank), so that matrices are counted once."""
    share = np.ones(len(jobs)) if copies is None else 1 / np.asarray(copies, dtype=float)
    local = np.array([job.sole_holder == o for job, o in zip(jobs, owners, strict=True)], bool)
    loads = np.zeros(world)
    np.add.at(loads, owners, [job.cost for job in jobs])
    total = float(loads.sum())
    bound = max(total / world, max((job.cost for job in jobs), default=0.0))
    return MuonBalance(
        matrices=round(float(share.sum())),
        max_cost=float(loads.max()),
        mean_cost=total / world,
        bound_cost=bound,
        local_matrices=round(float(share[local].sum())),
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


def _tp_balance(
    sequence: Sequence[tuple[Any, bool]], shard: int, steps: int, tp: int
) -> MuonBalance:
    """``muon_balance`` with a tp dim, as ``Muon`` plans it: TP-split matrices get owners over
    the ``shard * tp`` dp_shard x tp ranks (one exchange over that product group); matrices TP
    replicates get owners over the ``shard`` dp ranks of each TP coordinate (every TP rank's
    dp group updates its copy, the same way)."""
    cache: dict[int, tuple[list[Job], list[Job]]] = {}
    split: list[Job] = []
    replicated: list[Job] = []
    for plan, _ in sequence:
        if id(plan) not in cache:
            cache[id(plan)] = _tp_jobs(plan, steps, tp)
        split += cache[id(plan)][0]
        replicated += cache[id(plan)][1]
    world = shard * tp
    replicated_owners = assign_owners(replicated, shard)
    jobs = split + [
        Job(tuple((r * tp + t, n) for r, n in job.pieces), job.cost)
        for t in range(tp)
        for job in replicated
    ]
    owners = assign_owners(split, world)
    owners += [o * tp + t for t in range(tp) for o in replicated_owners]
    copies = [1] * len(split) + [tp] * (len(replicated) * tp)
    return _balance(jobs, owners, world, _moved_pieces(jobs, owners, world), copies)


def _tp_jobs(plan: Any, steps: int, tp: int) -> tuple[list[Job], list[Job]]:
    """The jobs of one group planned on TP-local shapes: TP-split matrices' (pieces on every
    TP rank ``dp * tp + t``, the global matrix's cost) and replicated ones' (pieces on the dp
    ranks of one TP coordinate)."""
    split, replicated = [], []
    for name, shape in plan.group.tensors:
        tp_split = tp_dim(name, len(shape)) is not None
        for mat in group_matrices(plan.layout, [name], [shape], steps):
            if tp_split:  # a matrix (one expert's of a stack): Newton–Schulz on the global one
                cost = float(ns_flops(*global_shape(name, shape, tp)[-2:], steps))
                pieces = tuple((r * tp + t, n) for t in range(tp) for r, n in mat.job.pieces)
                split.append(Job(pieces, cost))
            else:
                replicated.append(mat.job)
    return split, replicated


def _moved_pieces(jobs: Sequence[Job], owners: Sequence[int], world: int) -> np.ndarray:
    """Elements each rank sends per step, from the jobs' pieces: its pieces of matrices owned
    elsewhere and, back, the pieces others hold of the matrices it owns."""
    moved = np.zeros(world)
    for job, owner in zip(jobs, owners, strict=True):
        if job.sole_holder == owner:
            continue
        for rank, n in job.pieces:
            if rank != owner:
                moved[rank] += n
        moved[owner] += job.numel - job.held_by(owner)
    return moved
