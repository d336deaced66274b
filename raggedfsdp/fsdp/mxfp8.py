"""MXFP8 weights (OCP Microscaling, MX v1.0): the policy and the quantize/dequantize math.

Each row of a weight's 2-D view is cut into blocks of 32 consecutive elements (the row length
is a multiple of 32). Each block ``B`` gets one power-of-two scale, stored as an e8m0 byte (the
biased exponent: ``scale = 2^(byte - 127)``, byte 255 = NaN), and one ``float8_e4m3fn`` code
per element:

    e     = the smallest integer with amax(|B|) <= 448 * 2^e, clamped to [-127, 127]
            (= ceil(log2(amax / 448)), computed exactly from amax's binary exponent)
    scale = 2^e                          (e8m0 byte e + 127)
    code  = e4m3(clamp(x / scale, -448, 448))    (round to nearest, ties to even)
    x'    = float(code) * scale          (fp32; then cast to the compute dtype)

Rounding the scale *up* keeps every ``|x / scale| <= 448``, so nothing saturates (NVIDIA's
MXFP8 training recipe rounds up too; the OCP spec's example ``floor(log2(amax)) - 8`` puts a
block's amax / scale in [256, 512), so values above 448 saturate). A power of two divides
exactly, so the only rounding is e4m3's. A block's amax / scale lies in (224, 448] before
rounding; the clamp is there for the same reason as in ``raggedfsdp.fsdp.float8`` and never
changes a value here. Only at amax < 448 * 2^-127 (about 1.3e-36) does the clamp of ``e``
matter: the scale stays 2^-127 and the block's codes underflow toward zero, as they would in
any e8m0 format. The product ``x'`` is exact in fp32 except at the top of its range: a value of
at least 248 x 2^120 (about 3.3e38, within 3 % of fp32's largest) rounds to the code 256 at
scale 2^120, and 2^128 is fp32's inf.

Two documented rules for blocks without a finite non-zero amax:

* **zero blocks**: scale 2^0 (byte 127), every code 0, the block decodes to zeros;
* **non-finite blocks** (a NaN or ±inf anywhere in the block): scale byte 255 (e8m0's NaN), so
  the whole block decodes to NaN, with no device-to-host sync, as ``Float8Blocks`` does.

Only the all-gather uses the format: an MX matmul (``scaled_mm`` with ``BlockWise1x32``
scales) needs sm_100 GPUs, so the gathered weights are dequantized into the compute dtype and
``Float8BlockLinear`` stays 128x128-only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from raggedfsdp.fsdp.float8 import FP8_DTYPE, FP8_MAX, decode_e4m3
from raggedfsdp.sharding.float8_payload import MX_BLOCK

__all__ = [
    "E8M0_BIAS",
    "E8M0_NAN",
    "MX_BLOCK",
    "MXFP8Blocks",
    "dequantize_mx",
    "quantize_mx",
]

E8M0_BIAS = 127  # the byte of 2^0
E8M0_NAN = 0xFF
_E_MIN, _E_MAX = -127, 127  # e8m0's finite exponents
#: 448 = 0.875 * 2^9: frexp(amax) = (m, k) with m in [0.5, 1) gives e = k - 9 + (m > 0.875).
_FP8_MAX_EXP, _FP8_MAX_MANTISSA = 9, 0.875


@dataclass(frozen=True)
class MXFP8Blocks:
    """All-gather eligible weights as ``float8_e4m3fn`` codes with one e8m0 (power-of-two)
    scale per 1x32 block of a row (``MixedPrecisionPolicy(all_gather=MXFP8Blocks())``).

    Like ``Float8Blocks(128)``, but blocks never span rows, so ``fully_shard`` needs whole-row
    units only: any row split keeps blocks whole, and the gather costs about ``1 + 1/32`` bytes
    per element at any world size (128-row units can outgrow a rank's share at large ``W`` and
    pad). Eligible: weights of 2+ dims whose row length (last dim) is a multiple of 32; other
    tensors travel in the compute dtype and are listed in the group's ``notes``, or, with
    ``strict=True``, weights of 2+ dims among them are an error naming them. Gradients flow to
    the fp32 master unchanged (straight-through). The format's exact rule is in this module's
    docstring.
    """

    strict: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.strict, bool):
            raise ValueError(f"MXFP8Blocks: strict={self.strict!r} must be True or False")

    # The members the gather reads of a format (as ``Float8Blocks``).
    @property
    def tile(self) -> tuple[int, int]:
        """``(rows, cols)`` of one block: one row, 32 elements."""
        return 1, MX_BLOCK

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def keep_weights(self) -> bool:
        """Always False: no MX matmul here (it needs sm_100), so nothing keeps the codes."""
        return False

    @property
    def requirement(self) -> str:
        """What a weight needs to be quantized (the ``strict`` error says it)."""
        return f"each row needs a multiple of {MX_BLOCK} elements"

    def quantize(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return quantize_mx(x)

    def dequantize(
        self, codes: Tensor, scales: Tensor, dtype: torch.dtype, out: Tensor | None = None
    ) -> Tensor:
        return dequantize_mx(codes, scales, dtype, out)


def quantize_mx(x: Tensor) -> tuple[Tensor, Tensor]:
    """Codes (``float8_e4m3fn``, the shape of ``x``) and e8m0 scales (``uint8``,
    ``(*x.shape[:-1], n / 32)``) of ``x``, whose last dim ``n`` is a multiple of 32."""
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK))
    amax = blocks.abs().amax(dim=-1)
    mantissa, exponent = torch.frexp(amax)
    e = exponent - _FP8_MAX_EXP + (mantissa > _FP8_MAX_MANTISSA).int()
    biased = e.clamp(_E_MIN, _E_MAX) + E8M0_BIAS
    biased = torch.where(amax == 0, E8M0_BIAS, biased)
    biased = torch.where(amax.isfinite(), biased, E8M0_NAN).to(torch.uint8)
    scaled = blocks / _scale_values(biased).unsqueeze(-1)
    codes = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes.view(x.shape), biased


@functools.cache
def _e8m0_table(device: torch.device) -> Tensor:
    """The fp32 value of each e8m0 byte: 2^-127 .. 2^127 (exact in fp32), then NaN."""
    powers = torch.exp2(torch.arange(_E_MIN, _E_MAX + 1, dtype=torch.float64)).float()
    return torch.cat([powers, torch.tensor([torch.nan])]).to(device)


def _scale_values(scales: Tensor) -> Tensor:
    table = _e8m0_table(scales.device)
    return table.index_select(0, scales.reshape(-1).int()).view(scales.shape)


def dequantize_mx(
    codes: Tensor, scales: Tensor, dtype: torch.dtype, out: Tensor | None = None
) -> Tensor:
    """``float(code) * 2^(scale - 127)`` per block, cast to ``dtype`` (written into ``out``,
    the shape of ``codes``, when given)."""
    values = decode_e4m3(codes).unflatten(-1, (-1, MX_BLOCK)) * _scale_values(scales)[..., None]
    values = values.view(codes.shape)
    if out is None:
        return values.to(dtype)
    return out.copy_(values)
