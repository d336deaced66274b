"""FSDP2's ``shard_placement_fn`` translated into units.

FSDP2 says *where* to cut a parameter: ``Shard(d)`` gives each rank an even block of dim ``d``.
raggedfsdp says *what must not be cut*: a unit of elements (``raggedfsdp.sharding.units``), and
each rank holds a contiguous run of units. This module is the one place that maps the first
onto the second, so FSDP2 code that passes ``shard_placement_fn`` runs unchanged, and it says in
the group's ``notes`` where the two differ instead of changing the placement silently:

* ``Shard(0)`` (or ``None``, FSDP2's default): each dim-0 slice stays whole on one rank (unit
  ``prod(shape[1:])``), as FSDP2's dim-0 blocks keep them, though the runs are ragged.
* ``Shard(d)``, ``d > 0``: FSDP2 gives each rank a block of dim ``d`` of *every* leading index,
  which is strided in the flat storage; a contiguous run cannot be that. Each index of dim ``d``
  stays whole instead (unit ``prod(shape[d + 1:])``), and the group's notes say so.
* A ``ShardPlacementResult`` on fully_shard's own mesh is its placement; on another mesh
  (expert parallelism) it is refused for now, naming the fix. Anything that is not a ``Shard``
  (``Replicate()``) is refused, as FSDP2 refuses it.

The placement's units are combined (``combine``, an LCM) with the call's ``shard_policy``, so an
optimizer's blocks stay whole too. The function is called once per parameter, before anything
is sharded: a refusal leaves the module as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
from torch.distributed.tensor import Shard

from raggedfsdp.sharding import DEFAULT_POLICY, GroupShardPolicy, ShardPolicy, combine
from raggedfsdp.sharding.units import (
    StrictPolicy,
    TensorEntry,
    grouped_notes,
    resolve_units,
    strict,
)

if TYPE_CHECKING:
    from raggedfsdp.comm import ShardMesh
    from raggedfsdp.fsdp.managed_param import ManagedParam

__all__ = ["PlacementPolicy", "dim_unit", "placement_notes", "placement_policy"]

_WHERE = "fully_shard(shard_placement_fn=...)"


def dim_unit(shape: Sequence[int], dim: int) -> int:
    """Elements of one index of ``dim``: the unit that keeps each index of that dim whole in
    row-major storage (a dim-0 slice for ``dim == 0``, one element for the last dim)."""
    return max(1, math.prod(tuple(shape)[dim + 1 :]))


class PlacementPolicy(GroupShardPolicy):
    """Units keeping each parameter's placement dim whole (``dims``: fqn -> ``d`` of its
    ``Shard(d)``), combined with ``base`` (the call's ``shard_policy``) by LCM. A group policy,
    so that it stays findable (``placement_notes``) inside a further ``combine``."""

    def __init__(self, dims: Mapping[str, int], base: ShardPolicy) -> None:
        self.dims = dict(dims)
        self.base = base
        self._combined = combine(self._dim_units, base)

    def _dim_units(self, fqn: str, param: Any) -> int:
        dim = self.dims.get(fqn)
        return 1 if dim is None else dim_unit(tuple(param.shape), dim)

    def __call__(self, fqn: str, param: Any) -> int:
        return self._combined(fqn, param)

    def units_for_group(self, tensors: Sequence[TensorEntry], world_size: int) -> dict[str, int]:
        return resolve_units(self._combined, tensors, world_size)


def placement_policy(
    fn: Callable[[Any], Any] | None,
    params: Sequence[ManagedParam],
    shard_policy: ShardPolicy | None,
    mesh: ShardMesh,
) -> ShardPolicy | None:
    """``shard_policy`` unchanged without ``fn``; else a ``PlacementPolicy`` from ``fn``'s answer
    for every parameter (checked here: one-line errors naming the parameter and the fix)."""
    if fn is None:
        return shard_policy
    if not callable(fn):
        raise TypeError(
            f"fully_shard(shard_placement_fn={fn!r}): expected FSDP2's callable nn.Parameter -> "
            "Shard(d) | ShardPlacementResult | None, e.g. lambda p: Shard(1) if p.ndim == 2 "
            "else None"
        )
    dims = {mp.fqn: _dim_of(fn, mp.fqn, mp.original, mesh) for mp in params}
    placed = PlacementPolicy(dims, shard_policy or DEFAULT_POLICY)
    return strict(placed) if isinstance(shard_policy, StrictPolicy) else placed


def _dim_of(fn: Callable[[Any], Any], fqn: str, param: Any, mesh: ShardMesh) -> int:
    """The dim ``fn`` shards ``param`` on (negative dims counted from the end, as FSDP2)."""
    shape = tuple(param.shape)
    what = f"parameter {fqn!r} of shape {shape}"
    try:
        result = fn(param)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise RuntimeError(
            f"{_WHERE} raised {type(error).__name__}({first!r}) for {what}; it is called once "
            "per parameter, with the unsharded nn.Parameter: make it return Shard(d) or None "
            "for every parameter of the module"
        ) from error
    if isinstance(result, ShardPlacementResult):
        _check_same_mesh(result, what, mesh)
        result = result.placement
    if result is None:
        result = Shard(0)
    if not isinstance(result, Shard):
        raise ValueError(
            f"{_WHERE} returned {result!r} for {what}: expected Shard(d), None (Shard(0)) or a "
            "ShardPlacementResult, as FSDP2 (which refuses it too); fully_shard shards every "
            "parameter it is given, so return Shard(d) or None for it"
        )
    ndim = max(1, len(shape))  # a 0-d tensor is one dim-0 slice
    dim = result.dim + ndim if result.dim < 0 else result.dim
    if not 0 <= dim < ndim:
        raise ValueError(
            f"{_WHERE} returned {result!r} for {what}: dim {result.dim} is out of range for a "
            f"{len(shape)}-D tensor; return Shard(d) with {-ndim} <= d < {ndim}"
        )
    return dim


def _check_same_mesh(result: ShardPlacementResult, what: str, mesh: ShardMesh) -> None:
    """A ``ShardPlacementResult`` is accepted on fully_shard's own process groups only."""
    info = result.mesh_info
    shard_group = getattr(info, "shard_process_group", None)
    if info is None or (
        shard_group is not None
        and shard_group is mesh.shard_group
        and getattr(info, "replicate_process_group", None) is mesh.replicate_group
    ):
        return
    raise NotImplementedError(
        f"{_WHERE} returned a ShardPlacementResult on another mesh ({info!r}) for {what}: "
        "per-parameter meshes (expert parallelism) are not supported yet; wrap the module "
        "holding such parameters in its own fully_shard(module, mesh=<that mesh>) call first, "
        "and return the placement alone (Shard(d)) here"
    )


def placement_notes(policy: Any, tensors: Sequence[Any]) -> tuple[str, ...]:
    """Where a group's layout differs from FSDP2's placement, from its planned ``TensorSpec``
    entries (``name``, ``shape``, ``unit``): one line per ``Shard(d)`` tensor with ``d > 0``, or
    per placement when more than ``MAX_NOTE_LINES`` tensors share it (one per block of a model).
    ``policy`` is the group's shard policy: a ``PlacementPolicy`` or a ``combine`` holding one
    (none: no notes)."""
    placement = _find_placement(policy)
    if placement is None:
        return ()
    chosen: dict[str, list[str]] = {}
    for t in tensors:
        dim = placement.dims.get(t.name, 0)
        if dim > 0 and math.prod(t.shape) > 0:
            per = dim_unit(t.shape, dim)
            choice = (
                f"Shard({dim}): FSDP2 gives each rank a block of dim {dim} in every leading "
                "index (strided in storage), which a rank's contiguous run cannot be; instead "
                f"each rank holds a run of whole dim-{dim} indices (unit {t.unit} elements = "
                f"{t.unit // per} of them) that may span leading indices"
            )
            chosen.setdefault(choice, []).append(f"{t.name} {tuple(t.shape)}")
    return grouped_notes(chosen, "tensors")


def _find_placement(policy: Any) -> PlacementPolicy | None:
    if isinstance(policy, PlacementPolicy):
        return policy
    for inner in getattr(policy, "policies", ()):
        found = _find_placement(inner)
        if found is not None:
            return found
    return None
