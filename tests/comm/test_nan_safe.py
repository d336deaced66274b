"""``all_reduce_nan_safe`` against torch's own reductions over the ranks' stacked values.

Every rank rebuilds every rank's values from its rank number, so each checks its result against
``torch.amax`` / ``torch.amin`` / ``torch.sum`` of the stack, NaN and ±inf included.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from raggedfsdp.comm.nan_safe import all_reduce_nan_safe

REFERENCE = {"max": torch.amax, "min": torch.amin, "sum": torch.sum}


def _values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Per position: NaN on one rank only (a different one per position), ±inf, mixed signs."""
    row = [float(rank), -float(rank), 0.0, 1.0, -1.0, 2.0, -2.0]
    row[rank % 3] = math.nan  # positions 0..2: NaN on a single rank each
    row[3] = math.inf if rank == 1 else row[3]
    row[4] = -math.inf if rank == 2 else row[4]
    row[5] = math.nan if rank == 0 else (math.inf if rank == 1 else row[5])
    values = torch.tensor(row, dtype=torch.float64)
    return values.to(dtype) if dtype.is_floating_point else values.nan_to_num(0, 9, -9).to(dtype)


def _against_torch() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8):
        everyone = torch.stack([_values(r, dtype) for r in range(world)])
        for op, reference in REFERENCE.items():
            if op == "sum" and dtype == torch.uint8:
                continue  # wraps around
            got = all_reduce_nan_safe(_values(rank, dtype), op)
            expected = reference(everyone, 0)
            if got.dtype != expected.dtype or not torch.equal(
                got.nan_to_num(0.5), expected.nan_to_num(0.5)
            ):
                problems.append(f"{dtype} {op}: {got.tolist()} != {expected.tolist()}")
            if dtype.is_floating_point and not torch.equal(got.isnan(), expected.isnan()):
                problems.append(f"{dtype} {op}: NaN at {got.isnan().tolist()}")
    return problems


@pytest.mark.parametrize("world_size", [3, 4])
def test_max_and_min_keep_nan_from_any_rank(pool):
    """gloo's MAX/MIN alone drop a NaN held by one rank; with the flag it is NaN everywhere,
    and ±inf and finite values come out as torch's."""
    for rank, problems in enumerate(pool.run(_against_torch)):
        assert not problems, f"rank {rank}: {problems}"


def test_complex_values_have_no_order():
    with pytest.raises(TypeError, match="complex values have no max"):
        all_reduce_nan_safe(torch.zeros(2, dtype=torch.complex64), "max")
