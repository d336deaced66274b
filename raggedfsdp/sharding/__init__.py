"""Sharding core: the ``RaggedShard`` spec, the structure-aware planner and flat buffers.

``RaggedShard`` and the planner are pure Python (no torch.distributed) so they can be tested and
simulated at 100,000 ranks; ``FlatBuffer`` and ``RaggedTensor`` need torch (but no process
group) and are imported lazily, so planning tools start without torch.
"""

from importlib import import_module
from typing import Any

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

_LAZY = {
    "FlatBuffer": "raggedfsdp.sharding.flat_buffer",
    "RaggedTensor": "raggedfsdp.sharding.ragged_tensor",
}

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raggedfsdp.sharding' has no attribute {name!r}")
