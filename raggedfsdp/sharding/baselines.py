"""What other sharding rules cost on the same tensors, for comparison tables and the planner CLI.

PyTorch FSDP2 shards every parameter with ``Shard(0)`` like ``torch.chunk``: ``ceil(d0 / W)``
slices of dim 0 per rank, the last ranks short or empty, and every rank allocates the full
``ceil(d0 / W)`` slices (zero padding). Pure Python, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["fsdp2_cuts_units", "fsdp2_padding"]


def fsdp2_padding(shape: Sequence[int], world_size: int) -> int:
    """Padding elements FSDP2 adds to one tensor: dim 0 rounded up to a multiple of W."""
    if not shape:
        return world_size - 1  # a scalar becomes one element per rank
    d0, inner = shape[0], math.prod(shape[1:])
    return (-(-d0 // world_size) * world_size - d0) * inner


def fsdp2_cuts_units(shape: Sequence[int], world_size: int, unit: int) -> bool:
    """Whether FSDP2's even dim-0 split puts a rank boundary inside a unit of ``unit`` elements.

    Its boundaries are the multiples of one rank's chunk, ``ceil(d0 / W)`` slices of dim 0,
    that fall inside the tensor; all multiples of a number are unit-aligned iff the number is,
    so one check answers for every W (O(1), which matters at 16,384 ranks)."""
    if len(shape) == 0 or shape[0] == 0:
        return False
    chunk = -(-shape[0] // world_size)
    return chunk < shape[0] and (chunk * math.prod(shape[1:])) % unit != 0
