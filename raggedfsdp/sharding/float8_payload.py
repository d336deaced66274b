"""The byte payload of a block-wise FP8 all-gather: what each rank sends, where, in how many bytes.

With ``Float8Blocks`` or ``MXFP8Blocks`` the group's all-gather moves bytes instead of
``param_dtype`` elements. Each rank's segment of the payload holds, for every piece of a tensor
the rank owns (in the order of its segment of the planned layout):

* an eligible weight's piece (whole tile rows, thanks to the units of ``float8_block_policy``):
  one FP8 code byte per element, then one scale per tile (``scale_bytes`` each: an fp32 scale
  per 128x128 tile, or an e8m0 byte per MXFP8 1x32 block);
* any other tensor's piece: its elements in the compute dtype, as the plain gather sends them.

Padding between tensors is not sent. Every region starts at a multiple of ``alignment`` bytes,
so each can be viewed as its dtype in place. All segments have the size of the largest rank's
content, so the payload is one equal-segment all-gather: scales need no collective of their
own, and every rank can find every other rank's pieces from the layout alone.

Pure Python: the capacity planner reports the same bytes as the runtime sends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from raggedfsdp.sharding.planner import DEFAULT_ALIGNMENT_BYTES, Layout
from raggedfsdp.sharding.units import Float8Tile, float8_tiles, tile_shape

__all__ = [
    "FP8_BLOCK",
    "MX_BLOCK",
    "MX_SCALE_BYTES",
    "SCALE_BYTES",
    "Float8Payload",
    "PayloadPiece",
    "eligible_tiles",
]

# The two formats' geometry, shared by the runtime's policies (``Float8Blocks``,
# ``MXFP8Blocks``) and the capacity planner's ``--all-gather`` kinds.
#: DeepSeek-V3's tile side: ``Float8Blocks()``'s default; one fp32 scale per tile.
FP8_BLOCK = 128
#: Bytes of one 128x128 tile's scale (fp32).
SCALE_BYTES = 4
#: Elements of one MXFP8 block along a row (OCP MX v1.0), and its e8m0 scale's bytes.
MX_BLOCK = 32
MX_SCALE_BYTES = 1


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def eligible_tiles(layout: Layout, block: Float8Tile) -> dict[str, tuple[int, int]]:
    """``float8_tiles`` of the layout's tensors that are quantized (the ``tiles`` argument of
    ``Float8Payload``); the others travel in the compute dtype."""
    tiles = {t.name: float8_tiles(t.name, t.shape, block) for t in layout.tensors}
    return {name: tile for name, tile in tiles.items() if tile is not None}


@dataclass(frozen=True)
class PayloadPiece:
    """One rank's piece of one tensor in the payload.

    ``tensor_offset``/``numel`` locate it in the tensor (flat, row-major); ``data_offset`` is its
    first byte in the rank's payload segment. For a quantized piece (``tiles`` not None) the
    data are ``numel`` FP8 codes of a ``(matrices, rows, cols)`` block and ``scale_offset`` the
    first byte of its ``matrices x tile rows x tile cols`` scales; otherwise the data are
    ``numel`` elements in the compute dtype.
    """

    name: str
    tensor_offset: int
    numel: int
    data_offset: int
    tiles: tuple[int, int, int] | None = None  # (matrices, rows, cols) of the piece
    scale_offset: int = 0
    num_scales: int = 0


class Float8Payload:
    """Per-rank payload pieces and segment size for one planned group.

    Args:
        layout: the group's plan (its units must keep tiles whole: checked here).
        tiles: ``name -> (matrix rows, row length)`` for the quantized tensors
            (``float8_tiles``); the others travel in the compute dtype.
        block: a square tile's side, or ``(rows, cols)`` of a tile (``(1, 32)``: MXFP8).
        raw_itemsize: bytes per element of the compute dtype.
        alignment: byte alignment of every region and of the segment size.
        scale_bytes: bytes of one tile's scale (4: fp32; 1: e8m0).
    """

    def __init__(
        self,
        layout: Layout,
        tiles: Mapping[str, tuple[int, int]],
        block: Float8Tile,
        raw_itemsize: int,
        alignment: int = DEFAULT_ALIGNMENT_BYTES,
        scale_bytes: int = SCALE_BYTES,
    ) -> None:
        self.layout = layout
        self.tiles = dict(tiles)
        self.tile = tile_shape(block, "Float8Payload")
        self.raw_itemsize = raw_itemsize
        self.alignment = alignment
        self.scale_bytes = scale_bytes
        for name in self.tiles:
            unit, band = layout.by_name[name].unit, self._band_rows(name) * self.tiles[name][1]
            if unit % band:
                raise ValueError(
                    f"tensor {name!r} has unit {unit} elements, which cuts its "
                    f"{self.tile[0]}x{self.tile[1]} FP8 tiles (need a multiple of {band}); "
                    "combine the shard policy with float8_block_policy(block)"
                )

    def _band_rows(self, name: str) -> int:
        """Rows a piece starts at multiples of: a tile's rows in a tensor that is one tile
        matrix, a whole matrix where tiles restart at each (unaligned experts)."""
        return self.tile[0] if self._one_matrix(name) else self.tiles[name][0]

    def _one_matrix(self, name: str) -> bool:
        """Whether tensor ``name``'s tiles run over all its rows (one tile matrix) rather than
        restart at each of several matrices."""
        matrix_rows, cols = self.tiles[name]
        return matrix_rows == self.layout.by_name[name].numel // cols

    def grid(self, rows: int, cols: int) -> tuple[int, int]:
        """Tiles down and across one ``rows x cols`` matrix (partial edge tiles count)."""
        tile_rows, tile_cols = self.tile
        return -(-rows // tile_rows), -(-cols // tile_cols)

    @cached_property
    def pieces(self) -> tuple[tuple[PayloadPiece, ...], ...]:
        """Every rank's pieces, in segment order: one pass over the tensors (a tensor's ranks
        are the segments its range touches)."""
        seg = self.layout.segment_size
        spans: list[list[tuple[int, str, int, int]]] = [[] for _ in range(self.layout.world_size)]
        for t in self.layout.tensors:
            start = self.layout.offsets[t.name]
            for rank in range(start // seg, (start + t.numel - 1) // seg + 1 if t.numel else 0):
                lo, hi = max(start, rank * seg), min(start + t.numel, (rank + 1) * seg)
                spans[rank].append((lo, t.name, lo - start, hi - lo))
        return tuple(self._place(sorted(rank_spans)) for rank_spans in spans)

    def _place(self, spans: list[tuple[int, str, int, int]]) -> tuple[PayloadPiece, ...]:
        """Byte offsets of one rank's pieces, each region aligned."""
        placed, cursor, a = [], 0, self.alignment
        for _, name, offset, numel in spans:
            if name not in self.tiles:
                placed.append(PayloadPiece(name, offset, numel, cursor))
                cursor = _align(cursor + numel * self.raw_itemsize, a)
                continue
            matrix_rows, cols = self.tiles[name]
            rows = numel // cols
            if self._one_matrix(name):  # a band of tile rows
                shape = (1, rows, cols)
            else:  # whole matrices
                shape = (rows // matrix_rows, matrix_rows, cols)
            scales = shape[0] * math.prod(self.grid(shape[1], cols))
            scale_offset = _align(cursor + numel, a)
            placed.append(PayloadPiece(name, offset, numel, cursor, shape, scale_offset, scales))
            cursor = _align(scale_offset + scales * self.scale_bytes, a)
        return tuple(placed)

    def rank_bytes(self, rank: int) -> int:
        """Bytes of ``rank``'s content (its segment is ``segment_bytes``)."""
        pieces = self.pieces[rank]
        if not pieces:
            return 0
        last = pieces[-1]
        end = (
            last.scale_offset + last.num_scales * self.scale_bytes
            if last.tiles
            else last.data_offset + last.numel * self.raw_itemsize
        )
        return _align(end, self.alignment)

    @cached_property
    def segment_bytes(self) -> int:
        """Bytes per rank of the all-gather: the largest rank's content (at least one alignment
        unit, so an all-empty group still has a valid buffer)."""
        return max(self.alignment, *(self.rank_bytes(r) for r in range(self.layout.world_size)))

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the gathered payload (``W`` segments)."""
        return self.layout.world_size * self.segment_bytes

    @property
    def quantized_numel(self) -> int:
        return sum(self.layout.by_name[name].numel for name in self.tiles)

    @property
    def content_bytes(self) -> int:
        """Bytes of real data over all ranks: codes, scales and compute-dtype tensors."""
        return sum(self.rank_bytes(r) for r in range(self.layout.world_size))
