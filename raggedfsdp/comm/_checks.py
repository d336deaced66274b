"""Argument checks shared by the collectives.

A collective called with inconsistent buffers does not fail cleanly: depending on the backend it
hangs, aborts the process or silently writes the wrong bytes. So everything that can be checked
locally is checked before anything is issued, and every error names the argument to fix.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from torch import Tensor


def check_contiguous(name: str, tensor: Tensor, *, flat: bool = True) -> None:
    """Collectives address raw memory, so buffers must be dense (and 1-D where they are flat)."""
    if flat and tensor.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D flat buffer, got shape {tuple(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous() or use a flat buffer)")


def check_pair(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    """Backends move bytes, not values: both sides must share dtype and device."""
    if a.dtype != b.dtype:
        raise TypeError(
            f"{name_b}: dtype {b.dtype} differs from {name_a} dtype {a.dtype}; "
            f"cast one of them first (collectives do not convert)"
        )
    if a.device != b.device:
        raise ValueError(f"{name_b}: on {b.device} but {name_a} is on {a.device}")


def overlaps(a: Tensor, b: Tensor) -> bool:
    """Whether the memory of two dense tensors intersects."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start < b_start + b.nbytes and b_start < a_start + a.nbytes


def is_segment(full: Tensor, part: Tensor, index: int) -> bool:
    """Whether ``part`` is exactly ``full[index*n:(index+1)*n]`` with ``n = part.numel()``."""
    return part.data_ptr() == full.data_ptr() + index * part.nbytes


def check_segment_alias(
    full_name: str, full: Tensor, part_name: str, part: Tensor, rank: int
) -> None:
    """Allow ``part`` to be this rank's own segment of ``full`` (in place), nothing else.

    In place is what the flat buffers want (no copy-in/out) and both gloo and NCCL support it;
    any other overlap would let the backend read bytes it is overwriting.
    """
    if overlaps(full, part) and not is_segment(full, part, rank):
        n = part.numel()
        raise ValueError(
            f"{part_name}: overlaps {full_name} but is not this rank's segment "
            f"{full_name}[{rank * n}:{(rank + 1) * n}]; pass that view or a separate buffer"
        )


def check_splits(
    name: str, sizes: Sequence[int], world_size: int, numel: int, buffer: str
) -> list[int]:
    """Validate per-rank split sizes against the group and the buffer they describe."""
    try:
        splits = [operator.index(s) for s in sizes]
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of ints, got {sizes!r}") from None
    if len(splits) != world_size:
        raise ValueError(
            f"{name}: expected one size per rank ({world_size}), got {len(splits)}: {splits}"
        )
    if any(s < 0 for s in splits):
        raise ValueError(f"{name}: sizes must be non-negative, got {splits}")
    if sum(splits) != numel:
        raise ValueError(f"{name}: sums to {sum(splits)} but {buffer} has {numel} elements")
    return splits
