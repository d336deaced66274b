"""Block geometry of the optimizers' per-block state, shared by the optimizers and the planner.

8-bit AdamW keeps one fp32 absmax per quantization block and Shampoo keeps factors per
``B × B`` block; both count blocks from the start of the *parameter*, so which blocks (and how
much state) a rank holds follows from the tensor's shape and the rank's flat range alone. The
optimizers allocate their state from this geometry and the capacity planner sums the same
figures over ranks, so the two cannot disagree.

Pure Python; the range queries (``counts``, ``slabs_starting_in``) also take numpy integer
arrays of starts and stops, so the planner evaluates them for every rank at once.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raggedfsdp.sharding.ragged_shard import row_numel
from raggedfsdp.sharding.units import shampoo_matrix

__all__ = ["QuantBlocks", "ShampooBlocks"]


@dataclass(frozen=True)
class QuantBlocks:
    """The quantization blocks of one tensor: ``block_size`` consecutive elements of its flat
    index, or ``tile_rows × tile_cols`` tiles of its ``rows × cols`` view (``cols`` = last dim).

    The absmax tensor is the block grid (``grid_shape``), split over ranks in whole
    ``count_unit`` runs: one block for 1-D blocks, one grid row for tiles. A rank's blocks are
    those its flat range overlaps; with the optimizer's shard policy that range starts on a
    block (or tile-row) boundary, so every block is whole on one rank.
    """

    numel: int
    cols: int  # elements per row of the view the blocks tile
    tile_rows: int
    tile_cols: int
    tiled: bool  # 2-D tiles (else 1-D blocks of tile_cols elements)

    @classmethod
    def of(cls, shape: Sequence[int], block_size: int, tile: tuple[int, int] | None) -> QuantBlocks:
        numel = math.prod(shape)
        if tile and len(shape) >= 2:
            return cls(numel, row_numel(tuple(shape)), tile[0], tile[1], True)
        return cls(numel, numel, 1, block_size, False)

    @property
    def grid_shape(self) -> tuple[int, ...]:
        if self.tiled:
            return (
                -(-(self.numel // self.cols) // self.tile_rows),
                -(-self.cols // self.tile_cols),
            )
        return (-(-self.numel // self.tile_cols),)

    @property
    def count_unit(self) -> int:
        """Absmax entries per counted unit (a grid row for tiles, one block otherwise)."""
        return self.grid_shape[1] if self.tiled else 1

    def counts(self, start: Any, stop: Any) -> Any:
        """Counted units (blocks, or grid rows of tiles) overlapped by the flat range
        ``[start, stop)``; ints or numpy arrays."""
        if self.tiled:
            first, last = start // self.cols, stop // self.cols
            return (-(-last // self.tile_rows) - first // self.tile_rows) * (stop > start)
        return (-(-stop // self.tile_cols) - start // self.tile_cols) * (stop > start)

    def local_view(self, start: int, stop: int) -> tuple[int, int, int, int]:
        """``(rows, cols, tile_rows, tile_cols)`` of the piece ``[start, stop)`` as the
        quantizer tiles it (a piece of whole rows for tiles, one row of elements otherwise)."""
        if self.tiled:
            return (stop - start) // self.cols, self.cols, self.tile_rows, self.tile_cols
        return 1, stop - start, 1, self.tile_cols


@dataclass(frozen=True)
class ShampooBlocks:
    """Shampoo's (and SOAP's) blocks of one preconditioned tensor: its ``rows × cols`` matrix
    view (``units.shampoo_matrix``: ``prod(leading dims) × last dim``, after DistributedShampoo's
    dim merging when asked; a vector is an ``n × 1`` column) cut into blocks of at most
    ``B × B``. A *slab* is one row of blocks (``slab_rows`` whole rows). Order-2 blocks keep a
    left factor ``L`` and a right factor ``R``; order-1 blocks (vectors) keep ``L`` only. Factors
    are stored per slab as ``(col_blocks, side, side)`` with ``side = slab_rows`` for ``L`` and
    ``block_cols`` for ``R`` (edge blocks zero-padded in the corner), and each slab's factors
    live on the rank holding the slab's first element."""

    rows: int
    cols: int
    slab_rows: int
    block_cols: int
    order: int = 2

    @classmethod
    def of(
        cls,
        shape: Sequence[int],
        max_dim: int,
        merge_dims: bool = False,
        precondition_1d: bool = False,
    ) -> ShampooBlocks:
        view = shampoo_matrix(shape, max_dim, merge_dims, precondition_1d)
        if view is None:
            raise ValueError(f"shape {tuple(shape)} is not preconditioned with blocks")
        rows, cols, order = view
        return cls(rows, cols, min(max_dim, rows), min(max_dim, cols), order)

    @property
    def dims(self) -> tuple[int, int]:
        """The blocked view: ``(rows, cols)``."""
        return (self.rows, self.cols)

    @property
    def sides(self) -> tuple[int, int]:
        """The block sides along ``dims``."""
        return (self.slab_rows, self.block_cols)

    @property
    def factors(self) -> tuple[str, ...]:
        """The factor sides this geometry keeps: ``("L", "R")``, or ``("L",)`` for vectors."""
        return ("L", "R") if self.order == 2 else ("L",)

    @property
    def num_slabs(self) -> int:
        return -(-self.rows // self.slab_rows)

    @property
    def col_blocks(self) -> int:
        return -(-self.cols // self.block_cols)

    @property
    def slab_numel(self) -> int:
        return self.slab_rows * self.cols

    def side(self, factor: str) -> int:
        """Side of the square factor blocks: ``"L"`` (rows of a slab) or ``"R"`` (columns)."""
        return self.slab_rows if factor == "L" else self.block_cols

    def factor_shape(self, factor: str) -> tuple[int, int, int, int]:
        side = self.side(factor)
        return (self.num_slabs, self.col_blocks, side, side)

    def factor_numel_per_slab(self, factor: str) -> int:
        return self.col_blocks * self.side(factor) ** 2

    def slab_range(self, i: int) -> tuple[int, int]:
        start = i * self.slab_numel
        return start, min(start + self.slab_numel, self.rows * self.cols)

    def slabs_starting_in(self, start: Any, stop: Any) -> Any:
        """Slabs whose first element lies in ``[start, stop)`` (the slabs whose factors a rank
        with that range keeps); ints or numpy arrays."""
        return -(-stop // self.slab_numel) - -(-start // self.slab_numel)

    def slab_owners(self, bounds: Sequence[int]) -> list[int]:
        """The rank holding each slab's first element, when rank ``r`` holds ``[bounds[r],
        bounds[r + 1])`` of the tensor."""
        return [bisect_right(bounds, i * self.slab_numel) - 1 for i in range(self.num_slabs)]
