"""The FSDP runtime: ``fully_shard`` over ragged flat buffers (one concept per module:
``api`` the entry point, ``param_group`` one group's buffers and collectives, ``state`` the hooks,
``mixed_precision`` the policy, ``clip`` gradient clipping over shards)."""

from raggedfsdp.fsdp.api import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from raggedfsdp.fsdp.clip import clip_grad_norm_
from raggedfsdp.fsdp.float8 import Float8Blocks
from raggedfsdp.fsdp.float8_linear import Float8BlockLinear, float8_block_linear
from raggedfsdp.fsdp.mixed_precision import MixedPrecisionPolicy
from raggedfsdp.fsdp.mxfp8 import MXFP8Blocks
from raggedfsdp.fsdp.traffic import all_gather_bytes

__all__ = [
    "FSDPModule",
    "Float8BlockLinear",
    "Float8Blocks",
    "MXFP8Blocks",
    "MixedPrecisionPolicy",
    "UnshardHandle",
    "all_gather_bytes",
    "clip_grad_norm_",
    "float8_block_linear",
    "fully_shard",
    "register_fsdp_forward_method",
]
