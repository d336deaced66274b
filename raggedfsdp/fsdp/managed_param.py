"""``ManagedParam``: one parameter of a ``fully_shard`` group, wherever the module tree holds it.

It lives below both modules that use it: ``param_group`` builds groups of them and
``float8_gather`` hangs the kept FP8 weights on their unsharded tensors, so neither has to
import the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

__all__ = ["ManagedParam"]


@dataclass
class ManagedParam:
    """One parameter of a group and everywhere the module tree refers to it (tied weights
    appear at several places). ``original`` is dropped once sharded, freeing its memory."""

    fqn: str
    original: nn.Parameter | None
    locations: list[tuple[nn.Module, str]]
    sharded: nn.Parameter = field(init=False)
    unsharded: nn.Parameter = field(init=False)

    @property
    def requires_grad(self) -> bool:
        """The user's setting: the sharded parameter's once sharded (freezing or unfreezing it
        after wrapping takes effect at the next forward, as with FSDP2)."""
        return (self.original if self.original is not None else self.sharded).requires_grad
