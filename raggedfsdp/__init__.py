"""raggedfsdp: Fully Sharded Data Parallel whose shards follow the structure of the math.

Sub-packages: :mod:`raggedfsdp.sharding` (RaggedShard, planner, flat buffers),
:mod:`raggedfsdp.comm` (in-place collectives for gloo and NCCL), :mod:`raggedfsdp.optim`.
"""

__version__ = "0.1.0"
