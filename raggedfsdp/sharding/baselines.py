"""What other sharding rules cost on the same tensors, for comparison tables and the planner CLI.

PyTorch FSDP2 shards every parameter with ``Shard(0)`` like ``torch.chunk``: ``ceil(d0 / W)``
slices of dim 0 per rank, the last ranks short or empty, and every rank allocates the full
``ceil(d0 / W)`` slices (zero padding). Pure Python, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from raggedfsdp.sharding.ragged_shard import row_numel

__all__ = ["fsdp2_cuts_units", "fsdp2_padding"]


def fsdp2_padding(shape: Sequence[int], world_size: int) -> int:
    """Padding elements FSDP2 adds to one tensor: dim 0 rounded up to a multiple of W."""
    if not shape:
        return world_size - 1  # a scalar becomes one element per rank
    d0, inner = shape[0], math.prod(shape[1:])
    return (-(-d0 // world_size) * world_size - d0) * inner


def fsdp2_cuts_units(shape: Sequence[int], world_size: int, unit_rows: int) -> bool:
    """Whether FSDP2's even dim-0 split puts a rank boundary inside a unit of ``unit_rows`` rows
    (rows as in ``row_numel``: vectors along the last dim; elements for a 1-D tensor)."""
    if len(shape) == 0 or shape[0] == 0:
        return False
    d0, inner = shape[0], math.prod(shape[1:])
    rows_per_slice = inner // row_numel(shape) if len(shape) > 1 else 1
    chunk = -(-d0 // world_size)
    return any(
        (i * chunk * rows_per_slice) % unit_rows for i in range(1, world_size) if i * chunk < d0
    )
