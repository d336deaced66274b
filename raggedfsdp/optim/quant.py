"""Block-wise 8-bit quantization of optimizer states (bitsandbytes / torchao format).

Each block of a state tensor stores one fp32 ``absmax`` and one uint8 code per element; an
element's value is ``qmap[code] * absmax``. The code maps are bitsandbytes' *dynamic* maps (a
decimal exponent plus a linear fraction, 256 points in [-1, 1] for the signed first moment and in
[0, 1] for the unsigned second moment), so states can be compared with, or converted to, theirs.

Quantizing picks the nearest code, ties going up, with the same fp32 arithmetic as torchao (the
half-way test ``x - lo >= (hi - lo) * 0.5``): results are bitwise those of
``torchao.optim.AdamW8bit``, not merely close.

A *block* is a ``tile_rows x tile_cols`` tile of a 2-D view of the flat piece being quantized;
1-D blocks of ``B`` elements are the ``1 x B`` case. Tiles at the right and bottom edges may be
partial, which is how a tensor whose size is not a multiple of the block is handled. Blocks are
always counted from the start of the *parameter*, and the sharding policy keeps every block on
one rank, so quantizing a rank's piece needs no communication and gives the same codes at any
world size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import einops
import torch
from torch import Tensor

__all__ = ["BlockGrid", "QuantMap", "dequantize_", "dynamic_map", "nearest_codes", "quantize_"]

#: Floor of a block's scale, as in bitsandbytes and torchao: an all-zero block must not divide
#: by zero.
MIN_ABSMAX = 1e-12


def quantize_(values: Tensor, grid: BlockGrid, codes: Tensor, absmax: Tensor, qmap: QuantMap):
    """Quantize the flat fp32 ``values`` into ``codes`` (uint8, same size) and ``absmax`` (one
    fp32 per block, flat): each block's scale is its largest magnitude, each element's code the
    map point nearest to ``value / scale``."""
    for rows, cols, tr, tc in grid.regions():
        x = grid.blocks(values, rows, cols, tr, tc)
        scale = x.abs().amax(dim=(1, 3), keepdim=True).clamp_min(MIN_ABSMAX)  # one per tile
        grid.scales(absmax, rows, cols).copy_(scale)
        grid.blocks(codes, rows, cols, tr, tc).copy_(nearest_codes(x / scale, qmap))


def dequantize_(out: Tensor, grid: BlockGrid, codes: Tensor, absmax: Tensor, qmap: QuantMap):
    """Write ``qmap[code] * absmax`` into the flat fp32 ``out``."""
    for rows, cols, tr, tc in grid.regions():
        c = grid.blocks(codes, rows, cols, tr, tc)
        values = qmap.values.index_select(0, c.reshape(-1).int()).view(c.shape)
        torch.mul(values, grid.scales(absmax, rows, cols), out=grid.blocks(out, rows, cols, tr, tc))


def dynamic_map(signed: bool) -> Tensor:
    """bitsandbytes' dynamic 8-bit map (``create_dynamic_map(signed)``, 7 exponent bits), fp32.

    For each decade ``10**-6 .. 10**0`` the fraction interval [0.1, 1] is cut into ``2**k``
    (signed) or ``2**(k+1)`` (unsigned) equal parts and their midpoints are the code values; the
    signed map mirrors them below zero; 0 and 1 complete the 256 points. The arithmetic (fp32
    ``linspace``, fp32 midpoints and products) is the reference's, so the values agree bitwise.
    """
    values: list[float] = [0.0, 1.0]
    for k in range(7):
        parts = 2**k if signed else 2 ** (k + 1)
        edges = torch.linspace(0.1, 1, parts + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        decade = mids * (10 ** (k - 6))
        values += decade.tolist()
        if signed:
            values += (-decade).tolist()
    if len(values) != 256:
        raise AssertionError(f"dynamic map has {len(values)} points, expected 256")
    return torch.tensor(sorted(values), dtype=torch.float32)


@dataclass(frozen=True)
class QuantMap:
    """A code map on one device, with the tables that make nearest-code search cheap.

    ``half_gap[k] = (values[k + 1] - values[k]) * 0.5`` in fp32, +inf for the last code so it
    never rounds up; ``upper[k] = values[k + 1]`` (+inf for the last). ``start`` maps the top 16
    bits of an fp32 value (sign, exponent, 7 mantissa bits) to the last code not above the
    smallest value with those bits; at most ``steps`` more points lie inside such a bucket, so a
    value's last code not above it is ``start`` plus at most ``steps`` one-comparison steps
    (a binary search over 256 points, ``torch.searchsorted``, is several times slower on CPU).
    """

    values: Tensor
    half_gap: Tensor
    upper: Tensor
    start: Tensor
    steps: int

    @staticmethod
    @functools.cache
    def get(signed: bool, device: torch.device) -> QuantMap:
        values = dynamic_map(signed)
        inf = torch.tensor([float("inf")])
        half_gap = torch.cat([(values[1:] - values[:-1]) * 0.5, inf])
        upper = torch.cat([values[1:], inf])
        keys = torch.arange(1 << 16, dtype=torch.int64)
        negative = keys >= 1 << 15
        # smallest and largest value of each bucket (negative floats grow in magnitude with bits)
        low_bits = torch.where(negative, (keys << 16) | 0xFFFF, keys << 16)
        high_bits = torch.where(negative, keys << 16, (keys << 16) | 0xFFFF)
        lowest, highest = (_as_float(b) for b in (low_bits, high_bits))
        start = (torch.searchsorted(values, lowest, right=True) - 1).clamp_(0, 255)
        last = (torch.searchsorted(values, highest, right=True) - 1).clamp_(0, 255)
        finite = lowest.isfinite() & highest.isfinite()
        steps = int((last - start)[finite].max())
        return QuantMap(
            values.to(device),
            half_gap.to(device),
            upper.to(device),
            start.to(device=device, dtype=torch.int32),
            steps,
        )


def _as_float(bits: Tensor) -> Tensor:
    """fp32 values of unsigned 32-bit patterns given as int64."""
    signed = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return signed.to(torch.int32).view(torch.float32)


def nearest_codes(scaled: Tensor, qmap: QuantMap) -> Tensor:
    """Code (int32) of the map point nearest to each value of ``scaled`` (in [-1, 1]).

    ``lo`` is the last point not above the value (0 below the first point); the value rounds up
    to ``lo + 1`` when it is at least half-way there, computed in fp32 as the reference does.
    """
    flat = scaled.reshape(-1)
    key = flat.view(torch.int32).bitwise_right_shift(16).bitwise_and_(0xFFFF)
    lo = qmap.start.index_select(0, key)
    for _ in range(qmap.steps):
        lo += flat >= qmap.upper.index_select(0, lo)
    lo += (flat - qmap.values.index_select(0, lo)) >= qmap.half_gap.index_select(0, lo)
    return lo.view(scaled.shape)


@dataclass(frozen=True)
class BlockGrid:
    """How a flat piece of ``rows * cols`` elements is cut into ``tile_rows x tile_cols`` blocks.

    The piece is viewed as ``(rows, cols)`` row-major; its absmax tensor is the
    ``(ceil(rows / tile_rows), ceil(cols / tile_cols))`` grid of blocks, stored flat. 1-D blocks
    of ``B`` elements over a piece of ``n`` elements are ``BlockGrid(1, n, 1, B)``.
    """

    rows: int
    cols: int
    tile_rows: int
    tile_cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def grid(self) -> tuple[int, int]:
        return -(-self.rows // self.tile_rows), -(-self.cols // self.tile_cols)

    @property
    def num_blocks(self) -> int:
        r, c = self.grid
        return r * c

    def regions(self):
        """Yield ``(rows, cols, block_rows, block_cols)`` slices covering the piece with regular
        tilings: the whole tiles, then the partial right column, bottom row and corner."""
        r_main = self.rows - self.rows % self.tile_rows
        c_main = self.cols - self.cols % self.tile_cols
        for r0, r1, tr in ((0, r_main, self.tile_rows), (r_main, self.rows, self.rows - r_main)):
            for c0, c1, tc in (
                (0, c_main, self.tile_cols),
                (c_main, self.cols, self.cols - c_main),
            ):
                if r1 > r0 and c1 > c0:
                    yield slice(r0, r1), slice(c0, c1), tr, tc

    def blocks(self, flat: Tensor, rows: slice, cols: slice, tr: int, tc: int) -> Tensor:
        """The region as a ``(block rows, tr, block cols, tc)`` view of ``flat``: writes to it
        land in ``flat``."""
        region = flat.view(self.rows, self.cols)[rows, cols]
        return einops.rearrange(region, "(br tr) (bc tc) -> br tr bc tc", tr=tr, tc=tc)

    def scales(self, absmax: Tensor, rows: slice, cols: slice) -> Tensor:
        """The region's part of the absmax grid as a ``(block rows, 1, block cols, 1)`` view of
        ``absmax``: one scale per tile of ``blocks``, broadcast over the tile."""
        grid = absmax.view(self.grid)
        r0, c0 = rows.start // self.tile_rows, cols.start // self.tile_cols
        r1, c1 = -(-rows.stop // self.tile_rows), -(-cols.stop // self.tile_cols)
        return einops.rearrange(grid[r0:r1, c0:c1], "br bc -> br 1 bc 1")
