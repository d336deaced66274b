"""Optimizer-state bytes per rank: what each optimizer's ``state_bytes()`` reports on a layout.

Each optimizer keeps state for the elements a rank holds, and per-block state where its blocks
start; both follow from the planned layout, the optimizer's settings and the block geometry of
:mod:`raggedfsdp.sharding.blocks` (the optimizers allocate from the same geometry):

* AdamW: ``exp_avg`` and ``exp_avg_sq`` like the parameter (master dtype);
* AdamW8bit: per moment uint8 codes like the parameter and one fp32 absmax per block (or tile)
  the rank's piece covers; tensors below ``min_8bit_size`` keep AdamW's state;
* Muon: ``momentum_buffer`` for Muon matrices, AdamW's two moments for the rest;
* Shampoo (its defaults, momentum 0): filtered gradient and grafting second moment like the
  parameter, and for tensors of 2+ dims the factors ``L``, ``R`` and their inverse roots of
  every slab whose first element the rank holds, stored ``(col_blocks, side, side)`` per slab
  (fp32, fp64 for fp64 parameters); vectors are grafted only and keep no factors;
* SOAP (its defaults): the first moment like the parameter; for tensors of 2+ dims, per slab
  the rank owns, the rotated second moment (``slab_rows × cols``) and the factors ``L``, ``R``
  and their eigenbases (per-slab state in fp32, fp64 for fp64 parameters); vectors keep
  Adam's two moments like the parameter;
* one fp32 step counter per optimizer parameter group (Muon: its Muon and AdamW groups).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from raggedfsdp.capacity.policies import OptimizerSpec
from raggedfsdp.sharding.blocks import QuantBlocks, ShampooBlocks
from raggedfsdp.sharding.planner import Layout, dtype_itemsize
from raggedfsdp.sharding.units import is_muon_matrix, is_quantized, shampoo_blocked

__all__ = ["counter_bytes", "state_per_rank"]

#: Bytes of one step counter (a float32 scalar, as the optimizers keep it).
STEP_BYTES = 4


def state_per_rank(
    layout: Layout, tensors: Sequence[tuple[str, Sequence[int]]], opt: OptimizerSpec, dtype: str
) -> np.ndarray:
    """State bytes of every rank for one instance of a group planned as ``layout``, whose
    parameters (``(name, shape)``) are kept in ``dtype`` (step counters excluded)."""
    state = np.zeros(layout.world_size)
    seg = layout.segment_size
    for name, shape in tensors:
        numel = math.prod(shape)
        if not numel:
            continue
        a = layout.offsets[name]
        ranks = np.arange(a // seg, (a + numel - 1) // seg + 1, dtype=np.int64)
        lo = np.maximum(a, ranks * seg) - a
        hi = np.minimum(a + numel, (ranks + 1) * seg) - a
        state[ranks] += _tensor_bytes(name, tuple(shape), lo, hi, opt, dtype)
    return state


def _tensor_bytes(
    name: str,
    shape: tuple[int, ...],
    lo: np.ndarray,
    hi: np.ndarray,
    opt: OptimizerSpec,
    dtype: str,
) -> np.ndarray:
    """State bytes of one tensor on the ranks holding ``[lo, hi)`` of it."""
    local = hi - lo
    itemsize = dtype_itemsize(dtype)
    adam = 2 * itemsize * local
    if opt.name == "muon":
        return itemsize * local if is_muon_matrix(name, shape) else adam
    if opt.name == "adamw8bit":
        if not is_quantized(shape, opt.min_8bit_size):
            return adam
        blocks = QuantBlocks.of(shape, opt.block_size, opt.tile)
        return 2 * (local + 4 * blocks.count_unit * blocks.counts(lo, hi))
    if opt.name in ("shampoo", "soap") and shampoo_blocked(shape, opt.preconditioner_dim):
        return _blocked_bytes(shape, lo, hi, opt, dtype)
    return adam


def _blocked_bytes(
    shape: tuple[int, ...], lo: np.ndarray, hi: np.ndarray, opt: OptimizerSpec, dtype: str
) -> np.ndarray:
    """Shampoo's or SOAP's state of one preconditioned tensor on the ranks holding
    ``[lo, hi)``: per-element state like the parameter, per-slab state on the slabs' owners."""
    grid = ShampooBlocks.of(shape, opt.preconditioner_dim)
    factor = 8 if dtype == "float64" else 4
    per_slab = 2 * (grid.factor_numel_per_slab("L") + grid.factor_numel_per_slab("R"))
    per_element = 2  # Shampoo: filtered gradient and grafting second moment
    if opt.name == "soap":
        per_slab += grid.slab_numel  # the rotated second moment
        per_element = 1  # the first moment
    local = per_element * dtype_itemsize(dtype) * (hi - lo)
    return local + factor * per_slab * grid.slabs_starting_in(lo, hi)


def counter_bytes(opt: OptimizerSpec, names_and_shapes: Sequence[tuple[str, Sequence[int]]]) -> int:
    """Step-counter bytes every rank keeps: one counter per parameter group (``Muon`` with
    ``split_muon_params``: one for its Muon matrices, one for its AdamW group)."""
    if opt.name != "muon":
        return STEP_BYTES
    kinds = {is_muon_matrix(name, shape) for name, shape in names_and_shapes}
    return STEP_BYTES * len(kinds)
