"""SOAP's block geometry: which dims of a tensor get a factor, and how the tensor is cut.

SOAP preconditions a tensor as an N-dim array ``dims`` (N ≥ 2; a vector is an ``n × 1``
column whose second dim has no factor), cut into blocks of at most ``sides[i]`` along dim
``i``; each block keeps one factor per dim in ``factored``. Three options decide ``dims`` and
the cut:

* ``tensor_factors="matrix"`` (ours, the default): a tensor of 2+ dims is the ``prod(leading
  dims) × last dim`` matrix of ``raggedfsdp.sharding.units.shampoo_matrix`` (two factors; with
  ``merge_dims``, DistributedShampoo's merged shape first). ``"per_dim"`` (the SOAP authors'):
  one factor per dim of the tensor, or of its merged shape with ``merge_dims`` (their
  ``merge_dims=True``); a tensor of 2+ dims that merges into one dim keeps its factor
  (vectors from 1-D tensors still need ``precondition_1d``).
* ``large_dims="block"`` (ours, the default): every dim is cut into blocks of at most ``B``
  (``max_preconditioner_dim``), every block factored along every dim. ``"skip"`` (the
  authors'): no cut; a dim larger than ``B`` keeps no factor (the identity there), and a tensor
  with no dim left to factor runs plain Adam.

A *slab* is ``sides[0]`` whole rows of dim 0, all blocks of those rows: it is a contiguous
range of the flat tensor, so ``raggedfsdp.optim.slabs`` computes it where it lies whole or on
its owner, as Shampoo's slabs. With ``"matrix"`` and ``"block"`` this is exactly
``ShampooBlocks`` (same slabs, same state shapes).
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from raggedfsdp.sharding import ShardPolicy
from raggedfsdp.sharding.units import (
    check_preconditioner_dim,
    merge_small_dims,
    shampoo_matrix,
)

__all__ = ["LARGE_DIMS", "TENSOR_FACTORS", "SoapBlocks", "check_layout_options", "soap_policy"]

LargeDims = Literal["block", "skip"]
TensorFactors = Literal["matrix", "per_dim"]
LARGE_DIMS = ("block", "skip")
TENSOR_FACTORS = ("matrix", "per_dim")


def check_layout_options(large_dims: Any, tensor_factors: Any) -> None:
    """One line naming the option and its values."""
    if large_dims not in LARGE_DIMS:
        raise ValueError(
            f"Invalid large_dims: {large_dims!r}. Must be 'block' (cut dims above "
            "max_preconditioner_dim into blocks) or 'skip' (leave them unpreconditioned)"
        )
    if tensor_factors not in TENSOR_FACTORS:
        raise ValueError(
            f"Invalid tensor_factors: {tensor_factors!r}. Must be 'matrix' (a 3+-dim tensor is "
            "its prod(leading dims) x last dim matrix) or 'per_dim' (one factor per dim)"
        )


@dataclass(frozen=True)
class SoapBlocks:
    """One preconditioned tensor's blocks (see the module docstring)."""

    dims: tuple[int, ...]  # the tensor as preconditioned, N >= 2 (a vector is n x 1)
    sides: tuple[int, ...]  # block side per dim (the dim itself where it is not cut)
    factored: tuple[bool, ...]  # whether each dim keeps a factor

    @classmethod
    def of(
        cls,
        shape: Sequence[int],
        max_dim: int,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        large_dims: LargeDims = "block",
        tensor_factors: TensorFactors = "matrix",
    ) -> SoapBlocks | None:
        """The blocks of a tensor of ``shape``, or None where SOAP runs plain Adam."""
        options = (max_dim, merge_dims, precondition_1d, large_dims, tensor_factors)
        return _blocks(tuple(shape), *options)

    # ----------------------------------------------------------------------------- slabs
    # what raggedfsdp.optim.slabs reads (as ShampooBlocks')
    @property
    def rows(self) -> int:
        return self.dims[0]

    @property
    def cols(self) -> int:
        return math.prod(self.dims[1:])

    @property
    def slab_rows(self) -> int:
        return self.sides[0]

    @property
    def slab_numel(self) -> int:
        return self.slab_rows * self.cols

    @property
    def num_slabs(self) -> int:
        return -(-self.rows // self.slab_rows)

    def slab_range(self, i: int) -> tuple[int, int]:
        start = i * self.slab_numel
        return start, min(start + self.slab_numel, self.rows * self.cols)

    def slabs_starting_in(self, start: Any, stop: Any) -> Any:
        """Slabs whose first element lies in ``[start, stop)``."""
        return -(-stop // self.slab_numel) - -(-start // self.slab_numel)

    def slab_owners(self, bounds: Sequence[int]) -> list[int]:
        """The rank holding each slab's first element (rank ``r`` holds ``[bounds[r],
        bounds[r + 1])``)."""
        return [bisect_right(bounds, i * self.slab_numel) - 1 for i in range(self.num_slabs)]

    # ----------------------------------------------------------------------------- blocks
    @property
    def grid(self) -> tuple[int, ...]:
        """Blocks per slab along dims 1..N-1."""
        return tuple(-(-d // s) for d, s in zip(self.dims[1:], self.sides[1:], strict=True))

    @property
    def blocks_per_slab(self) -> int:
        return math.prod(self.grid)

    def block_slices(self, j: int) -> tuple[slice, ...]:
        """Block ``j`` of a slab (row-major over ``grid``) along dims 1..N-1."""
        index = []
        for count in reversed(self.grid):
            j, i = divmod(j, count)
            index.append(i)
        return tuple(
            slice(i * s, min((i + 1) * s, d))
            for i, s, d in zip(reversed(index), self.sides[1:], self.dims[1:], strict=True)
        )

    @property
    def keys(self) -> tuple[str, ...]:
        """State-key suffix of each factored dim: ``L``/``R`` for matrices (Shampoo's names),
        the dim's index for 3+ dims."""
        names = ("L", "R") if len(self.dims) == 2 else tuple(map(str, range(len(self.dims))))
        return tuple(n for n, f in zip(names, self.factored, strict=True) if f)

    @property
    def factored_dims(self) -> tuple[int, ...]:
        return tuple(i for i, f in enumerate(self.factored) if f)

    def factor_shape(self, dim: int) -> tuple[int, int, int, int]:
        """``(slabs, blocks per slab, side, side)`` of dim ``dim``'s factors (edge blocks use
        the top-left corner)."""
        side = self.sides[dim]
        return (self.num_slabs, self.blocks_per_slab, side, side)


@functools.lru_cache(maxsize=4096)
def _blocks(
    shape: tuple[int, ...],
    max_dim: int,
    merge_dims: bool,
    precondition_1d: bool,
    large_dims: LargeDims,
    tensor_factors: TensorFactors,
) -> SoapBlocks | None:
    dims = _preconditioned_dims(shape, max_dim, merge_dims, precondition_1d, tensor_factors)
    if dims is None:
        return None
    vector = len(dims) == 1
    dims = (dims[0], 1) if vector else dims
    if large_dims == "skip":
        factored = tuple(d <= max_dim for d in dims)
        sides = dims
    else:
        factored = (True,) * len(dims)
        sides = tuple(min(max_dim, d) for d in dims)
    if vector:
        factored = (factored[0], False)
    return SoapBlocks(dims, sides, factored) if any(factored) else None


def _preconditioned_dims(
    shape: tuple[int, ...],
    max_dim: int,
    merge_dims: bool,
    precondition_1d: bool,
    tensor_factors: TensorFactors,
) -> tuple[int, ...] | None:
    """The dims SOAP factors (one for a vector), or None for tensors left to plain Adam."""
    if tensor_factors == "per_dim" and len(shape) >= 2 and math.prod(shape) > 0:
        return merge_small_dims(shape, max_dim) if merge_dims else shape
    view = shampoo_matrix(shape, max_dim, merge_dims, precondition_1d)
    if view is None:
        return None
    rows, cols, order = view
    return (rows, cols) if order == 2 else (rows,)


def soap_policy(
    max_preconditioner_dim: int = 1024,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    large_dims: LargeDims = "block",
    tensor_factors: TensorFactors = "matrix",
    normalize_grads: bool = False,
) -> ShardPolicy:
    """One slab per unit for preconditioned tensors (every block whole on one rank); elements
    for the rest, or the whole tensor with ``normalize_grads`` (whose norm is summed where the
    tensor lies, so that it is the same at every world size)."""
    check_preconditioner_dim(max_preconditioner_dim)
    check_layout_options(large_dims, tensor_factors)

    def unit(fqn: str, param: Any) -> int:
        shape = tuple(param.shape)
        blocks = SoapBlocks.of(
            shape, max_preconditioner_dim, merge_dims, precondition_1d, large_dims, tensor_factors
        )
        if blocks is not None:
            return blocks.slab_numel
        return max(1, math.prod(shape)) if normalize_grads else 1

    return unit
