"""``PipelineStage``: torch's pipeline stage, with raggedfsdp's ``fully_shard`` as its FSDP.

``torch.distributed.pipelining`` drives data parallelism inside a stage by the stage's type:
for torch's own ``FSDPModule`` every microbatch's backward runs without gradient sync and
without resharding, and once all microbatches are done the stage reduces what they
accumulated (``perform_reduce_grad``: one reduce-scatter per group per step, not one per
microbatch). It recognises only torch's class, so a stage wrapped with raggedfsdp's
``fully_shard`` would be treated as a plain module: correct gradients, but a reduce-scatter
(and a re-gather) per microbatch. This subclass gives raggedfsdp's modules FSDP2's treatment
through their public controls (``set_requires_gradient_sync``, ``set_reshard_after_backward``,
``set_is_last_backward``, ``reduce_accumulated_gradients``). Port torchtitan's PP code by
importing ``PipelineStage`` from here; every schedule (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ...) takes it unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage

from raggedfsdp.fsdp.api import FSDPModule

__all__ = ["PipelineStage"]


class PipelineStage(TorchPipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` (same arguments) whose submodule may be a
    raggedfsdp ``FSDPModule``; other submodules behave exactly as under torch's class."""

    def __init__(self, submodule: nn.Module, *args: Any, **kwargs: Any) -> None:
        _check_stage_root(submodule)
        super().__init__(submodule, *args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        """Every microbatch accumulates unsharded gradients, parameters kept gathered between
        microbatches; ``perform_reduce_grad`` reduces them once (FSDP2's schedule)."""
        if isinstance(self.submod, FSDPModule):
            self.submod.set_is_last_backward(False)
            self.submod.set_reshard_after_backward(False)
            self.submod.set_requires_gradient_sync(False)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """After the step's last microbatch: one reduce-scatter of the accumulated gradients
        per group, the parameters freed, then torch's scaling by the microbatch count."""
        if isinstance(self.submod, FSDPModule):
            self.submod.set_is_last_backward(True)
            self.submod.set_reshard_after_backward(True)
            self.submod.set_requires_gradient_sync(True)
            self.submod.reduce_accumulated_gradients()
        super().perform_reduce_grad(grad_scale_factor)


def _check_stage_root(submodule: nn.Module) -> None:
    """A stage whose blocks are ``fully_shard``ed but whose own module is not would run as a
    plain module: a reduce-scatter and a re-gather every microbatch, silently. Refuse it with
    the fix; a stage with no FSDP inside (pure pipeline parallelism) is fine."""
    if isinstance(submodule, FSDPModule):
        return
    inner = next((name for name, m in submodule.named_modules() if isinstance(m, FSDPModule)), None)
    if inner is not None:
        raise ValueError(
            f"PipelineStage(submodule={type(submodule).__name__}): the stage's module is not "
            f"fully_shard'ed but its submodule {inner!r} is, so gradients would be reduced every "
            "microbatch; call raggedfsdp.fully_shard(submodule) on the stage's module too, as "
            "its root"
        )
