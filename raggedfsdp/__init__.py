"""raggedfsdp: Fully Sharded Data Parallel whose shards follow the structure of the math.

Sub-packages: :mod:`raggedfsdp.sharding` (RaggedShard, planner, flat buffers, RaggedTensor),
:mod:`raggedfsdp.comm` (in-place collectives for gloo and NCCL), :mod:`raggedfsdp.fsdp`
(``fully_shard``), :mod:`raggedfsdp.optim` (sharded optimizers).
"""

from raggedfsdp.fsdp import FSDPModule, MixedPrecisionPolicy, clip_grad_norm_, fully_shard

__version__ = "0.1.0"

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "clip_grad_norm_", "fully_shard"]
