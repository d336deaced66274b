"""Optimizer set-up at 100,000 ranks, without a process group.

A rank of a W-rank job builds, for its own pieces, what each optimizer needs to know about the
other ranks: Muon's owners and exchange plan, AdamW8bit's block grids, Shampoo's slab geometry
and the exchange of the slabs a layout cuts, the unit-alignment check. All of it must be linear
in W (per-rank queries O(1) after the spec's O(W) precompute), or a 100,000-rank job spends
minutes before its first step. Pieces here are those of rank ``W // 3`` of a planned layout
whose every rank holds a few dozen elements, so only the bookkeeping costs anything.

The cost is the number of lines of the package's Python that run (``tests/support/work.py``),
bounded per rank of W: deterministic on any machine, where a CPU-seconds budget flaked under
load. A per-rank pass costs a few lines per rank; a per-job or per-piece scan over every rank,
the bug these tests guard against, costs thousands. Times are in ``benchmarks/``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from raggedfsdp.optim import AdamW8bit, Muon, Shampoo
from raggedfsdp.optim.contract import Piece, check_unit_alignment
from raggedfsdp.optim.owner_compute import ExchangePlan
from raggedfsdp.sharding import RaggedShard, RaggedTensor, TensorSpec, plan_layout
from raggedfsdp.sharding.blocks import ShampooBlocks
from raggedfsdp.sharding.owners import Job, assign_owners, ns_flops
from tests.support.work import counted_lines

W = 100_000
RANK = W // 3


def _params(rows_per_unit: int = 1) -> list[tuple[str, nn.Parameter]]:
    """Rank ``RANK``'s pieces of two matrices and 4,096 stacked experts planned over W ranks:
    each matrix spans thousands of ranks, each expert a few dozen, each rank holds about 100
    elements."""
    shapes = {"wq": (W // 4, 64), "w1": (W // 2, 32), "experts": (4096, W // 4096, 64)}
    specs = [TensorSpec.rows(n, s, "float32", rows_per_unit) for n, s in shapes.items()]
    layout = plan_layout(specs, W)
    out = []
    for name in shapes:
        spec = layout.shards[name]
        local = torch.zeros(spec.length(RANK))
        out.append((name, nn.Parameter(RaggedTensor(local, spec, RANK))))
    return out


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Each optimizer built once at a tiny world first: torch imports parts of itself on first
    use, which is not the set-up being timed."""
    spec = RaggedShard.even((4, 4), 2, 4)
    for make in (Muon, AdamW8bit, Shampoo):
        make([nn.Parameter(RaggedTensor(torch.zeros(spec.length(0)), spec, 0))])


@contextmanager
def _linear_work(lines_per_rank: float, what: str) -> Iterator[None]:
    """At most ``lines_per_rank * W`` lines of the package run inside the block (today's code
    runs under half of each bound: about 9 lines per rank for Muon and AdamW8bit, 20 for
    Shampoo)."""
    with counted_lines() as work:
        yield
    budget = lines_per_rank * W
    assert work.lines <= budget, (
        f"{what} ran {work.lines:,} lines at W={W:,}: more than {lines_per_rank:g} per rank "
        f"({budget:,.0f}), so something scans the ranks per job or per piece"
    )


def _exchange(jobs: list[Job], owners: list[int]) -> ExchangePlan:
    plan = ExchangePlan(jobs, owners, RANK, W)
    index = plan.assemble(torch.arange(sum(plan.recv_splits)))  # where each element comes from
    assert sorted(index.tolist()) == list(range(sum(plan.recv_splits)))
    return plan


def test_muon_owner_plan_for_one_rank():
    """What Muon's first step plans: one job per matrix (per expert: 4,096 here), LPT owners,
    the exchange, from the constructor's pieces."""
    params = _params()
    with _linear_work(20, "Muon set-up"):
        Muon(params)
        jobs = []
        for _, p in params:
            spec = p.ragged_shard
            count, (m, n) = (p.shape[0], p.shape[1:]) if p.dim() == 3 else (1, p.shape)
            cost = float(ns_flops(m, n, 5))
            jobs += [
                Job.spanning(e * m * n, (e + 1) * m * n, spec.bounds, cost) for e in range(count)
            ]
        _exchange(jobs, assign_owners(jobs, W))


