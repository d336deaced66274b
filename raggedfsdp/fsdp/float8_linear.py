"""FP8 matmuls on the gathered block-wise FP8 weights (DeepSeek-V3's recipe), where CUDA has them.

With ``Float8Blocks(keep_weights=True)`` every gathered weight keeps its FP8 codes and 128x128
tile scales as ``param.float8_blocks`` while its group is gathered. ``float8_block_linear``
then computes ``y = x W^T`` with ``torch.nn.functional.scaled_mm``: the activations quantized
per 1x128 tile on the fly (``BlockWise1x128``), the weight's codes and scales as gathered
(``BlockWise128x128``), bf16 output. Backward runs in bf16 on the dequantized weight (the
parameter itself), so the weight's gradient reaches the fp32 master as in the bf16 path.

Anywhere that path cannot run (a CPU tensor, no kept codes, dims that are not multiples of 128)
the dequantized bf16 weight is used, as a plain ``nn.Linear`` would; on CPU a one-time message
says so. The CUDA path is exercised by ``benchmarks/gpu_suite.py`` on a GPU machine only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raggedfsdp.fsdp.float8 import quantize_tiles

__all__ = ["Float8BlockLinear", "Float8Weight", "float8_block_linear"]

BLOCK = 128  # the tile side scaled_mm's block-wise recipes use
_warned = False


@dataclass(frozen=True)
class Float8Weight:
    """A gathered weight's ``(out, in)`` FP8 codes and ``(out/128, in/128)`` fp32 scales."""

    codes: Tensor
    scales: Tensor


def _fp8_ready(x: Tensor, weight: Tensor) -> Float8Weight | None:
    """The kept codes when the FP8 matmul can run on these operands, else None."""
    global _warned
    kept = getattr(weight, "float8_blocks", None)
    if kept is None:
        return None
    if not x.is_cuda:
        if not _warned:
            _warned = True
            warnings.warn(
                "float8_block_linear: the FP8 matmul (scaled_mm, BlockWise128x128) needs CUDA; "
                "computing with the dequantized weights on "
                f"{x.device.type}",
                stacklevel=3,
            )
        return None
    out_features, in_features = weight.shape
    if out_features % BLOCK or in_features % BLOCK or kept.codes.shape != weight.shape:
        return None
    return kept


def _padded_t(scales: Tensor) -> Tensor:
    """``scales.t()`` over storage whose rows are padded to a multiple of 4 scales (16 bytes),
    the layout torch's own block-wise ``scaled_mm`` samples give cuBLAS."""
    rows, cols = scales.shape
    storage = scales.new_zeros(rows, -(-cols // 4) * 4)
    storage[:, :cols] = scales
    return storage[:, :cols].t()


class _Float8Matmul(torch.autograd.Function):
    """Forward in FP8 (scaled_mm), backward in the weight's dtype on the dequantized weight."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, kept: Float8Weight) -> Tensor:
        ctx.save_for_backward(x, weight)
        codes, scales = quantize_tiles(x[None], (1, BLOCK))
        scale_a = scales[0].t().contiguous().t()  # (M, K/128), outer-dim-major
        return F.scaled_mm(
            codes[0],
            kept.codes.t(),  # (K, N), column-major
            scale_a,
            F.ScalingType.BlockWise1x128,
            _padded_t(kept.scales),  # (K/128, N/128)
            F.ScalingType.BlockWise128x128,
            swizzle_a=F.SwizzleType.NO_SWIZZLE,
            swizzle_b=F.SwizzleType.NO_SWIZZLE,
            output_dtype=weight.dtype,
        )

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def float8_block_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, through the FP8 matmul where the weight's gathered codes
    are kept and the device runs it (see the module notes), else on ``weight`` as it is."""
    kept = _fp8_ready(x, weight)
    if kept is None:
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1]).to(weight.dtype)
    out = _Float8Matmul.apply(flat, weight, kept).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class Float8BlockLinear(nn.Linear):
    """``nn.Linear`` whose forward is ``float8_block_linear`` (swap it in for the model's
    linears; its parameters and state dict are ``nn.Linear``'s)."""

    def forward(self, x: Tensor) -> Tensor:
        return float8_block_linear(x, self.weight, self.bias)
