"""``MixedPrecisionPolicy``: dtypes for the all-gather/compute, the reduction and the outputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Like FSDP2's: sharded parameters stay in their own dtype (fp32 master weights).

    Args:
        param_dtype: dtype of the all-gathered (unsharded) parameters and of forward/backward
            compute; ``None`` keeps the parameters' dtype. The sharded fp32 piece is cast into a
            ``param_dtype`` segment before each all-gather (``1/W`` of the group).
        reduce_dtype: dtype of the gradient reduce-scatter; ``None`` means ``param_dtype``.
            fp32 reduction of bf16 gradients costs one cast per gradient (done anyway, when the
            gradient is written into the flat reduce-scatter buffer).
        output_dtype: cast floating-point forward outputs to this dtype; ``None`` leaves them.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
