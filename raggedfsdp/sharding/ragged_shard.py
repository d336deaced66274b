"""``RaggedShard``: how one tensor's flat storage is split over the ranks of one mesh dimension.

Element-wise (ZeRO, FSDP1) and even row-wise (FSDP2 ``Shard(0)``) sharding cut tensors without
regard for the blocks the math needs. A ``RaggedShard`` instead cuts the row-major flat storage into
indivisible *units* of ``unit`` elements (one element, k rows, one 32-row quantization slab, one
expert matrix) and gives each rank a contiguous run of any number of units, zero included. The last
unit may be shorter than the others when the tensor's size is not a multiple of the unit, just as
the last quantization block of a 576-row projection with 128-row blocks is partial.

Everything here is pure integer arithmetic: no torch, no process group, so specs can be built and
checked for 100,000 ranks in a planner or a capacity simulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate

__all__ = ["Box", "RaggedShard", "flat_range_to_boxes", "row_numel"]


@dataclass(frozen=True)
class Box:
    """A rectangular sub-block of a tensor: ``offsets[d] : offsets[d] + sizes[d]`` in each dim.

    This is what a checkpoint chunk (DCP's ``ChunkStorageMetadata``) describes.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def row_numel(shape: Sequence[int]) -> int:
    """Elements in one row: a vector along the last dim, so a stacked ``(E, m, n)`` expert tensor
    has ``E * m`` rows of ``n`` (rows of its matrices, as a 128×128 block needs). A 1-D tensor is
    treated as a column (a row is one element), a 0-D tensor as one element."""
    return shape[-1] if len(shape) > 1 else 1


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Break the row-major flat range ``[start, stop)`` of a tensor into rectangular boxes.

    The result has at most ``2 * ndim - 1`` boxes: a ragged head, a run of whole slices of the
    outermost dim, and a ragged tail, each broken down recursively. A 0-D tensor is one box of
    empty size tuples.
    """
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of {numel} elements")
    if start == stop:
        return []
    if not shape:
        return [Box((), ())]
    boxes: list[Box] = []
    _append_boxes(shape, start, stop, (), boxes)
    return boxes


def _append_boxes(
    shape: tuple[int, ...], start: int, stop: int, prefix: tuple[int, ...], out: list[Box]
) -> None:
    inner = math.prod(shape[1:])
    lead = len(prefix)
    full = shape[1:]

    def whole_slices(first: int, last: int) -> None:
        if last > first:
            out.append(
                Box(prefix + (first,) + (0,) * len(full), (1,) * lead + (last - first,) + full)
            )

    first_row, head = divmod(start, inner)
    last_row, tail = divmod(stop, inner)
    if first_row == last_row:  # the range lies inside one slice of this dim
        _append_boxes(full, head, tail, (*prefix, first_row), out)
        return
    if head:
        _append_boxes(full, head, inner, (*prefix, first_row), out)
        first_row += 1
    whole_slices(first_row, last_row)
    if tail:
        _append_boxes(full, 0, tail, (*prefix, last_row), out)


@dataclass(frozen=True)
class RaggedShard:
    """A tensor's flat storage cut into units, ``units_per_rank[r]`` consecutive ones on rank r.

    Args:
        shape: the tensor's global shape.
        unit: elements per unit (the last unit may be shorter).
        units_per_rank: non-negative unit counts, one per rank, summing to ``num_units``.
        name: only used to make error messages point at the right tensor.
    """

    shape: tuple[int, ...]
    unit: int
    units_per_rank: tuple[int, ...]
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        who = f"tensor {self.name!r}" if self.name else "RaggedShard"
        shape = tuple(self.shape)
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(f"{who}: shape {shape} must hold non-negative ints")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "units_per_rank", tuple(self.units_per_rank))
        if not isinstance(self.unit, int) or self.unit < 1:
            raise ValueError(
                f"{who}: unit={self.unit!r} must be a positive number of elements "
                "(use 1 for element-wise sharding, k * row_numel(shape) for k rows)"
            )
        if not self.units_per_rank:
            raise ValueError(f"{who}: units_per_rank is empty; give one count per rank (W >= 1)")
        if any(not isinstance(c, int) or c < 0 for c in self.units_per_rank):
            raise ValueError(
                f"{who}: units_per_rank={self.units_per_rank} must be non-negative ints; "
                "a rank that holds nothing gets 0"
            )
        if sum(self.units_per_rank) != self.num_units:
            raise ValueError(
                f"{who}: units_per_rank sums to {sum(self.units_per_rank)} but the tensor of "
                f"{self.numel} elements has {self.num_units} units of {self.unit}; "
                "make the counts sum to ceil(numel / unit)"
            )

    # ----------------------------------------------------------------------------- constructors
    @classmethod
    def from_counts(
        cls, shape: Sequence[int], unit: int, units_per_rank: Sequence[int], name: str = ""
    ) -> RaggedShard:
        """Uneven split with explicit per-rank unit counts (zeros allowed)."""
        return cls(tuple(shape), unit, tuple(units_per_rank), name)

    @classmethod
    def even(cls, shape: Sequence[int], world_size: int, unit: int, name: str = "") -> RaggedShard:
        """Balanced split: every rank gets ``floor`` or ``ceil`` of ``num_units / W`` units,
        the larger counts first."""
        _check_world_size(world_size, name)
        if not isinstance(unit, int) or unit < 1:
            raise ValueError(
                f"tensor {name!r}: unit={unit!r} must be a positive number of elements"
            )
        n = _num_units(math.prod(shape), unit)
        base, extra = divmod(n, world_size)
        counts = [base + (r < extra) for r in range(world_size)]
        return cls(tuple(shape), unit, tuple(counts), name)

    @classmethod
    def element_wise(cls, shape: Sequence[int], world_size: int, name: str = "") -> RaggedShard:
        """ZeRO-style: each element is a unit."""
        return cls.even(shape, world_size, 1, name)

    @classmethod
    def row_wise(
        cls, shape: Sequence[int], world_size: int, rows: int = 1, name: str = ""
    ) -> RaggedShard:
        """Units of ``rows`` whole rows (see ``row_numel``), balanced over ranks."""
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"tensor {name!r}: rows={rows!r} must be a positive int")
        return cls.even(shape, world_size, rows * row_numel(shape), name)

    @classmethod
    def slice_wise(
        cls, shape: Sequence[int], world_size: int, slices: int = 1, name: str = ""
    ) -> RaggedShard:
        """Units of ``slices`` whole slices of dim 0: one expert matrix of a stacked ``(E, m, n)``
        tensor each (what Muon needs to orthogonalise an expert without communication)."""
        if not isinstance(slices, int) or slices < 1:
            raise ValueError(f"tensor {name!r}: slices={slices!r} must be a positive int")
        inner = math.prod(shape[1:]) if len(shape) > 1 else 1
        return cls.even(shape, world_size, slices * inner, name)

    @classmethod
    def block_wise(
        cls, shape: Sequence[int], world_size: int, block_rows: int, name: str = ""
    ) -> RaggedShard:
        """Units that keep ``block_rows × n`` tiles whole (e.g. 32 for 32×32 quantization tiles,
        128 for FP8 blocks): a tile never crosses a rank, because a rank holds whole row slabs."""
        return cls.row_wise(shape, world_size, block_rows, name)

    # ----------------------------------------------------------------------------- queries
    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def num_units(self) -> int:
        return _num_units(self.numel, self.unit)

    @property
    def world_size(self) -> int:
        return len(self.units_per_rank)

    @cached_property
    def unit_offsets(self) -> tuple[int, ...]:
        """First unit index of each rank (length W + 1, the last entry is ``num_units``);
        computed once, so per-rank queries are O(1)."""
        return (0, *accumulate(self.units_per_rank))

    @cached_property
    def bounds(self) -> tuple[int, ...]:
        """First element of each rank's piece in the flat storage, plus the end (W + 1
        entries): rank r holds ``[bounds[r], bounds[r + 1])``."""
        return tuple(min(u * self.unit, self.numel) for u in self.unit_offsets)

    def unit_range(self, rank: int) -> range:
        """Global unit indices held by ``rank`` (empty when the rank holds none)."""
        self._check_rank(rank)
        return range(self.unit_offsets[rank], self.unit_offsets[rank + 1])

    def offset(self, rank: int) -> int:
        """Element offset of ``rank``'s piece in the tensor's flat storage."""
        self._check_rank(rank)
        return self.bounds[rank]

    def length(self, rank: int) -> int:
        """Number of elements ``rank`` holds (its last unit may be the short one)."""
        self._check_rank(rank)
        return self.bounds[rank + 1] - self.bounds[rank]

    def local_range(self, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of ``rank``'s piece in the flat storage."""
        start = self.offset(rank)
        return start, start + self.length(rank)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.length(r) for r in range(self.world_size))

    def row_range(self, rank: int) -> range:
        """Rows (of the ``(numel // row_numel, row_numel)`` view, see ``row_numel``) that
        ``rank``'s piece touches, partial rows included. When the unit is a whole number of rows,
        every touched row is held whole; with k-row units, ``row_range(r)`` / k gives the
        blocks of k rows."""
        start, stop = self.local_range(rank)
        rn = row_numel(self.shape)
        if start == stop or not self.shape:
            return range(0, 0) if start == stop else range(0, 1)
        return range(start // rn, -(-stop // rn))

    def boxes(self, rank: int) -> list[Box]:
        """Rectangular boxes covering ``rank``'s flat range, for checkpoint chunks."""
        start, stop = self.local_range(rank)
        return flat_range_to_boxes(self.shape, start, stop)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is outside this shard's world of {self.world_size}")


def _num_units(numel: int, unit: int) -> int:
    return -(-numel // unit)


def _check_world_size(world_size: int, name: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"tensor {name!r}: world_size={world_size!r} must be an int >= 1 (the number of ranks "
            "in the shard dimension)"
        )
