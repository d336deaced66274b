"""``sharding.blocks``: the per-block state geometry, against brute-force counts."""

import math
import random

import numpy as np
import pytest

from raggedfsdp.sharding import RaggedShard
from raggedfsdp.sharding.blocks import QuantBlocks, ShampooBlocks
from raggedfsdp.sharding.units import quantized_unit, shampoo_policy, shampoo_slab_rows


def _aligned_ranges(numel: int, unit: int, world: int, rng: random.Random) -> list[tuple[int, int]]:
    units = -(-numel // unit)
    counts = [0] * world
    for _ in range(units):
        counts[rng.randrange(world)] += 1
    spec = RaggedShard.from_counts((numel,), unit, counts)
    return [spec.local_range(r) for r in range(world)]


@pytest.mark.parametrize("tile", [None, (4, 8)])
def test_quant_blocks_count_what_each_rank_overlaps(tile):
    rng = random.Random(0)
    for _ in range(40):
        shape = (rng.randint(1, 30), rng.randint(1, 40))
        blocks = QuantBlocks.of(shape, 16, tile)
        ranges = _aligned_ranges(math.prod(shape), quantized_unit(shape, 16, tile), 5, rng)
        counts = [blocks.counts(lo, hi) for lo, hi in ranges]
        grid = blocks.grid_shape
        assert sum(counts) * blocks.count_unit == math.prod(grid)  # every block on one rank
        for lo, hi in ranges:  # the quantizer's view of the piece holds as many blocks
            rows, cols, tr, tc = blocks.local_view(lo, hi)
            assert rows * cols == hi - lo
            assert -(-rows // tr) * -(-cols // tc) == blocks.counts(lo, hi) * blocks.count_unit
        lo, hi = np.array([a for a, _ in ranges]), np.array([b for _, b in ranges])
        assert blocks.counts(lo, hi).tolist() == counts  # numpy arrays: the same, at once


def test_quant_blocks_grid():
    assert QuantBlocks.of((10, 20), 64, None).grid_shape == (4,)  # 200 elements, 64 per block
    tiled = QuantBlocks.of((10, 20), 64, (4, 8))
    assert tiled.grid_shape == (3, 3) and tiled.count_unit == 3
    assert QuantBlocks.of((300,), 64, (4, 8)).grid_shape == (5,)  # vectors: 1-D blocks


def test_shampoo_blocks_geometry_and_owners():
    grid = ShampooBlocks.of((2, 35, 20), 16)  # a 70 x 20 view
    assert (grid.rows, grid.cols, grid.slab_rows, grid.block_cols) == (70, 20, 16, 16)
    assert (grid.num_slabs, grid.col_blocks, grid.slab_numel) == (5, 2, 320)
    assert grid.factor_shape("L") == (5, 2, 16, 16) and grid.factor_numel_per_slab("R") == 512
    assert grid.slab_range(4) == (1280, 1400)
    assert shampoo_policy(16)("w", np.zeros((2, 35, 20))) == shampoo_slab_rows((2, 35, 20), 16) * 20
    rng = random.Random(3)
    for _ in range(30):
        world = rng.randint(1, 6)
        cuts = sorted(rng.choice([0, 16, 17, 30, 32, 48, 70]) for _ in range(world - 1))
        rows = [b - a for a, b in zip([0, *cuts], [*cuts, 70], strict=True)]
        spec = RaggedShard.from_counts((70, 20), 20, rows)  # ragged, empty, slabs cut or not
        ranges = [spec.local_range(r) for r in range(spec.world_size)]
        bounds = [lo for lo, _ in ranges] + [1400]
        owners = grid.slab_owners(bounds)
        starts = range(0, 1400, 320)
        expected = [next(r for r, (a, b) in enumerate(ranges) if a <= s < b) for s in starts]
        assert owners == expected
        assert [grid.slabs_starting_in(a, b) for a, b in ranges] == [
            owners.count(r) for r in range(spec.world_size)
        ]
