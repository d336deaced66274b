"""Sharding core: the ``RaggedShard`` spec, unit and owner rules, the structure-aware planner
and flat buffers.

``RaggedShard``, the unit rules (``units``), the owner rules (``owners``) and the planner are pure
Python (no torch) so the runtime and the capacity planner share them and they can be tested and
simulated at 100,000 ranks; ``FlatBuffer`` and ``RaggedTensor`` need torch (but no process
group) and are imported lazily, so planning tools start without torch.
"""

from importlib import import_module
from typing import Any

from raggedfsdp.sharding.blocks import QuantBlocks, ShampooBlocks
from raggedfsdp.sharding.owners import Job, assign_owners, ns_flops
from raggedfsdp.sharding.planner import (
    DEFAULT_ALIGNMENT_BYTES,
    Layout,
    TensorSpec,
    dtype_itemsize,
    plan_layout,
    plan_layout_exact,
)
from raggedfsdp.sharding.ragged_shard import Box, RaggedShard, flat_range_to_boxes, row_numel
from raggedfsdp.sharding.units import (
    DEFAULT_POLICY,
    ExpertShardPolicy,
    GroupShardPolicy,
    MuonShardPolicy,
    ShardPolicy,
    StrictPolicy,
    TensorMeta,
    adamw8bit_policy,
    combine,
    element_units,
    is_muon_matrix,
    is_quantized,
    matrix_unit,
    quantized_unit,
    resolve_units,
    row_units,
    shampoo_policy,
    shampoo_slab_rows,
    slice_units,
    strict,
)

_LAZY = {
    "FlatBuffer": "raggedfsdp.sharding.flat_buffer",
    "RaggedTensor": "raggedfsdp.sharding.ragged_tensor",
}

__all__ = [
    "DEFAULT_ALIGNMENT_BYTES",
    "DEFAULT_POLICY",
    "Box",
    "ExpertShardPolicy",
    "FlatBuffer",
    "GroupShardPolicy",
    "Job",
    "Layout",
    "MuonShardPolicy",
    "QuantBlocks",
    "RaggedShard",
    "RaggedTensor",
    "ShampooBlocks",
    "ShardPolicy",
    "StrictPolicy",
    "TensorMeta",
    "TensorSpec",
    "adamw8bit_policy",
    "assign_owners",
    "combine",
    "dtype_itemsize",
    "element_units",
    "flat_range_to_boxes",
    "is_muon_matrix",
    "is_quantized",
    "matrix_unit",
    "ns_flops",
    "plan_layout",
    "plan_layout_exact",
    "quantized_unit",
    "resolve_units",
    "row_numel",
    "row_units",
    "shampoo_policy",
    "shampoo_slab_rows",
    "slice_units",
    "strict",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raggedfsdp.sharding' has no attribute {name!r}")
