"""``sharding.owners``: jobs from flat intervals and the O(jobs · log W) owner assignment."""

import random

import pytest

from raggedfsdp.sharding import RaggedShard
from raggedfsdp.sharding.owners import Job, assign_owners, ns_flops


def _scan_owners(jobs: list[Job], world: int, holder_slack: float = 0.1) -> list[int]:
    """The rule stated the slow, obvious way (a scan over all ranks per job): the oracle."""
    owners = [-1] * len(jobs)
    load = [0.0] * world
    for i, job in enumerate(jobs):
        if job.sole_holder is not None:
            owners[i] = job.sole_holder
            load[job.sole_holder] += job.cost
    for i in sorted((i for i in range(len(jobs)) if owners[i] < 0), key=lambda i: -jobs[i].cost):
        job = jobs[i]
        best = min(range(world), key=lambda r: (load[r], r))
        holder = max(range(world), key=lambda r: (job.held_by(r), -r))
        if load[holder] + job.cost <= (load[best] + job.cost) * (1 + holder_slack):
            best = holder
        owners[i] = best
        load[best] += job.cost
    return owners


def _random_jobs(rng: random.Random, world: int, count: int) -> list[Job]:
    jobs = []
    for _ in range(count):
        counts = [0] * world
        rows = rng.randint(0, 12)
        spread = rng.choice([1, 2, world])
        first = rng.randrange(world)
        for _ in range(rows):
            counts[min(world - 1, first + rng.randrange(spread))] += 1
        shard = RaggedShard.from_counts((rows, 3), 3, counts)
        pieces = tuple((r, n) for r, n in enumerate(shard.lengths) if n)
        jobs.append(Job(pieces, float(rng.choice([1, 8, 8, 27, 64, rows * 9]))))
    return jobs


@pytest.mark.parametrize("world", [1, 2, 3, 5, 16, 97])
@pytest.mark.parametrize("seed", range(4))
def test_assign_owners_equals_the_scan_over_ranks(world, seed):
    jobs = _random_jobs(random.Random(seed * 1000 + world), world, 60)
    for slack in (0.0, 0.1, 0.5):
        assert assign_owners(jobs, world, slack) == _scan_owners(jobs, world, slack)


def test_ties_go_to_the_lower_rank_and_empty_jobs_to_the_least_loaded():
    jobs = [Job((), 0.0), Job(((1, 4), (2, 4)), 5.0), Job(((1, 4), (2, 4)), 5.0)]
    # job 1: its holder (rank 1, the lower of two equal holders) is within the slack of rank 0;
    # job 2: rank 1 is not any more, rank 0 is the least loaded; the empty job: rank 2
    assert assign_owners(jobs, 3) == _scan_owners(jobs, 3) == [2, 1, 0]


@pytest.mark.parametrize("seed", range(3))
def test_spanning_equals_the_pieces_of_a_ragged_shard(seed):
    rng = random.Random(seed)
    for _ in range(50):
        world = rng.randint(1, 9)
        counts = [rng.choice([0, 0, 1, 3, 7]) for _ in range(world)]
        shard = RaggedShard.from_counts((sum(counts), 2), 2, counts)
        bounds = [shard.offset(r) for r in range(world)] + [shard.numel]
        start = rng.randint(0, shard.numel)
        stop = rng.randint(start, shard.numel)
        expected = []
        for r in range(world):
            lo, hi = shard.local_range(r)
            n = min(hi, stop) - max(lo, start)
            if n > 0:
                expected.append((r, n))
        assert Job.spanning(start, stop, bounds, 1.0).pieces == tuple(expected)


def test_spanning_equal_segments_with_a_range():
    seg, world = 10, 100_000
    job = Job.spanning(25, 47, range(0, (world + 1) * seg, seg), 3.0)
    assert job.pieces == ((2, 5), (3, 10), (4, 7)) and job.main_holder == 3 and job.numel == 22


def test_main_holder_is_the_lowest_rank_holding_most():
    assert Job(((0, 3), (1, 5), (2, 5)), 1.0).main_holder == 1
    assert Job((), 1.0).main_holder == 0


def test_ns_flops():
    # m=2, n=3: s=2, l=3 -> per step 4*4*3 + 2*8 = 64
    assert ns_flops(2, 3, 5) == ns_flops(3, 2, 5) == 320
