"""RaggedShard: offsets, rows, checkpoint boxes and input validation."""

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedfsdp.sharding import Box, RaggedShard, flat_range_to_boxes, row_numel
from tests.support.work import counted_lines


def _flat_index(shape, idx):
    flat = 0
    for dim, i in zip(shape, idx, strict=True):
        flat = flat * dim + i
    return flat


def _covered(shape, boxes):
    """Flat indices covered by boxes, asserting no element is covered twice."""
    seen = []
    for box in boxes:
        ranges = [range(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True)]
        seen.extend(_flat_index(shape, idx) for idx in itertools.product(*ranges))
    assert len(seen) == len(set(seen)), "boxes overlap"
    return set(seen)


@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple),
    data=st.data(),
)
def test_boxes_cover_exactly_the_flat_range(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    boxes = flat_range_to_boxes(shape, start, stop)
    assert _covered(shape, boxes) == set(range(start, stop))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


@given(
    shape=st.lists(st.integers(0, 6), min_size=1, max_size=3).map(tuple),
    world=st.integers(1, 6),
    data=st.data(),
)
def test_ranks_tile_the_tensor_in_order(shape, world, data):
    numel = math.prod(shape)
    unit = data.draw(st.integers(1, max(numel, 1) + 2))
    n_units = -(-numel // unit)
    cuts = sorted(
        data.draw(st.lists(st.integers(0, n_units), min_size=world - 1, max_size=world - 1))
    )
    counts = [b - a for a, b in zip([0, *cuts], [*cuts, n_units], strict=True)]
    spec = RaggedShard.from_counts(shape, unit, counts)
    cursor = 0
    for r in range(world):
        start, stop = spec.local_range(r)
        assert start == cursor
        assert (start % unit == 0) or start == numel, "a rank starts inside a unit"
        assert _covered(shape, spec.boxes(r)) == set(range(start, stop))
        cursor = stop
    assert cursor == numel
    assert sum(spec.lengths) == numel


def test_last_unit_is_short_and_never_cut():
    # DeepSeek-V3's 576-row projection with 128-row blocks: 4.5 blocks.
    spec = RaggedShard.block_wise((576, 8), 3, block_rows=128)
    assert spec.num_units == 5
    assert spec.units_per_rank == (2, 2, 1)
    assert [spec.length(r) for r in range(3)] == [256 * 8, 256 * 8, 64 * 8]
    assert spec.row_range(2) == range(512, 576)


def test_constructors():
    assert RaggedShard.element_wise((10,), 3).lengths == (4, 3, 3)
    rows = RaggedShard.row_wise((5, 4), 2, rows=2)
    assert rows.unit == 8 and rows.units_per_rank == (2, 1)
    assert rows.row_range(0) == range(0, 4) and rows.row_range(1) == range(4, 5)
    experts = RaggedShard.slice_wise((3, 4, 5), 2)
    assert experts.unit == 20 and experts.lengths == (40, 20)
    # rows of a stacked expert tensor are rows of its matrices
    assert row_numel((3, 4, 5)) == 5 and row_numel((7,)) == 1 and row_numel(()) == 1
    empty = RaggedShard.from_counts((4, 2), 2, (0, 4, 0))
    assert empty.lengths == (0, 8, 0) and empty.boxes(0) == [] and empty.row_range(2) == range(0)
    assert empty.boxes(1) == [Box((0, 0), (4, 2))]
    assert RaggedShard.even((0, 3), 4, 3).lengths == (0, 0, 0, 0)


def test_more_ranks_than_units():
    spec = RaggedShard.row_wise((2, 3), 5)
    assert spec.units_per_rank == (1, 1, 0, 0, 0)
    assert spec.offset(4) == 6 and spec.length(4) == 0


def test_equality_ignores_the_name_and_is_hashable():
    a = RaggedShard.from_counts((4,), 1, (2, 2), name="x")
    b = RaggedShard.from_counts((4,), 1, (2, 2), name="y")
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.unit = 2  # immutable


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"unit": 0, "units_per_rank": (4,)}, "unit=0 must be a positive"),
        ({"unit": -2, "units_per_rank": (4,)}, "unit=-2 must be a positive"),
        ({"unit": 1, "units_per_rank": (5, -1)}, "non-negative"),
        ({"unit": 1, "units_per_rank": (1, 1)}, "sums to 2 .* 4 units"),
        ({"unit": 1, "units_per_rank": ()}, "one count per rank"),
    ],
)
def test_invalid_specs_name_the_tensor_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        RaggedShard(shape=(4,), name="layers.0.wq", **kwargs)
    assert "layers.0.wq" in str(err.value)


def test_invalid_world_size_and_rank():
    with pytest.raises(ValueError, match="world_size=0 must be an int >= 1"):
        RaggedShard.even((4,), 0, 1, name="w")
    with pytest.raises(IndexError, match="outside this shard's world of 2"):
        RaggedShard.element_wise((4,), 2).offset(2)
    with pytest.raises(ValueError, match="flat range"):
        flat_range_to_boxes((2, 2), 1, 5)


@given(
    shape=st.lists(st.integers(0, 6), min_size=1, max_size=3).map(tuple),
    world=st.integers(1, 12),
    data=st.data(),
)
def test_bounds_and_lengths_follow_the_unit_counts(shape, world, data):
    """The whole-tuple queries (computed without a loop over ranks) against their definition:
    rank r starts at ``min(units before it * unit, numel)``."""
    numel = math.prod(shape)
    unit = data.draw(st.integers(1, max(numel, 1) + 2))
    n_units = -(-numel // unit)
    cuts = sorted(
        data.draw(st.lists(st.integers(0, n_units), min_size=world - 1, max_size=world - 1))
    )
    counts = [b - a for a, b in zip([0, *cuts], [*cuts, n_units], strict=True)]
    spec = RaggedShard.from_counts(shape, unit, counts)
    before = itertools.accumulate(counts, initial=0)
    assert tuple(spec.bounds) == tuple(min(u * unit, numel) for u in before)
    assert spec.lengths == tuple(b - a for a, b in itertools.pairwise(spec.bounds))
    assert spec.lengths == tuple(spec.length(r) for r in range(world))


def test_every_rank_query_at_100k_ranks_takes_well_under_a_second():
    """Per-rank queries are O(1) after the spec's O(W) precompute; the whole-tuple ones are
    O(W) without a Python loop (at W = 100,000 ``lengths`` took an hour when each rank's
    offset was recomputed). A spec's repr stays short enough for an error message."""
    world = 100_000
    with counted_lines() as build:  # lines of the package's Python: deterministic under load
        spec = RaggedShard.even((16 * world + 5,), world, 4, name="w")  # a short last unit
        assert sum(spec.lengths) == spec.numel and spec.bounds[-1] == spec.numel
    assert build.lines <= 2 * world, f"building and the tuples: {build.lines:,} lines"
    with counted_lines() as queries:
        assert all(spec.length(r) == 4 * spec.units_per_rank[r] for r in range(world - 1))
        assert spec.local_range(world - 1) == (spec.numel - 13, spec.numel)  # 3 units and 1
    per_query = queries.lines / world
    assert per_query <= 8, f"{per_query:.1f} lines per rank query: not O(1)"
    assert len(repr(spec)) < 150 and "<99,992 more>" in repr(spec)
