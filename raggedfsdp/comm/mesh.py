"""Which ranks a flat buffer is sharded over, and over which ranks it is replicated.

Every layer above this one needs the same four numbers (shard group, shard rank, shard size and,
for HSDP, the replicate group), whatever the user handed in: a ``DeviceMesh``, a bare
``ProcessGroup`` or nothing at all. Resolving them once into a frozen :class:`ShardMesh` keeps
that branching out of the sharding and optimizer code.

``group=None`` follows torch's convention (the default group) with one addition: when
``torch.distributed`` is not initialized it means a single process, so single-process code paths
(unit tests, notebooks) run the same code without creating a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ShardMesh",
    "dp_submesh",
    "forget_groups",
    "group_rank",
    "group_size",
    "product_group",
    "resolve_group",
    "resolve_mesh",
    "shard_subgroup",
]

MeshLike = DeviceMesh | ProcessGroup | None


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group``; 1 for ``None`` when torch.distributed is not initialized.

    A group's own ``size()`` (C++) first: every collective asks, and ``dist.get_world_size``
    takes a microsecond of Python checks per call."""
    if isinstance(group, ProcessGroup):
        return group.size()
    if group is None and not dist.is_initialized():
        return 1
    size = dist.get_world_size(group)
    if size < 0:
        raise ValueError("group: this rank is not a member of the process group it was given")
    return size


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank within ``group``; 0 for ``None`` when not initialized."""
    if isinstance(group, ProcessGroup):
        return group.rank()
    if group is None and not dist.is_initialized():
        return 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this rank is not a member of the process group it was given")
    return rank


@dataclass(frozen=True)
class ShardMesh:
    """The ranks one flat buffer is sharded over (and, for HSDP, replicated over).

    ``shard_group`` is ``None`` only for the single-process mesh. ``replicate_group`` is ``None``
    for plain FSDP; for HSDP gradients are reduce-scattered over ``shard_group`` and then
    all-reduced over ``replicate_group``. ``device_mesh`` is kept when the mesh came from a
    ``DeviceMesh`` so callers that build DTensors can reuse it.
    """

    shard_group: ProcessGroup | None
    shard_rank: int
    shard_size: int
    replicate_group: ProcessGroup | None = None
    replicate_rank: int = 0
    replicate_size: int = 1
    device_mesh: DeviceMesh | None = None

    @property
    def is_hsdp(self) -> bool:
        """True when there is a replicate dimension (even of size 1: the reduction is a no-op)."""
        return self.replicate_group is not None

    @classmethod
    def from_groups(
        cls,
        shard_group: ProcessGroup | None,
        replicate_group: ProcessGroup | None = None,
        device_mesh: DeviceMesh | None = None,
    ) -> ShardMesh:
        """Build a mesh from explicit groups; ranks and sizes are read from torch.distributed."""
        return cls(
            shard_group=shard_group,
            shard_rank=group_rank(shard_group),
            shard_size=group_size(shard_group),
            replicate_group=replicate_group,
            replicate_rank=0 if replicate_group is None else group_rank(replicate_group),
            replicate_size=1 if replicate_group is None else group_size(replicate_group),
            device_mesh=device_mesh,
        )


def _check_device_mesh(mesh: DeviceMesh) -> None:
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"mesh: expected a 1-D (FSDP) or 2-D (replicate x shard, HSDP) DeviceMesh, "
            f"got a {mesh.ndim}-D mesh {tuple(mesh.shape)}; slice or flatten it to the FSDP dims "
            f"first (e.g. mesh['dp_replicate', 'dp_shard']) or pass the shard ProcessGroup"
        )


def resolve_group(
    mesh_or_group: MeshLike = None, mesh_dim: int | str | None = None
) -> ProcessGroup | None:
    """Return the process group a collective should run on.

    A ``DeviceMesh`` gives the group of ``mesh_dim`` (default: its last dim, the shard dim). A
    ``ProcessGroup`` is returned as is. ``None`` gives the default group, or ``None`` again when
    torch.distributed is not initialized (the collectives treat that as a single process).
    """
    if isinstance(mesh_or_group, DeviceMesh):
        _check_device_mesh(mesh_or_group)
        dim = mesh_or_group.ndim - 1 if mesh_dim is None else mesh_dim
        if isinstance(dim, int) and not 0 <= dim < mesh_or_group.ndim:
            raise ValueError(
                f"mesh_dim: {dim} is out of range for a {mesh_or_group.ndim}-D DeviceMesh"
            )
        return mesh_or_group.get_group(dim)
    if mesh_dim is not None:
        raise ValueError("mesh_dim: only meaningful with a DeviceMesh; leave it None for a group")
    if mesh_or_group is None:
        return dist.group.WORLD if dist.is_initialized() else None
    if isinstance(mesh_or_group, ProcessGroup):
        return mesh_or_group
    raise TypeError(
        f"mesh: expected a DeviceMesh, a ProcessGroup or None, "
        f"got {type(mesh_or_group).__name__}; pass init_device_mesh(...) or a group, or None "
        "for the default group"
    )


def resolve_mesh(mesh_or_group: MeshLike | ShardMesh = None) -> ShardMesh:
    """Describe the FSDP/HSDP layout given by a DeviceMesh, a ProcessGroup or None.

    A 1-D mesh or a group is plain FSDP. A 2-D mesh is HSDP: dim 0 replicates, dim 1 shards (the
    order torch's ``fully_shard`` uses). ``None`` shards over the default group, or is the
    single-process mesh when torch.distributed is not initialized. A ``ShardMesh`` passes through.
    """
    if isinstance(mesh_or_group, ShardMesh):
        return mesh_or_group
    if isinstance(mesh_or_group, DeviceMesh):
        _check_device_mesh(mesh_or_group)
        replicate = mesh_or_group.get_group(0) if mesh_or_group.ndim == 2 else None
        return ShardMesh.from_groups(resolve_group(mesh_or_group), replicate, mesh_or_group)
    return ShardMesh.from_groups(resolve_group(mesh_or_group))


def dp_submesh(
    mesh: DeviceMesh, shard_names: tuple[str, ...], replicate_names: tuple[str, ...] = ()
) -> DeviceMesh:
    """The data-parallel mesh of torch 2.13's SPMD form (``dp_mesh_dims``), derived from the
    full ``mesh`` as FSDP2 does: the named shard dim (several names are flattened into one,
    ``mesh[names]._flatten(...)``, which makes one new group), and for HSDP the named
    replicate dim(s) before it, as a 2-D ``(replicate, shard)`` mesh that ``resolve_mesh``
    reads. The names must be dims of ``mesh`` (``fully_shard`` checks them first)."""

    def one(names: tuple[str, ...]) -> DeviceMesh:
        return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))

    shard = one(shard_names)
    if not replicate_names:
        return shard
    return DeviceMesh._concatenate([one(replicate_names), shard])


# (shard group, size) -> (the shard group, kept alive so its id is not reused; the subgroup)
_SUBGROUPS: dict[tuple[int, int], tuple[ProcessGroup, ShardMesh]] = {}


def shard_subgroup(mesh: ShardMesh, size: int) -> ShardMesh:
    """The ``size`` consecutive ranks of ``mesh``'s shard dimension that this rank is one of,
    as a mesh of their own (FSDP2's ``reshard_after_forward=int``: the intra-node ranks, so the
    backward all-gather stays inside a node). Position ``j`` in it is shard rank ``g*size + j``.

    Only the members of each subgroup create it (``use_local_synchronization``), so a shard
    group that is part of a larger job needs no call from the other ranks. Created once per
    (shard group, size) and shared by every ``fully_shard`` call that asks for it.
    """
    if mesh.shard_size % size or not 1 <= size <= mesh.shard_size:
        raise ValueError(f"size: {size} does not divide the shard size {mesh.shard_size}")
    key = (id(mesh.shard_group), size)
    cached = _SUBGROUPS.get(key)
    if cached is not None and cached[0] is mesh.shard_group:
        return cached[1]
    group = mesh.shard_group
    ranks = sorted(dist.get_process_group_ranks(group), key=lambda r: dist.get_group_rank(group, r))
    first = mesh.shard_rank // size * size
    subgroup = dist.new_group(
        ranks[first : first + size],
        backend=dist.get_backend(group),
        use_local_synchronization=True,
        sort_ranks=False,  # position in the list is the rank in the subgroup
        group_desc=f"shard_subgroup_{size}",
    )
    sub = ShardMesh.from_groups(subgroup)
    _SUBGROUPS[key] = (group, sub)
    return sub


# (outer group, inner group) -> (both, kept alive so their ids are not reused; the product)
_PRODUCTS: dict[tuple[int, int], tuple[ProcessGroup, ProcessGroup, ProcessGroup]] = {}


def product_group(outer: ProcessGroup, inner: ProcessGroup) -> ProcessGroup:
    """The group of every rank reachable through ``outer`` and then ``inner``: the ranks at
    every (outer rank ``d``, inner rank ``t``) pair, ``d * inner_size + t`` in the result (the
    row-major flattening of a 2-D mesh ``(outer, inner)``, e.g. ``(dp_shard, tp)``).

    Muon's owners exchange whole tensor-parallel matrices over data parallel × TP in one
    all-to-all; this is the group it runs on. The ranks are found with one all-gather over
    ``outer`` (each member's ``inner`` ranks), and only the product's members create it
    (``use_local_synchronization``), so other parts of a larger job (pipeline stages, other
    replicas) make no call. Created once per (outer, inner) pair.
    """
    key = (id(outer), id(inner))
    cached = _PRODUCTS.get(key)
    if cached is not None and cached[0] is outer and cached[1] is inner:
        return cached[2]

    def ordered(group: ProcessGroup) -> list[int]:
        ranks = dist.get_process_group_ranks(group)
        return sorted(ranks, key=lambda r: dist.get_group_rank(group, r))

    rows: list[list[int] | None] = [None] * dist.get_world_size(outer)
    dist.all_gather_object(rows, ordered(inner), group=outer)
    ranks = [r for row in rows for r in row]
    if len(set(ranks)) != len(ranks) or len({len(row) for row in rows}) != 1:
        raise ValueError(
            f"inner: the groups {rows} of the outer group's ranks overlap or differ in size; "
            "outer and inner must be two dims of one device mesh"
        )
    product = dist.new_group(
        ranks,
        backend=dist.get_backend(outer),
        use_local_synchronization=True,
        sort_ranks=False,  # position in the list is the rank in the product
        group_desc="product_group",
    )
    _PRODUCTS[key] = (outer, inner, product)
    return product


def forget_groups() -> None:
    """Drop the subgroups and product groups made so far (``shard_subgroup``,
    ``product_group``), and the groups they keep alive: call it after destroying process
    groups, so that their gloo threads and sockets end with them. A later call makes new
    ones."""
    _SUBGROUPS.clear()
    _PRODUCTS.clear()
