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
from array import array
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from operator import sub

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
        counts = self.units_per_rank
        if not counts:
            raise ValueError(f"{who}: units_per_rank is empty; give one count per rank (W >= 1)")
        # builtins over the whole tuple (no Python loop): specs are built for 100,000 ranks
        if not all(issubclass(kind, int) for kind in set(map(type, counts))) or min(counts) < 0:
            raise ValueError(
                f"{who}: units_per_rank={_abridged(counts)} must be non-negative ints; "
                "a rank that holds nothing gets 0"
            )
        if sum(counts) != self.num_units:
            raise ValueError(
                f"{who}: units_per_rank sums to {sum(counts)} but the tensor of "
                f"{self.numel} elements has {self.num_units} units of {self.unit}; "
                "make the counts sum to ceil(numel / unit)"
            )

    def __repr__(self) -> str:  # error messages quote specs: not 100,000 counts
        name = f", name={self.name!r}" if self.name else ""
        return (
            f"RaggedShard(shape={self.shape}, unit={self.unit}, "
            f"units_per_rank={_abridged(self.units_per_rank)}{name})"
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
    def unit_offsets(self) -> Sequence[int]:
        """First unit index of each rank (length W + 1, the last entry is ``num_units``);
        computed once, so per-rank queries are O(1). Kept as 8-byte ints (``array``), not a
        tuple of int objects: at 100,000 ranks that is 0.8 MB per tensor instead of ~4 MB."""
        return array("q", (0, *accumulate(self.units_per_rank)))

    @cached_property
    def bounds(self) -> Sequence[int]:
        """First element of each rank's piece in the flat storage, plus the end (W + 1
        entries): rank r holds ``[bounds[r], bounds[r + 1])``. Counted in whole units, only
        the ranks after the holder of a short last unit would start past ``numel``: they are
        clipped together, so no Python-level loop runs over the ranks."""
        offsets = self.unit_offsets
        whole = array("q", map(self.unit.__mul__, offsets))
        if whole[-1] == self.numel:
            return whole
        tail = bisect_left(offsets, offsets[-1])  # ranks after the last unit's holder
        return whole[:tail] + array("q", (self.numel,)) * (len(whole) - tail)

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
        """Elements each rank holds (W entries): O(W) from ``bounds``, with no per-rank call."""
        bounds = self.bounds
        return tuple(map(sub, bounds[1:], bounds))

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
        """Rectangular boxes covering ``rank``'s flat range, for checkpoint chunks.

        A tensor with no elements (``nn.Linear(0, 4)``'s ``(4, 0)`` weight) is one empty box
        on rank 0: a checkpoint records only the tensors some rank writes a chunk of, so with
        no box anywhere it would be missing at load (a plain empty tensor is one chunk too).
        """
        start, stop = self.local_range(rank)
        if self.numel == 0:
            return [Box((0,) * len(self.shape), self.shape)] if rank == 0 else []
        return flat_range_to_boxes(self.shape, start, stop)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is outside this shard's world of {self.world_size}")


def _abridged(counts: tuple[int, ...]) -> str:
    """``counts`` for an error message: at most 8 entries shown, since W may be 100,000."""
    if len(counts) <= 8:
        return str(counts)
    head, tail = ", ".join(map(str, counts[:4])), ", ".join(map(str, counts[-4:]))
    return f"({head}, <{len(counts) - 8:,} more>, {tail})"


def _num_units(numel: int, unit: int) -> int:
    return -(-numel // unit)


def _check_world_size(world_size: int, name: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"tensor {name!r}: world_size={world_size!r} must be an int >= 1 (the number of ranks "
            "in the shard dimension)"
        )
