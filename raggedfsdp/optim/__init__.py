"""Sharded optimizers: ``AdamW``, block-quantized ``AdamW8bit``, ``Muon``, blocked ``Shampoo``
and ``SOAP``.

Each works unchanged in three modes: one process (torch's behaviour), drop-in ZeRO-2 over plain
replicated parameters under a process group, and FSDP over ``RaggedTensor`` parameters. Each
declares the unit its math needs with ``shard_policy()``, which ``fully_shard`` accepts too.
"""

from raggedfsdp.optim.adamw import AdamW
from raggedfsdp.optim.adamw8bit import AdamW8bit
from raggedfsdp.optim.base import ShardedOptimizer
from raggedfsdp.optim.contract import StateBytes, StateSpec
from raggedfsdp.optim.muon import Muon, split_muon_params
from raggedfsdp.optim.shampoo import Shampoo
from raggedfsdp.optim.soap import SOAP

__all__ = [
    "SOAP",
    "AdamW",
    "AdamW8bit",
    "Muon",
    "Shampoo",
    "ShardedOptimizer",
    "StateBytes",
    "StateSpec",
    "split_muon_params",
]
