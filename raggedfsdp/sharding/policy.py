"""Shard policies: which unit each parameter is cut into.

A shard policy is any callable ``(fqn, param) -> unit in elements``. ``fully_shard`` and the
optimizers' drop-in mode call the same policy, so an optimizer's block requirement (8-bit
quantization blocks, Shampoo blocks, whole Muon matrices) is honoured at planning time:

    fully_shard(block, shard_policy=AdamW8bit.shard_policy())

The helpers here cover the common cases; ``combine`` merges requirements (the LCM of units, so
that every requirement's blocks stay whole).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from raggedfsdp.sharding.ragged_shard import row_numel

__all__ = ["ShardPolicy", "combine", "element_units", "row_units", "slice_units"]

#: ``(fully qualified name, parameter) -> unit in elements``; only ``param.shape`` is read.
ShardPolicy = Callable[[str, Any], int]


def element_units() -> ShardPolicy:
    """ZeRO-style: any element may start a rank's piece (the least padding)."""
    return lambda fqn, param: 1


def row_units(rows: int = 1) -> ShardPolicy:
    """Units of ``rows`` rows (vectors along the last dim; elements for 1-D tensors): keeps
    ``rows × n`` tiles such as 32×32 quantization blocks or 128×128 FP8 blocks whole."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"row_units: rows={rows!r} must be a positive int")
    return lambda fqn, param: rows * row_numel(tuple(param.shape))


def slice_units() -> ShardPolicy:
    """Whole slices of dim 0 for tensors of 3 or more dims (one expert matrix of a stacked
    ``(E, m, n)`` tensor), whole matrices for 2-D tensors, elements for vectors."""

    def unit(fqn: str, param: Any) -> int:
        shape = tuple(param.shape)
        if len(shape) >= 3:
            return math.prod(shape[1:])
        return math.prod(shape) if len(shape) == 2 else 1

    return unit


def combine(*policies: ShardPolicy) -> ShardPolicy:
    """A policy whose unit is the LCM of the given policies' units, so all stay whole."""
    if not policies:
        raise ValueError("combine: give at least one policy")
    return lambda fqn, param: math.lcm(*(max(1, p(fqn, param)) for p in policies))