def test_adamw8bit_block_grids_for_one_rank():
    params = _params(rows_per_unit=4)
    with _linear_work(20, "AdamW8bit set-up"):
        opt = AdamW8bit(params, block_size=128, min_8bit_size=1)
    for _, p in params:
        absmax = opt.state[p]["exp_avg_absmax"]
        assert absmax.ragged_shard.world_size == W


def test_shampoo_geometry_and_cut_slab_exchange_for_one_rank():
    """An element-wise layout cuts most 16-row slabs: thousands of owner-compute jobs, whose
    exchange plan looped over every rank for every job."""
    params = _params()
    with _linear_work(45, "Shampoo set-up"):
        Shampoo(params, max_preconditioner_dim=16)
        jobs, owners = [], []
        for _, p in params:
            spec, blocks = p.ragged_shard, ShampooBlocks.of(p.shape, 16)
            slab_owners = blocks.slab_owners(spec.bounds)
            for i in range(blocks.num_slabs):
                job = Job.spanning(*blocks.slab_range(i), spec.bounds, 1.0)
                if job.sole_holder is None:
                    jobs.append(job)
                    owners.append(slab_owners[i])
        plan = _exchange(jobs, owners)
    assert len(jobs) > 1000 and plan.send_order


def test_unit_alignment_check_is_free_when_the_policy_was_followed():
    params = _params(rows_per_unit=4)
    pieces = [Piece(p, n, 0, "fsdp", p.ragged_shard, RANK) for n, p in params]
    with counted_lines() as work:
        for _ in range(100):  # once per parameter of a 100-layer model
            for pc in pieces:
                check_unit_alignment(pc, 128, "a block")
    calls = 100 * len(pieces)
    assert work.lines <= 6 * calls, f"{work.lines:,} lines for {calls} checks: not O(1) each"
    cut = Piece(params[0][1], "wq", 0, "fsdp", RaggedShard.even((W // 4, 64), W, 1), RANK)
    with pytest.raises(ValueError, match="rank 1's piece starting at element 16, which cuts"):
        check_unit_alignment(cut, 128, "a block")


# ----------------------------------------------------------------------------- exchange plan
def _scan_plan(jobs: list[Job], owners: list[int], rank: int, world: int) -> tuple[list, list]:
    """``send_order`` and where ``assemble`` takes each element from, stated the slow, obvious
    way (a scan over every rank for every job): the oracle for the one-pass plan."""
    moved = [j for j, (job, o) in enumerate(zip(jobs, owners, strict=True)) if job.sole_holder != o]
    send_order = [
        j for o in range(world) for j in moved if owners[j] == o and jobs[j].held_by(rank)
    ]
    owned = [j for j in moved if owners[j] == rank]
    offset, cursor = {}, 0
    for src in range(world):
        for j in owned:
            if n := jobs[j].held_by(src):
                offset[(src, j)] = cursor
                cursor += n
    index = [offset[(r, j)] + i for j in owned for r, n in jobs[j].pieces for i in range(n)]
    return send_order, index


@pytest.mark.parametrize("seed", range(4))
def test_exchange_plan_equals_the_scan_over_ranks(seed):
    rng = random.Random(seed)
    world = rng.choice([2, 5, 16, 61])
    jobs = []
    for _ in range(40):
        counts = [0] * world
        first, spread = rng.randrange(world), rng.choice([1, 2, 3, world])
        for _ in range(rng.randint(0, 9)):
            counts[min(world - 1, first + rng.randrange(spread))] += 1
        lengths = RaggedShard.from_counts((sum(counts), 2), 2, counts).lengths
        jobs.append(Job(tuple((r, n) for r, n in enumerate(lengths) if n), rng.random()))
    owners = assign_owners(jobs, world)
    for rank in range(world):
        plan = ExchangePlan(jobs, owners, rank, world)
        send_order, index = _scan_plan(jobs, owners, rank, world)
        assert plan.send_order == send_order
        assert plan.assemble(torch.arange(sum(plan.recv_splits))).tolist() == index
