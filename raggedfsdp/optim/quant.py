"""Block-wise 8-bit quantization of optimizer states (bitsandbytes / torchao format).

Each block of a state tensor stores one fp32 ``absmax`` and one uint8 code per element; an
element's value is ``qmap[code] * absmax``. The code maps are bitsandbytes' *dynamic* maps (a
decimal exponent plus a linear fraction, 256 points in [-1, 1] for the signed first moment and in
[0, 1] for the unsigned second moment), so states can be compared with, or converted to, theirs.

Quantizing picks the nearest code, ties going up, with the same fp32 arithmetic as torchao (the
half-way test ``x - lo >= (hi - lo) * 0.5``): results are bitwise those of
``torchao.optim.AdamW8bit``, not merely close. That rule is a step function of ``x`` with 255
steps, so it is computed as one lookup in a table of those steps (``QuantMap.table``).

A *block* is a ``tile_rows x tile_cols`` tile of a 2-D view of the flat piece being quantized;
1-D blocks of ``B`` elements are the ``1 x B`` case. Tiles at the right and bottom edges may be
partial, which is how a tensor whose size is not a multiple of the block is handled. Blocks are
always counted from the start of the *parameter*, and the sharding policy keeps every block on
one rank, so quantizing a rank's piece needs no communication and gives the same codes at any
world size.

``quantize_blocks_`` and ``dequantize_blocks`` work on one region of whole blocks viewed as
``(block rows, tile rows, block cols, tile cols)``; the eager ``quantize_`` / ``dequantize_`` loop
over a piece's regions, and the fused 8-bit AdamW step compiles them inside its per-region update.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import einops
import torch
from torch import Tensor

__all__ = [
    "BlockGrid",
    "QuantMap",
    "dequantize_",
    "dequantize_blocks",
    "dynamic_map",
    "nearest_codes",
    "quantize_",
    "quantize_blocks_",
    "rounding_steps",
]

#: Floor of a block's scale, as in bitsandbytes and torchao: an all-zero block must not divide
#: by zero.
MIN_ABSMAX = 1e-12

_SIGN_OFF = 0x7FFFFFFF  # xor with this (negatives only) turns fp32 bits into an ordered int
_BUCKET_BITS = 16  # the table has one entry per value of the ordered int's top 16 bits
_LOW_MASK = (1 << _BUCKET_BITS) - 1
_NO_STEP = 1 << _BUCKET_BITS  # "no step inside this bucket": larger than any low half
_STEP_BITS = _BUCKET_BITS + 1  # an entry is code << 17 | the step's low half (or _NO_STEP)


# ----------------------------------------------------------------------------- the math
def quantize_blocks_(values: Tensor, codes: Tensor, scales: Tensor, qmap: QuantMap) -> None:
    """Quantize one region of fp32 ``values`` viewed as ``(br, tr, bc, tc)`` blocks: each
    block's scale (``scales``, ``(br, 1, bc, 1)``) is its largest magnitude, each element's code
    (``codes``, uint8, the values' shape) the map point nearest to ``value / scale``."""
    scale = values.abs().amax(dim=(1, 3), keepdim=True).clamp_min(MIN_ABSMAX)
    scales.copy_(scale)
    codes.copy_(nearest_codes(values / scale, qmap))


def dequantize_blocks(
    codes: Tensor, scales: Tensor, qmap: QuantMap, out: Tensor | None = None
) -> Tensor:
    """``qmap[code] * scale`` for one region (the shapes of ``quantize_blocks_``), into ``out``
    when given."""
    return torch.mul(_lookup(qmap.values, codes.int()), scales, out=out)


def nearest_codes(scaled: Tensor, qmap: QuantMap) -> Tensor:
    """Code (int32) of the map point nearest to each value of ``scaled`` (in [-1, 1]).

    The fp32 bits of a value, read as an integer ordered like the values themselves, select a
    table entry by their top 16 bits: the code of the bucket's smallest value, plus one if the
    value is at or past the one rounding step that can lie inside the bucket (compared on the
    low 16 bits). Same results as torchao's binary search and half-way test, in one lookup.
    In-place steps on the temporaries: eagerly, allocating a fresh one per step costs more than
    the arithmetic (half the time here); compiled, they fuse either way.
    """
    bits = scaled.view(torch.int32)
    ordered = bits.bitwise_right_shift(31).bitwise_and_(_SIGN_OFF).bitwise_xor_(bits)
    bucket = ordered.bitwise_right_shift(_BUCKET_BITS).add_(1 << (_BUCKET_BITS - 1))
    entry = _lookup(qmap.table, bucket)
    past = ordered.bitwise_and_(_LOW_MASK).ge_(entry & (_NO_STEP | _LOW_MASK))
    return entry.bitwise_right_shift_(_STEP_BITS).add_(past)


def _lookup(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` for indices known to be in range: ``index_select`` eagerly (the fastest
    gather on CPU), and under ``torch.compile`` the unchecked index, so inductor emits no bounds
    assertion inside the fused loop."""
    if torch.compiler.is_compiling():
        return torch.ops.aten._unsafe_index(table, [index])
    return table.index_select(0, index.reshape(-1)).view(index.shape)


def quantize_(values: Tensor, grid: BlockGrid, codes: Tensor, absmax: Tensor, qmap: QuantMap):
    """Quantize the flat fp32 ``values`` into ``codes`` (uint8, same size) and ``absmax`` (one
    fp32 per block, flat), region by region of ``grid``."""
    for region in grid.regions():
        quantize_blocks_(
            grid.blocks(values, *region),
            grid.blocks(codes, *region),
            grid.scales(absmax, *region),
            qmap,
        )


def dequantize_(out: Tensor, grid: BlockGrid, codes: Tensor, absmax: Tensor, qmap: QuantMap):
    """Write ``qmap[code] * absmax`` into the flat fp32 ``out``."""
    for region in grid.regions():
        dequantize_blocks(
            grid.blocks(codes, *region),
            grid.scales(absmax, *region),
            qmap,
            out=grid.blocks(out, *region),
        )


# ----------------------------------------------------------------------------- the code maps
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


def rounding_steps(values: Tensor) -> Tensor:
    """The 255 fp32 values where nearest-code rounding steps up: ``steps[k]`` is the smallest
    fp32 ``x`` above ``values[k]`` with ``x - values[k] >= (values[k+1] - values[k]) * 0.5`` in
    fp32 arithmetic. The fp32 difference never decreases as ``x`` grows, so the code of ``x`` is
    the number of steps at or below it; found by bisection over the ordered fp32 bit patterns."""
    low, high = values[:-1], values[1:]
    half_gap = (high - low) * 0.5
    lo, hi = _ordered(low), _ordered(high)  # the test fails at lo and holds at hi
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        holds = (_from_ordered(mid) - low) >= half_gap
        hi, lo = torch.where(holds, mid, hi), torch.where(holds, lo, mid)
    return _from_ordered(hi)


def _ordered(x: Tensor) -> Tensor:
    """fp32 values as int64 keys in the same order (negative floats have their magnitude bits
    flipped)."""
    bits = x.view(torch.int32).long()
    return torch.where(bits < 0, bits ^ _SIGN_OFF, bits)


def _from_ordered(key: Tensor) -> Tensor:
    """Inverse of ``_ordered`` (int64 keys in the int32 range)."""
    bits = torch.where(key < 0, key ^ _SIGN_OFF, key)
    return bits.to(torch.int32).view(torch.float32)


@dataclass(frozen=True)
class QuantMap:
    """A code map on one device, with the table that makes nearest-code search one lookup.

    ``values``: the 256 fp32 points. ``table``: int32, one entry per bucket of 65,536
    consecutive fp32 values (in value order, ``nearest_codes``), ``code << 17 | low``: the code
    of the bucket's smallest value, and the low 16 bits of the one rounding step inside the
    bucket (``1 << 16``: none). The dynamic maps' steps are far enough apart that a bucket
    holds at most one (checked when the table is built). Non-finite values get the codes of
    the table's ends, as with the half-way test.

    ``compact``, ``lo``, ``hi``: the same entries for the CPU kernel of the fused step, small
    enough to stay in L1 (~23 KB instead of 256 KB): a bucket is a sign and the top 15 bits of
    the magnitude (``|bits| >> 16``); magnitudes are clamped to ``[lo, hi]``, outside of which
    the entries do not change (tiny values round to zero, values past 1 to the end codes);
    negative buckets come first (``hi - m``), then positive ones (``span + m - lo``), then one
    entry for infinities and NaN. Built from ``table`` and checked against it for all 65,536
    buckets, so both give the same codes for every fp32 input.
    """

    values: Tensor
    table: Tensor
    compact: Tensor
    lo: int
    hi: int

    @staticmethod
    @functools.cache
    def get(signed: bool, device: torch.device) -> QuantMap:
        values = dynamic_map(signed)
        steps = rounding_steps(values)
        first = (torch.arange(1 << _BUCKET_BITS) - (1 << (_BUCKET_BITS - 1))) << _BUCKET_BITS
        lowest, highest = _from_ordered(first), _from_ordered(first | _LOW_MASK)
        code = torch.searchsorted(steps, lowest, right=True)  # NaN sorts last: code 255
        inside = torch.searchsorted(steps, highest, right=True) - code
        inside[~(lowest.isfinite() & highest.isfinite())] = 0
        if int(inside.max()) > 1:
            raise AssertionError("two rounding steps share a bucket: widen the table")
        step = steps[code.clamp(max=steps.numel() - 1)]
        low = torch.where(inside > 0, _ordered(step) & _LOW_MASK, _NO_STEP)
        table = ((code << _STEP_BITS) | low).to(torch.int32)
        compact, lo, hi = _compact(table)
        return QuantMap(values.to(device), table.to(device), compact.to(device), lo, hi)


_FINITE_BUCKETS = 0x7F80  # magnitude buckets below the one of infinity


def compact_index(bits: Tensor, lo: int, hi: int) -> Tensor:
    """Index into ``QuantMap.compact`` of fp32 values given as int32 ``bits`` (int64 result)."""
    bits = bits.long()
    magnitude = bits & 0x7FFFFFFF
    bucket = (magnitude >> _BUCKET_BITS).clamp(lo, hi)
    span = hi - lo + 1
    index = torch.where(bits < 0, hi - bucket, span + bucket - lo)
    return torch.where(magnitude >= _FINITE_BUCKETS << _BUCKET_BITS, 2 * span, index)


def _compact(table: Tensor) -> tuple[Tensor, int, int]:
    """``table`` restricted to the magnitude buckets where it changes (``QuantMap``)."""
    middle = 1 << (_BUCKET_BITS - 1)
    magnitudes = torch.arange(_FINITE_BUCKETS)
    sides = (table[middle - 1 - magnitudes], table[middle + magnitudes])  # negative, positive
    changes = torch.cat([(s[1:] != s[:-1]).nonzero().flatten() for s in sides])
    lo, hi = int(changes.min()), int(changes.max()) + 1
    kept = torch.arange(lo, hi + 1)
    nonfinite = table[middle + _FINITE_BUCKETS]  # +inf: the codes of every inf and NaN
    compact = torch.cat([sides[0][kept.flip(0)], sides[1][kept], nonfinite.view(1)])
    every = torch.arange(-middle, middle, dtype=torch.int32) << _BUCKET_BITS  # a value per bucket
    if not torch.equal(
        compact[compact_index(_from_ordered(every).view(torch.int32), lo, hi)], table
    ):
        raise AssertionError("the compact nearest-code table disagrees with the full one")
    return compact, lo, hi


# ----------------------------------------------------------------------------- the geometry
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

    def regions(self) -> Iterator[tuple[slice, slice, int, int]]:
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

    def scales(self, absmax: Tensor, rows: slice, cols: slice, *_: int) -> Tensor:
        """The region's part of the absmax grid as a ``(block rows, 1, block cols, 1)`` view of
        ``absmax``: one scale per tile of ``blocks``, broadcast over the tile."""
        grid = absmax.view(self.grid)
        r0, c0 = rows.start // self.tile_rows, cols.start // self.tile_cols
        r1, c1 = -(-rows.stop // self.tile_rows), -(-cols.stop // self.tile_cols)
        return einops.rearrange(grid[r0:r1, c0:c1], "br bc -> br 1 bc 1")
