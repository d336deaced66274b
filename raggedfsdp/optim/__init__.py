"""Sharded optimizers: ``AdamW`` and block-quantized ``AdamW8bit`` (``Muon``, ``Shampoo`` to come).

Each works unchanged in three modes: one process (torch's behaviour), drop-in ZeRO-2 over plain
replicated parameters under a process group, and FSDP over ``RaggedTensor`` parameters. Each
declares the unit its math needs with ``shard_policy()``, which ``fully_shard`` accepts too.
"""

from raggedfsdp.optim.adamw import AdamW
from raggedfsdp.optim.adamw8bit import AdamW8bit
from raggedfsdp.optim.base import ShardedOptimizer, StateBytes, StateSpec

__all__ = ["AdamW", "AdamW8bit", "ShardedOptimizer", "StateBytes", "StateSpec"]
