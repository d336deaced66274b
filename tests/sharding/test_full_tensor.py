"""``RaggedTensor.full_tensor``: bit-exact on both of its paths (a padded all-gather for about
even pieces, a byte all-reduce for tensors only some ranks hold), and its bookkeeping linear in
W (no per-rank slices) at 100,000 ranks."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from raggedfsdp.sharding import RaggedShard, RaggedTensor
from tests.support.work import counted_lines


def _cases(world: int) -> dict[str, tuple[RaggedShard, torch.dtype]]:
    """Specs (and dtypes) that exercise both paths at this world size."""
    only_last = [0] * (world - 1) + [5]
    gaps = [2 if r % 2 == 0 else 0 for r in range(world)]
    return {
        "even": (RaggedShard.even((world * 3 + 1, 2), world, 2), torch.float32),
        "held by the last rank only": (
            RaggedShard.from_counts((5, 3), 3, only_last),
            torch.float32,
        ),
        "empty ranks between": (RaggedShard.from_counts((sum(gaps),), 1, gaps), torch.bfloat16),
        "bool": (RaggedShard.even((7,), world, 1), torch.bool),
        "no elements": (RaggedShard.even((4, 0), world, 1), torch.float32),
    }


def _values(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Distinct bit patterns, with -0.0 and a NaN with a payload among them."""
    if dtype == torch.bool:
        return torch.arange(numel) % 3 == 0
    bits = torch.arange(numel, dtype=torch.int32) * 7919 + 1
    values = bits.to(torch.float32).to(dtype) * (-1) ** torch.arange(numel)
    if numel > 2:
        values[1] = -0.0
        values[2] = torch.tensor(0x7FC01234, dtype=torch.int32).view(torch.float32).to(dtype)
    return values


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.numel() else t


def _gathered_bitwise() -> dict[str, bool]:
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name, (spec, dtype) in _cases(world).items():
        full = _values(spec.numel, dtype).view(spec.shape)
        start, stop = spec.local_range(rank)
        ragged = RaggedTensor(full.reshape(-1)[start:stop].clone(), spec, rank)
        gathered = ragged.full_tensor()
        out[name] = gathered.shape == full.shape and torch.equal(_bits(gathered), _bits(full))
    return out


@pytest.mark.parametrize("world_size", [3, 4])
def test_full_tensor_is_bit_exact_on_both_paths(pool):
    for rank, answers in enumerate(pool.run(_gathered_bitwise)):
        assert all(answers.values()), (rank, answers)


def test_a_tensor_few_ranks_hold_moves_its_own_bytes_not_w_times_its_longest_piece():
    """An even split gathers (W x longest = numel); a tensor on one rank of 100 reduces its
    bytes: a gather padded to its longest piece would move 100 times its size (at W = 100,000,
    every tensor of a planned group as much as the whole group's buffer)."""
    moved = []

    def record(kind):
        return lambda out, *a, **k: moved.append((kind, out.numel() * out.element_size()))

    with (
        mock.patch.object(dist, "all_gather_single", record("gather")),
        mock.patch.object(dist, "all_reduce", record("reduce")),
    ):
        even = RaggedShard.even((400,), 100, 1)
        RaggedTensor(torch.zeros(4), even, 7).full_tensor()
        alone = RaggedShard.from_counts((400,), 1, [0] * 99 + [400])
        RaggedTensor(torch.zeros(0), alone, 7).full_tensor()
    assert moved == [("gather", 400 * 4), ("reduce", 400 * 4)]


def test_full_tensor_bookkeeping_is_linear_at_100k_ranks():
    """The collectives replaced by no-ops: what is left is the bookkeeping, which sliced the
    gathered buffer once per rank (seconds per tensor at W = 100,000)."""
    world = 100_000
    specs = [
        RaggedShard.even((world * 4 + 3,), world, 1),  # about even: the padded gather
        RaggedShard.even((world // 2, 8), world, 8),  # half the ranks hold a row each
        RaggedShard.from_counts((64,), 1, [0] * 500 + [64] + [0] * (world - 501)),
    ]
    with (
        mock.patch.object(dist, "all_gather_single", lambda *a, **k: None),
        mock.patch.object(dist, "all_reduce", lambda *a, **k: None),
        counted_lines() as work,
    ):
        for spec in specs:
            rank = world // 3
            local = torch.zeros(spec.length(rank))
            assert RaggedTensor(local, spec, rank).full_tensor().shape == spec.shape
    # Lines of the package's Python, not seconds (deterministic under load): the spec's per-rank
    # precompute is about 2 lines per rank for the 3 specs; a slice per rank would add dozens.
    assert work.lines <= 5 * world, f"full_tensor ran {work.lines:,} lines at W={world:,}"
    assert math.prod(specs[0].shape) == sum(specs[0].lengths)
