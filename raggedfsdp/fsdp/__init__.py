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
from raggedfsdp.fsdp.mixed_precision import MixedPrecisionPolicy

__all__ = [
    "FSDPModule",
    "MixedPrecisionPolicy",
    "UnshardHandle",
    "clip_grad_norm_",
    "fully_shard",
    "register_fsdp_forward_method",
]
