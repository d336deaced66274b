"""The torch-free geometry of an even tensor-parallel split, for the runtime and the planner.

Under tensor parallelism each TP rank holds one block of a parameter: the whole tensor
(``Replicate()``) or ``1/T`` of it along one dim (``Shard(dim)``); with several split mesh
dims (EP x TP experts: ``Shard(0)`` over ``ep``, ``Shard(1)`` over ``tp``) one block along
each, given as ``(dim, degree)`` pairs (``splits``). ``fully_shard`` plans that
TP-local tensor over the data-parallel ranks, so the capacity planner must derive the same
local shape, refuse the same uneven splits, and note the same optimizer blocks the split cuts.
These rules live here, without torch, so both import them; ``tp_shard.py`` (torch) holds the
DTensor side. A dim is ``None`` for a replicated tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["tp_block_note", "tp_local_shape", "tp_run", "tp_split_note", "tp_splits_local_shape"]


def tp_local_shape(shape: Sequence[int], dim: int | None, degree: int) -> tuple[int, ...]:
    """The shape of one TP rank's block: ``shape`` with ``dim`` divided by ``degree``.

    Raises ``ValueError`` when ``dim`` does not divide evenly: blocks are even, as
    ``parallelize_module``'s ``Shard(dim)`` needs for equal DTensor pieces."""
    local = list(shape)
    if dim is None:
        return tuple(local)
    if local[dim] % degree:
        raise ValueError(
            f"dim {dim} of size {local[dim]} does not divide by the TP degree {degree}; "
            "choose a TP degree that divides it (or pad the dim)"
        )
    local[dim] //= degree
    return tuple(local)


def tp_splits_local_shape(
    shape: Sequence[int], splits: Sequence[tuple[int, int]]
) -> tuple[int, ...]:
    """The shape of one block of a tensor split along several dims: ``shape`` with each
    ``(dim, degree)`` of ``splits`` applied (``tp_local_shape``'s rule; a dim split twice is
    refused, since its blocks would be strided, not one block per rank)."""
    dims = [dim for dim, _ in splits]
    if len(set(dims)) != len(dims):
        raise ValueError(
            f"dims {dims} split the same tensor dim on two mesh dims; split each tensor dim "
            "on one mesh dim only (Shard(0) over ep, Shard(1) over tp)"
        )
    local = tuple(shape)
    for dim, degree in splits:
        local = tp_local_shape(local, dim, degree)
    return local


def tp_run(local_shape: Sequence[int], dim: int | None) -> int:
    """Elements of the contiguous runs of the global tensor's flat order that a TP block holds:
    the whole block when replicated or split on dim 0, rows of ``prod(local_shape[dim:])``
    for ``Shard(dim)``. A block the policy asks for in global coordinates stays whole only if
    it divides these runs."""
    return math.prod(local_shape[dim or 0 :])


def tp_block_note(
    name: str,
    dim: int,
    degree: int,
    global_shape: Sequence[int],
    global_unit: int,
    local_unit: int,
) -> str | None:
    """Why an optimizer blocked in global coordinates would see other blocks, or ``None``.

    Units are planned on the TP-local tensor (``local_unit``), so they never cross a TP block;
    but the shard policy asked for ``global_unit``-element blocks of the global tensor, which
    stay whole on a TP rank only if the unit is the same on both shapes and divides the runs
    the block holds (``tp_run``)."""
    return tp_split_note(name, ((dim, degree),), global_shape, global_unit, local_unit)


def tp_split_note(
    name: str,
    splits: Sequence[tuple[int, int]],
    global_shape: Sequence[int],
    global_unit: int,
    local_unit: int,
) -> str | None:
    """``tp_block_note`` for a tensor split along several dims (``(dim, degree)`` pairs): the
    runs a block holds are set by its innermost split dim, the outer splits only choosing
    which runs (each run starts on a multiple of its own length)."""
    local_shape = tp_splits_local_shape(global_shape, splits)
    dim = max(d for d, _ in splits)
    run = tp_run(local_shape, dim)
    if global_unit <= 1 or (global_unit == local_unit and run % global_unit == 0):
        return None
    split = " x ".join(f"Shard(dim={d}) over {n}" for d, n in splits)
    return (
        f"{name!r}: the TP split {split} ranks cuts the shard policy's "
        f"{global_unit}-element blocks of the global {tuple(global_shape)} tensor (each TP rank "
        f"holds runs of {run}); units follow the TP-local {local_shape} tensor ({local_unit} "
        "elements), so an optimizer blocked in global coordinates would see other blocks than "
        "on one process"
    )
