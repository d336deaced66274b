"""Sharding core: the ``RaggedShard`` spec, the structure-aware planner and flat buffers.

``RaggedShard`` and the planner are pure Python (no torch.distributed) so they can be tested and
simulated at 100,000 ranks; ``FlatBuffer`` needs torch but no process group.
"""

from raggedfsdp.sharding.flat_buffer import FlatBuffer
from raggedfsdp.sharding.planner import (
    DEFAULT_ALIGNMENT_BYTES,
    Layout,
    TensorSpec,
    dtype_itemsize,
    plan_layout,
    plan_layout_exact,
)
from raggedfsdp.sharding.ragged_shard import Box, RaggedShard, flat_range_to_boxes, row_numel

__all__ = [
    "DEFAULT_ALIGNMENT_BYTES",
    "Box",
    "FlatBuffer",
    "Layout",
    "RaggedShard",
    "TensorSpec",
    "dtype_itemsize",
    "flat_range_to_boxes",
    "plan_layout",
    "plan_layout_exact",
    "row_numel",
]
