"""The prefetch and reduce-in-flight rules, against a brute-force reading of their contract."""

from __future__ import annotations

import itertools
import random

import pytest

from raggedfsdp.sharding.schedule import (
    LATENCY_BOUND_BYTES,
    MAX_IN_FLIGHT,
    gathers_a_copy,
    prefetch_ends,
    reduces_in_flight,
)

MiB = 2**20


def _window_end(sizes: list[float], i: int) -> int:
    """The largest end with: the next place always, then places while the ones after ``i``
    total at most the bound, at most ``MAX_IN_FLIGHT`` of them."""
    best = min(i + 1, len(sizes) - 1)
    for end in range(i + 2, min(len(sizes), i + 1 + MAX_IN_FLIGHT)):
        if sum(sizes[i + 1 : end + 1]) > LATENCY_BOUND_BYTES:
            break
        best = end
    return best


def test_large_groups_prefetch_one_ahead() -> None:
    sizes = [64 * MiB] * 5
    assert prefetch_ends(sizes, 5) == [1, 2, 3, 4, 4]


def test_small_groups_prefetch_up_to_the_in_flight_cap() -> None:
    sizes = [1024] * 20
    ends = prefetch_ends(sizes, 20)
    assert ends[0] == MAX_IN_FLIGHT
    assert ends[-1] == 19
    assert all(end - i <= MAX_IN_FLIGHT for i, end in enumerate(ends))


def test_the_bound_stops_the_window_but_never_the_next_group() -> None:
    sizes = [0, 1.5 * MiB, 1 * MiB, 0.1 * MiB]
    # place 0: 1.5 MiB fits, 2.5 MiB does not
    assert prefetch_ends(sizes, 1) == [1]
    # place 1: the next (1 MiB) then 1.1 MiB in all fits
    assert prefetch_ends(sizes, 2)[1] == 3


def test_fewer_hooks_than_places_plan_only_the_hooks() -> None:
    assert prefetch_ends([1.0] * 6, 4) == [_window_end([1.0] * 6, i) for i in range(4)]
    assert prefetch_ends([], 0) == []
    assert prefetch_ends([5.0], 1) == [0]


@pytest.mark.parametrize("seed", range(30))
def test_prefetch_ends_match_the_contract_and_never_decrease(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    sizes = [rng.choice([0, 4096, 0.3 * MiB, 0.9 * MiB, 3 * MiB]) for _ in range(n)]
    ends = prefetch_ends(sizes, n)
    assert ends == [_window_end(sizes, i) for i in range(n)]
    assert all(a <= b for a, b in itertools.pairwise(ends))


def test_reduces_in_flight_keeps_the_newest_within_the_bound() -> None:
    assert reduces_in_flight([], at_least_one=True) == 0
    assert reduces_in_flight([64 * MiB], at_least_one=False) == 0
    assert reduces_in_flight([64 * MiB], at_least_one=True) == 1
    assert reduces_in_flight([1 * MiB, 64 * MiB, 0.5 * MiB, 0.5 * MiB], at_least_one=False) == 2
    assert reduces_in_flight([1024] * 20, at_least_one=False) == MAX_IN_FLIGHT
    # the newest alone is over the bound: CUDA keeps it, the CPU path finishes it
    assert reduces_in_flight([1024, 3 * MiB], at_least_one=True) == 1
    assert reduces_in_flight([1024, 3 * MiB], at_least_one=False) == 0


def test_only_one_rank_in_the_compute_dtype_gathers_no_copy() -> None:
    assert not gathers_a_copy(1, casts=False, offloaded=False, float8=False)
    for ranks, casts, offloaded, float8 in itertools.product((1, 2, 3), *[(False, True)] * 3):
        if (ranks, casts, offloaded, float8) != (1, False, False, False):
            assert gathers_a_copy(ranks, casts=casts, offloaded=offloaded, float8=float8)
