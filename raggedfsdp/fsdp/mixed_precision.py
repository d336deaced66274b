"""``MixedPrecisionPolicy``: dtypes for the all-gather/compute, the reduction and the outputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raggedfsdp.fsdp.float8 import Float8Blocks
from raggedfsdp.fsdp.mxfp8 import MXFP8Blocks

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
        all_gather: what the all-gather moves. ``None``: the parameters in ``param_dtype``.
            ``Float8Blocks(128)``: eligible weights as FP8 codes with one fp32 scale per
            128x128 tile, quantized from the fp32 master by the rank owning the tile and
            dequantized into ``param_dtype`` parameters after the gather (about half the bytes
            of a bf16 gather); see ``raggedfsdp.fsdp.float8``. ``MXFP8Blocks()``: the same with
            one power-of-two e8m0 scale per 1x32 block of a row (OCP MX), which needs whole-row
            units only, so it pads no more at large world sizes; see ``raggedfsdp.fsdp.mxfp8``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    all_gather: Float8Blocks | MXFP8Blocks | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise TypeError(
                    f"MixedPrecisionPolicy({field}={value!r}): expected a floating-point "
                    "torch.dtype or None, e.g. torch.bfloat16"
                )
        if self.all_gather is not None and not isinstance(
            self.all_gather, Float8Blocks | MXFP8Blocks
        ):
            raise TypeError(
                f"MixedPrecisionPolicy: all_gather={self.all_gather!r} must be None (gather in "
                "param_dtype), raggedfsdp.fsdp.Float8Blocks(128) or raggedfsdp.fsdp.MXFP8Blocks()"
            )
