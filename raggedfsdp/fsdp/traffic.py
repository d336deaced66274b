"""How many bytes a model's ``fully_shard`` groups have all-gathered: a per-step metric.

Each group counts the bytes of every all-gather output it fills (its full compute-dtype buffer,
or the byte payload of an FP8 gather), so a training loop can report what a choice such as
``Float8Blocks`` saves without a profiler.
"""

from __future__ import annotations

from torch import nn

from raggedfsdp.fsdp.state import STATE_ATTR

__all__ = ["all_gather_bytes"]


def all_gather_bytes(model: nn.Module) -> int:
    """Bytes all-gathered into this rank so far by every group of ``model``'s ``fully_shard``
    calls (the gathered buffers' sizes; a ring all-gather sends ``(W - 1) / W`` of them)."""
    groups = {
        id(group): group
        for module in model.modules()
        if (state := getattr(module, STATE_ATTR, None)) is not None
        for group in state.groups
    }
    return sum(group.all_gather_bytes for group in groups.values())
