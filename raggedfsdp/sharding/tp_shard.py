"""``TPShard`` and ``TPRaggedShard``: a ragged data-parallel split of one tensor-parallel shard.

Under tensor parallelism (``parallelize_module`` with ``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``) each parameter is a DTensor on a 1-D TP mesh: ``Shard(0)`` (a block of
rows), ``Shard(1)`` (a block of columns) or ``Replicate()``. ``fully_shard`` then cuts each TP
rank's *local* tensor into units over the data-parallel ranks, so a unit never crosses a TP
shard boundary. ``TPShard`` records where that local tensor sits in the global one (the TP
mesh, placement, global shape and stride, the TP coordinate); ``TPRaggedShard`` is the
``RaggedShard`` of the local tensor with its ``TPShard`` attached. In torch 2.13's SPMD form
(``fully_shard(..., dp_mesh_dims=...)``) the parameter is a DTensor on the full mesh instead;
the record then also keeps that mesh and the parameter's placements on it, so the module is
handed the same full-mesh DTensor, while everything else (gathers, reductions, boxes) works on
the TP dim alone, as for the 1-D form.

A parameter may be split on several mesh dims other than the data-parallel ones: EP x TP
experts are DTensors on ``mesh["ep", "tp"]``, ``(Shard(0), Shard(1))``. The record then keeps
that mesh and one placement per dim; ``splits`` names the ``(mesh dim, tensor dim)`` pairs,
and everything positional (``local_shape``, ``offsets``, ``local_of``, ``global_box``) applies
each of them, while whole-tensor answers reduce over one group spanning the split dims
(``split_group``). A 1-D record is the special case with one pair.

The TP record lives *in the spec* on purpose: optimizers build their sharded state as
``RaggedTensor(local, param.ragged_shard, ...)``, so state tensors made from a TP parameter's
spec know their global shape and placement too (full state dicts and DCP boxes in global
coordinates) without the optimizer knowing about TP. ``RaggedShard.shape`` stays the shape
that is cut (the TP-local one): every unit and box rule keeps working unchanged on it.

Unlike ``ragged_shard.py`` this needs torch (the TP mesh is a ``DeviceMesh``), so it is
imported by the torch-side modules only (``ragged_tensor``, ``fully_shard``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from raggedfsdp.sharding.ragged_shard import Box, RaggedShard
from raggedfsdp.sharding.tp_split import tp_splits_local_shape

__all__ = ["TPRaggedShard", "TPShard", "global_shape_of", "tp_of", "tp_split_of"]


@dataclass(frozen=True)
class TPShard:
    """Where one TP rank's local tensor lies in the global tensor.

    Args:
        mesh: the ``DeviceMesh`` the DTensor lives on, other dims than the data-parallel
            ones: the 1-D TP mesh, or several dims (EP x TP experts on ``mesh["ep", "tp"]``).
        placements: one per dim of ``mesh``, ``Shard(d)`` or ``Replicate()`` (``fully_shard``
            refuses any other, and a tensor dim split on two mesh dims).
        global_shape: the DTensor's global shape.
        global_stride: the DTensor's global stride (TP's hooks compare it).
        coordinate: this process's coordinate on ``mesh``, one per dim.
        split_group: the process group over the mesh dims that split the tensor (their ranks
            row-major, ``rank`` the position in it): the dim's own group for one, a
            ``product_group`` for several, made once by ``fully_shard``; ``None`` when nothing
            is split.
        spmd_mesh: torch 2.13's SPMD form (``fully_shard(..., dp_mesh_dims=...)``): the full
            mesh the parameter is a DTensor on, ``mesh`` being its TP dim; ``None`` when the
            parameter is a DTensor on ``mesh`` itself.
        spmd_placements: the parameter's placements on ``spmd_mesh`` (``Replicate()`` on every
            data-parallel dim, ``placement`` on the TP dim), as the module is handed it.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]
    coordinate: tuple[int, ...]
    split_group: ProcessGroup | None = None
    spmd_mesh: DeviceMesh | None = None
    spmd_placements: tuple[Placement, ...] | None = None

    def __deepcopy__(self, memo: dict) -> TPShard:
        # Immutable, and a DeviceMesh holds process groups, which cannot be copied: DCP's
        # ``async_save`` deep-copies state dicts, specs included
        return self

    @property
    def placement(self) -> Placement | tuple[Placement, ...]:
        """The placement on a 1-D mesh; the tuple of them on several dims (for messages)."""
        return self.placements[0] if len(self.placements) == 1 else self.placements

    @property
    def splits(self) -> tuple[tuple[int, int], ...]:
        """``(mesh dim, tensor dim)`` of every mesh dim that splits the tensor, in mesh order."""
        return tuple((i, p.dim) for i, p in enumerate(self.placements) if isinstance(p, Shard))

    @property
    def dims(self) -> tuple[int, ...]:
        """The global dims the split cuts, in mesh order (empty when replicated)."""
        return tuple(d for _, d in self.splits)

    @property
    def dim(self) -> int | None:
        """The global dim the TP split cuts, or ``None`` for ``Replicate()``; with several
        split dims the innermost, which sets the contiguous runs a block holds (the outer
        ones only choose which runs)."""
        return max(self.dims) if self.dims else None

    @property
    def size(self) -> int:
        """The TP degree: the ranks of the split dims (the mesh's when nothing is split)."""
        if not self.splits:
            return self.mesh.size()
        return math.prod(self.mesh.size(i) for i, _ in self.splits)

    @property
    def rank(self) -> int:
        """This rank's position among the split dims' ranks (row-major; ``split_group``'s)."""
        index = 0
        for i, _ in self.splits:
            index = index * self.mesh.size(i) + self.coordinate[i]
        return index

    @property
    def local_shape(self) -> tuple[int, ...]:
        degrees = ((d, self.mesh.size(i)) for i, d in self.splits)
        return tp_splits_local_shape(self.global_shape, tuple(degrees))

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start of this rank's block along every global dim (0 where not split)."""
        offsets, local = [0] * len(self.global_shape), self.local_shape
        for i, d in self.splits:
            offsets[d] = self.coordinate[i] * local[d]
        return tuple(offsets)

    @property
    def reduce_group(self) -> ProcessGroup | None:
        """The group over which whole-tensor answers (norms, sums, ``equal``) must also be
        combined: the split dims' group when the ranks hold different blocks, ``None`` when
        they hold the same (replicated) values, which must be counted once."""
        return self.split_group

    @property
    def contiguous_run(self) -> bool:
        """Whether this rank's block is one contiguous range of the global flat tensor: every
        dim before the innermost split one holds one index (or nothing is split)."""
        return self.dim is None or math.prod(self.local_shape[: self.dim]) == 1

    def derived(
        self, global_shape: tuple[int, ...], dim: int | tuple[int | None, ...] | None
    ) -> TPShard:
        """The record of a tensor derived from this one block by block (an optimizer's state
        grid): ``global_shape``, split on ``dim`` over the same TP ranks (``None``:
        replicated). For a tensor split on several mesh dims, ``dim`` has one entry per
        ``splits`` pair: the derived dim that mesh dim splits (``None``: that mesh dim
        replicates it, right only where it has one rank); the other mesh dims replicate."""
        dims = dim if isinstance(dim, tuple) else (dim,)
        if len(self.placements) != 1 and len(dims) != len(self.splits):
            raise ValueError(
                f"a state grid derived from a tensor split on {self.placements} over "
                f"{self.mesh.mesh_dim_names}: give one derived dim per split, got {dim}"
            )
        mesh_dims = [i for i, _ in self.splits] if len(self.placements) != 1 else [0]
        placements: list[Placement] = [Replicate()] * len(self.placements)
        for i, d in zip(mesh_dims, dims, strict=True):
            placements[i] = Replicate() if d is None else Shard(d)
        stride = [1] * len(global_shape)
        for i in range(len(global_shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * global_shape[i + 1]
        group = None
        if any(isinstance(p, Shard) for p in placements):  # the ranks the splits span
            group = self.mesh.get_group(0) if len(self.placements) == 1 else self.split_group
        return TPShard(
            self.mesh, tuple(placements), tuple(global_shape), tuple(stride), self.coordinate, group
        )

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's block of a tensor of the global shape (a view)."""
        local, offsets = self.local_shape, self.offsets
        for d in self.dims:
            full = full.narrow(d, offsets[d], local[d])
        return full

    def global_box(self, box: Box) -> Box:
        """A box of the local tensor in global coordinates (for DCP chunks)."""
        if not self.dims or not box.offsets:
            return box
        offsets = tuple(o + s for o, s in zip(box.offsets, self.offsets, strict=True))
        return Box(offsets, box.sizes)

    def dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's block) as the DTensor TP's hooks expect: same mesh, placement,
        global shape and stride (in the SPMD form: on the full mesh, with the parameter's
        placements there). No communication; shares ``local``'s storage."""
        if self.spmd_mesh is not None:
            return self._from_local(local, self.spmd_mesh, self.spmd_placements)
        return self._from_local(local, self.mesh, self.placements)

    def _from_local(
        self, local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
    ) -> DTensor:
        return DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(self.global_shape),
            stride=self.global_stride,
        )

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The global tensor from this rank's block (collectives over the split dims, none
        when replicated)."""
        if not self.dims:
            return local
        return self._from_local(local, self.mesh, self.placements).full_tensor()


@dataclass(frozen=True, repr=False)
class TPRaggedShard(RaggedShard):
    """The ``RaggedShard`` of a TP-local tensor (``shape`` is the local shape) with the
    ``TPShard`` saying where that tensor lies in the global one."""

    tp: TPShard | None = field(default=None)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tp is None or tuple(self.shape) != self.tp.local_shape:
            raise ValueError(
                f"tensor {self.name!r}: a TPRaggedShard cuts the TP-local tensor of shape "
                f"{None if self.tp is None else self.tp.local_shape}, got shape {self.shape}"
            )

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, tp={self.tp.placement} of {self.tp.size})"

    @classmethod
    def of(cls, spec: RaggedShard, tp: TPShard) -> TPRaggedShard:
        """``spec`` (planned for the local tensor) with ``tp`` attached."""
        return cls(spec.shape, spec.unit, spec.units_per_rank, spec.name, tp)


def tp_of(spec: Any) -> TPShard | None:
    """The TP record of a spec, or ``None`` for a tensor sharded over data parallel only."""
    return spec.tp if isinstance(spec, TPRaggedShard) else None


def global_shape_of(spec: RaggedShard) -> tuple[int, ...]:
    """The shape a ``RaggedTensor`` split by ``spec`` reports: the global one under TP."""
    tp = tp_of(spec)
    return spec.shape if tp is None else tp.global_shape


def tp_split_of(spec: Any) -> TPShard | None:
    """The TP record of a spec whose tensor TP splits; ``None`` for a tensor that is not TP or
    is replicated over TP (each TP rank holds all of it, so its math is the plain one)."""
    tp = tp_of(spec)
    return tp if tp is not None and tp.dim is not None else None
