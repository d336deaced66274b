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

from torch.distributed.pipelining import PipelineStage as TorchPipelineStage

from raggedfsdp.fsdp.api import FSDPModule

__all__ = ["PipelineStage"]


class PipelineStage(TorchPipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` (same arguments) whose submodule may be a
    raggedfsdp ``FSDPModule``; other submodules behave exactly as under torch's class."""

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
