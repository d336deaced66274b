"""All-reduces of small per-rank results that keep NaN exactly as torch's reductions do.

A whole-tensor ``max()``, ``amax()`` or inf-norm of a sharded tensor is each rank's partial
result combined with a MAX or MIN all-reduce. What such an all-reduce does with NaN is the
backend's business, not IEEE's: gloo compares with ``<``, so a NaN on one rank is dropped, and it
even disturbs the other comparisons (``arange(6.)`` over 3 ranks with one NaN reduced to 1.0 on
every rank, neither NaN nor the finite maximum 5); NCCL's answer depends on its version. torch's
reductions return NaN as soon as one element is NaN, and callers rely on that (``clip_grad_norm_``
with ``error_if_nonfinite=True``, non-finite step skipping).

So a NaN never enters the comparison: each value travels with a NaN flag in the same buffer,
the NaN replaced by the op's identity (``-inf`` for max, ``+inf`` for min) and the flag set to 1
(-1 for min, so that MIN of the flags still says "some rank had a NaN"). One collective reduces
both, and every position that some rank flagged becomes NaN again. ``±inf`` and finite values
compare as usual. Sums need no flag: IEEE addition propagates NaN on every backend.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["WholeReduce", "all_reduce_nan_safe"]

WholeReduce = Literal["sum", "max", "min"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce_nan_safe(
    values: Tensor, op: WholeReduce, group: dist.ProcessGroup | None = None
) -> Tensor:
    """``values`` (any shape) combined element-wise over ``group`` by ``op``, with one collective.

    NaN propagates as in torch's ``max`` / ``min`` / ``sum``: a position is NaN on every rank if
    it is NaN on any. Returns a new tensor for floating ``max`` / ``min``; otherwise ``values``,
    reduced in place. Issues the collective unconditionally: callers skip it for one rank.
    """
    if values.is_complex() and op != "sum":
        raise TypeError(f"all_reduce_nan_safe: complex values have no {op}")
    if op == "sum" or not values.is_floating_point():  # no NaN to guard
        dist.all_reduce(values, op=_OPS[op], group=group)
        return values
    nan = values.isnan()
    identity = -torch.inf if op == "max" else torch.inf
    flag = nan.to(values.dtype) if op == "max" else -nan.to(values.dtype)
    both = torch.stack([values.masked_fill(nan, identity), flag])
    dist.all_reduce(both, op=_OPS[op], group=group)
    return both[0].masked_fill(both[1] != 0, torch.nan)
