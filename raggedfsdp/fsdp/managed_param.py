"""``ManagedParam``: one parameter of a ``fully_shard`` group, wherever the module tree holds it.

It lives below both modules that use it: ``param_group`` builds groups of them and
``float8_gather`` hangs the kept FP8 weights on their unsharded tensors, so neither has to
import the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from raggedfsdp.sharding.tp_shard import TPShard

__all__ = ["ManagedParam"]


@dataclass
class ManagedParam:
    """One parameter of a group and everywhere the module tree refers to it (tied weights
    appear at several places). ``original`` is dropped once sharded, freeing its memory.
    ``tp`` is set for a tensor-parallel (DTensor) parameter: the group plans, stores and
    reduces its TP-local tensor, and its unsharded parameter is that DTensor again."""

    fqn: str
    original: nn.Parameter | None
    locations: list[tuple[nn.Module, str]]
    tp: TPShard | None = None
    sharded: nn.Parameter = field(init=False)
    unsharded: nn.Parameter = field(init=False)

    @property
    def local_original(self) -> torch.Tensor:
        """The tensor the group cuts: the original, or its TP-local tensor (detached)."""
        return self.original.detach() if self.tp is None else self.original.to_local().detach()

    @property
    def requires_grad(self) -> bool:
        """The user's setting: the sharded parameter's once sharded (freezing or unfreezing it
        after wrapping takes effect at the next forward, as with FSDP2)."""
        return (self.original if self.original is not None else self.sharded).requires_grad
