"""Tensor parallelism inside a ``fully_shard`` group: parameters that are DTensors on a TP mesh.

torchtitan's code, unchanged: ``parallelize_module(block, mesh["tp"], plan)`` turns weights into
DTensors on the 1-D TP mesh (``ColwiseParallel``: ``Shard(0)``, ``RowwiseParallel``:
``Shard(1)``, ``SequenceParallel`` norms: ``Replicate()``), then ``fully_shard(block,
mesh=mesh["dp_shard"])`` (or ``mesh["dp_replicate", "dp_shard"]``) shards them over data
parallel. Here each such parameter is planned by its TP-local tensor, so units never cross a TP
block; the sharded parameter is a ``RaggedTensor`` whose spec carries the TP record
(``TPRaggedShard``: global shape, placement, mesh); before forward the gathered local tensor is
handed to the module as the same DTensor TP's hooks expect; gradients arrive as DTensors,
are brought to the parameter's placement by DTensor (TP's own reductions, e.g. the
sequence-parallel norms' partial sums, as FSDP2 does) and only their local tensors enter the
flat gradient buffer, which is reduce-scattered over data parallel alone.

torch 2.13's SPMD form, ``fully_shard(module, mesh=full_mesh, dp_mesh_dims=...)`` with
parameters already DTensors on the full mesh (``Replicate()`` on the dp dims), reuses all of
this with the full mesh's one other dim as the TP mesh (``SPMDMesh``): the module is handed
full-mesh DTensors, and a gradient's dp dims (``Partial`` over a dp-sharded batch) are left to
the group's reduce-scatter, as FSDP2 does, while DTensor brings its TP dim to the parameter's.

Everything that cannot compose is refused here, before anything changes, in one line naming
the parameter and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from raggedfsdp.comm import ShardMesh
from raggedfsdp.comm.mesh import product_group
from raggedfsdp.fsdp.managed_param import ManagedParam
from raggedfsdp.sharding import RaggedShard, ShardPolicy, resolve_units
from raggedfsdp.sharding.tp_shard import TPRaggedShard, TPShard, tp_of
from raggedfsdp.sharding.tp_split import tp_split_note, tp_splits_local_shape

__all__ = [
    "SPMDMesh",
    "check_tp_optimizer",
    "local_grad",
    "tp_block_notes",
    "tp_shard_of",
    "tp_spec",
]


@dataclass(frozen=True)
class SPMDMesh:
    """torch 2.13's SPMD form: ``fully_shard(module, mesh=full_mesh, dp_mesh_dims=...)`` with
    parameters that are DTensors on ``mesh``, ``Replicate()`` on the data-parallel dims
    ``dp_dims`` and their TP placement on the one other dim, ``tp_dim``."""

    mesh: DeviceMesh
    dp_dims: tuple[int, ...]
    tp_dim: int

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh[self.mesh.mesh_dim_names[self.tp_dim]]


def tp_shard_of(
    fqn: str, param: torch.Tensor, mesh: ShardMesh, spmd: SPMDMesh | None = None
) -> TPShard | None:
    """The TP record of a DTensor parameter (``None`` for a plain one), after checking that it
    composes with data parallelism over ``mesh`` (and, in the SPMD form, lies on ``spmd``'s
    full mesh)."""
    if spmd is not None:
        return _spmd_tp_shard_of(fqn, param, mesh, spmd)
    if not isinstance(param, DTensor):
        return None
    tp_mesh, placements = param.device_mesh, tuple(param.placements)
    where = f"parameter {fqn!r} is a DTensor with placements {placements} on a {tp_mesh}"
    if tp_mesh.ndim != 1:
        _check_disjoint(where, tp_mesh, mesh, _SPMD_HINT)
    return _tp_record(where, param, tp_mesh, placements, mesh)


_SPMD_HINT = (
    "without dp_mesh_dims fully_shard composes with DTensors on other mesh dims than the "
    "data-parallel ones (a 1-D TP mesh: parallelize_module(module, mesh['tp'], plan), then "
    "fully_shard(..., mesh=mesh['dp_shard']); or several, e.g. experts on mesh['ep', 'tp']); "
    "for DTensors on the full mesh (torch's SPMD form) pass fully_shard(..., mesh=<that mesh>, "
    "dp_mesh_dims=DataParallelMeshDims(shard='dp_shard'))"
)


def _spmd_tp_shard_of(fqn: str, param: torch.Tensor, mesh: ShardMesh, spmd: SPMDMesh) -> TPShard:
    """The SPMD form: ``param`` must be a DTensor on the full mesh, ``Replicate()`` on every
    data-parallel dim; its placement on the TP dim is then checked as a 1-D TP one."""
    full, names = spmd.mesh, spmd.mesh.mesh_dim_names
    fix = (
        f"build it with distribute_tensor(t, mesh, placements) on the full mesh {names}, "
        f"Replicate() on {tuple(names[i] for i in spmd.dp_dims)} and Shard(d) or Replicate() "
        f"on {names[spmd.tp_dim]!r}"
    )
    if not isinstance(param, DTensor):
        raise ValueError(
            f"parameter {fqn!r} is a plain {type(param).__name__}, but with dp_mesh_dims every "
            f"parameter must be a DTensor on the full mesh (as FSDP2 requires): {fix}"
        )
    placements = tuple(param.placements)
    where = f"parameter {fqn!r} is a DTensor with placements {placements} on a {param.device_mesh}"
    if param.device_mesh != full:
        raise ValueError(
            f"{where}, not on the mesh given to fully_shard ({full}); with dp_mesh_dims, {fix}"
        )
    for i in spmd.dp_dims:
        if not isinstance(placements[i], Replicate):
            raise ValueError(
                f"{where}: with dp_mesh_dims it must be Replicate() on the data-parallel dim "
                f"{names[i]!r}, not {placements[i]!r} (fully_shard shards it there); {fix}"
            )
    tp = _tp_record(where, param, spmd.tp_mesh, (placements[spmd.tp_dim],), mesh)
    spmd_placements = list(placements)
    spmd_placements[spmd.tp_dim] = tp.placements[0]  # Shard(-1) normalised
    return replace(tp, spmd_mesh=full, spmd_placements=tuple(spmd_placements))


def _tp_record(
    where: str,
    param: DTensor,
    tp_mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    mesh: ShardMesh,
) -> TPShard:
    """The TP record of ``param``, whose placements on ``tp_mesh`` (1-D, or several dims such
    as EP x TP's ``("ep", "tp")``) are ``placements``."""
    for placement in placements:
        if isinstance(placement, _StridedShard) or not isinstance(placement, (Shard, Replicate)):
            raise ValueError(
                f"{where}: fully_shard composes with Shard(dim) and Replicate() TP placements "
                f"only (as parallelize_module leaves them), not {placement!r}; redistribute it "
                "to one of those before fully_shard (a Partial parameter has no values yet to "
                "shard)"
            )
    shape = tuple(param.shape)
    placements = tuple(Shard(p.dim % len(shape)) if isinstance(p, Shard) else p for p in placements)
    splits = [(p.dim, tp_mesh.size(i)) for i, p in enumerate(placements) if isinstance(p, Shard)]
    try:
        tp_splits_local_shape(shape, splits)
    except ValueError as error:
        raise ValueError(f"{where}: its {error}") from None
    _check_disjoint(where, tp_mesh, mesh)
    coordinate = tuple(tp_mesh.get_coordinate())
    group = _split_group(tp_mesh, placements)
    tp = TPShard(tp_mesh, placements, shape, tuple(param.stride()), coordinate, group)
    if tuple(param.to_local().shape) != tp.local_shape:
        raise ValueError(
            f"{where}: its local tensor has shape {tuple(param.to_local().shape)}, not the "
            f"{tp.local_shape} of an even split; build it with parallelize_module or "
            "distribute_tensor"
        )
    return tp


def _split_group(tp_mesh: DeviceMesh, placements: tuple[Placement, ...]) -> ProcessGroup | None:
    """The group over the mesh dims that split the tensor, row-major (``TPShard.split_group``):
    one dim's own group, or the ``product_group`` of several (created once per set of dims;
    ``fully_shard`` runs on every rank of the mesh, so every member asks for it)."""
    groups = [tp_mesh.get_group(i) for i, p in enumerate(placements) if isinstance(p, Shard)]
    if not groups:
        return None
    group = groups[0]
    for inner in groups[1:]:
        group = product_group(group, inner)
    return group


def _check_disjoint(where: str, tp_mesh: DeviceMesh, mesh: ShardMesh, hint: str = "") -> None:
    """The TP mesh must be other dims than the data-parallel ones: the only rank it shares
    with the shard and replicate groups is this one (else it is the dp mesh itself, or the
    whole mesh was passed to fully_shard), and on the same device type. ``hint`` replaces the
    fix the overlap's message names."""
    dp_mesh = mesh.device_mesh
    if dp_mesh is not None and dp_mesh.device_type != tp_mesh.device_type:
        raise ValueError(
            f"{where}: its mesh is on {tp_mesh.device_type!r} but fully_shard's is on "
            f"{dp_mesh.device_type!r}; build both from one init_device_mesh"
        )
    dp_ranks: set[int] = set()
    for group in (mesh.shard_group, mesh.replicate_group):
        if group is not None:
            dp_ranks.update(dist.get_process_group_ranks(group))
    shared = dp_ranks & set(tp_mesh.mesh.flatten().tolist())
    if shared - {dist.get_rank()}:
        fix = hint or (
            "the TP mesh must be another dim of the same device mesh. Pass "
            "fully_shard(..., mesh=mesh['dp_shard']) (or mesh['dp_replicate', 'dp_shard']) and "
            "parallelize_module(..., mesh['tp'], ...) of one init_device_mesh"
        )
        raise ValueError(
            f"{where}, which shares ranks {sorted(shared)} with fully_shard's data-parallel "
            f"mesh: {fix}"
        )


def tp_spec(spec: RaggedShard, mp: ManagedParam) -> RaggedShard:
    """The sharded parameter's spec: the planned one, with the TP record for a TP parameter."""
    return spec if mp.tp is None else TPRaggedShard.of(spec, mp.tp)


def local_grad(grad: torch.Tensor, mp: ManagedParam) -> torch.Tensor:
    """The local tensor of a TP parameter's gradient at the parameter's own placement.

    A replicated weight applied to sequence-sharded activations (a ``SequenceParallel`` norm)
    gets a ``Partial`` gradient; DTensor's ``redistribute`` sums it over the TP group, the one
    TP reduction it needs (FSDP2 does the same). Data parallel is reduced by the caller."""
    if mp.tp is None or not isinstance(grad, DTensor):
        return grad
    target = _grad_placements(tuple(grad.placements), mp.tp)
    if tuple(grad.placements) != target:
        grad = grad.redistribute(placements=target)
    local = grad.to_local()
    # a functional collective's result (the redistribute's): wait for it here, on the stream
    # that computed the gradient, before the flat buffer reads it
    return local.wait() if isinstance(local, AsyncCollectiveTensor) else local


def _grad_placements(placements: tuple[Placement, ...], tp: TPShard) -> tuple[Placement, ...]:
    """The placements a TP gradient is brought to: the parameter's on the TP dim. In the SPMD
    form (a gradient on the full mesh) the data-parallel dims are kept as they come, as FSDP2
    does: a ``Partial`` sum (or mean) over a dp-sharded batch, or ``Replicate()``, is reduced
    by the group's own reduce-scatter, never by DTensor as well; any other dp placement is
    replicated first, so that the local tensor is the TP block."""
    if tp.spmd_mesh is None:
        return tp.placements
    tp_dim = tp.spmd_mesh.mesh_dim_names.index(tp.mesh.mesh_dim_names[0])
    return tuple(
        tp.placements[0] if i == tp_dim else have if _reducible(have) else Replicate()
        for i, have in enumerate(placements)
    )


def _reducible(placement: Placement) -> bool:
    """Whether the group's reduction (a mean, or a sum with a divide factor) is the right one
    for a gradient with this placement on a data-parallel dim."""
    return isinstance(placement, Replicate) or (
        isinstance(placement, Partial) and placement.reduce_op in ("sum", "avg")
    )


def tp_block_notes(
    params: list[ManagedParam], policy: ShardPolicy, units: dict[str, int], world: int
) -> tuple[str, ...]:
    """Where the TP split cuts a block the shard policy asks for in *global* coordinates.

    Units are planned on each TP-local tensor, so they never cross a TP block; but the policy
    asked for blocks of the global tensor (an 8-bit quantization block, 32 rows): such a block
    stays whole on a TP rank only if its unit is the same on the local and the global shape
    and divides the contiguous runs the TP block holds (the whole block for ``Shard(0)``, rows
    of ``prod(local_shape[d:])`` elements for ``Shard(d)``)."""
    tp_params = [mp for mp in params if mp.tp is not None and mp.tp.dim is not None]
    if not tp_params:
        return ()
    tensors = [(mp.fqn, mp.tp.global_shape, mp.original.dtype) for mp in tp_params]
    global_units = resolve_units(policy, tensors, world, {mp.fqn: mp.original for mp in tp_params})
    notes = (
        tp_split_note(
            mp.fqn,
            [(d, mp.tp.mesh.size(i)) for i, d in mp.tp.splits],
            mp.tp.global_shape,
            global_units[mp.fqn],
            units[mp.fqn],
        )
        for mp in tp_params
    )
    return tuple(note for note in notes if note is not None)


def check_tp_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a raggedfsdp optimizer whose math does not know TP pieces
    (``handles_tensor_parallel``: a subclass written for data parallelism alone) on TP
    parameters: it would compute each TP block as if it were the whole tensor, unlike one
    process. raggedfsdp's own know them (``Muon`` gathers each matrix over dp x TP;
    ``AdamW8bit`` quantizes the global tensor's blocks, refusing at construction a split that
    cuts one; ``Shampoo`` and ``SOAP`` precondition the global tensor's blocks, computing each
    slab a TP split cuts on an owner over dp x TP, ``raggedfsdp.optim.tp_slabs``; a parameter
    split over several mesh dims, EP x TP experts, is refused at construction by an optimizer
    without ``handles_multi_dim_tp``); torch's element-wise optimizers are exact on the pieces.
    Raised by the step guard before the step touches anything."""
    from raggedfsdp.optim import ShardedOptimizer

    if not isinstance(optimizer, ShardedOptimizer) or optimizer.handles_tensor_parallel:
        return
    for gi, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            tp = tp_of(getattr(p, "ragged_shard", None))
            if tp is None:
                continue
            names = group.get("param_names")
            label = repr(names[i]) if names else f"param_groups[{gi}][{i}]"
            kind = type(optimizer).__name__
            raise NotImplementedError(
                f"{kind}.step(): parameter {label} ({p.ragged_shard.name!r} of its fully_shard "
                f"group) is tensor-parallel ({tp.placement!r} over {tp.size} ranks), and "
                f"{kind} does not set handles_tensor_parallel: it would update each TP block "
                "as a whole tensor, unlike one process. Give TP parameters to a raggedfsdp "
                "optimizer (AdamW, Muon, ...) or set handles_tensor_parallel once its math "
                "handles TP pieces"
            )
