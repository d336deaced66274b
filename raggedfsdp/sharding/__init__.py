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
from raggedfsdp.sharding.policy import ShardPolicy, combine, element_units, row_units, slice_units
from raggedfsdp.sharding.ragged_shard import Box, RaggedShard, flat_range_to_boxes, row_numel
from raggedfsdp.sharding.ragged_tensor import RaggedTensor

__all__ = [
    "DEFAULT_ALIGNMENT_BYTES",
    "Box",
    "FlatBuffer",
    "Layout",
    "RaggedShard",
    "RaggedTensor",
    "ShardPolicy",
    "TensorSpec",
    "combine",
    "dtype_itemsize",
    "element_units",
    "flat_range_to_boxes",
    "plan_layout",
    "plan_layout_exact",
    "row_numel",
    "row_units",
    "slice_units",
]
