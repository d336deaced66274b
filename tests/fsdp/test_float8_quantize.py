"""The block-wise FP8 and MXFP8 quantizers against written-out float64 references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raggedfsdp.fsdp.float8 import FP8_MAX, Float8Blocks, dequantize_tiles, quantize_tiles
from raggedfsdp.fsdp.mxfp8 import MXFP8Blocks, dequantize_mx, quantize_mx


def _e4m3_grid() -> np.ndarray:
    """Every finite non-negative float8_e4m3fn value, in code order: subnormals ``k * 2^-9``,
    then ``(1 + k/8) * 2^(e-7)`` for exponents 1..15 (the top code of exponent 15 is NaN)."""
    values = [k * 2.0**-9 for k in range(8)]
    values += [(1 + k / 8) * 2.0 ** (e - 7) for e in range(1, 16) for k in range(8)]
    return np.array(values[:-1])


GRID = _e4m3_grid()


def _round_e4m3(v: float) -> float:
    """Nearest grid value to ``|v|`` (saturating at 448), ties to the even code."""
    a = min(abs(v), FP8_MAX)
    i = int(np.searchsorted(GRID, a))
    if i == len(GRID) or GRID[i] == a:
        out = GRID[min(i, len(GRID) - 1)]
    else:
        lo, hi = GRID[i - 1], GRID[i]
        below, above = a - lo, hi - a
        out = lo if below < above or (below == above and (i - 1) % 2 == 0) else hi
    return math.copysign(out, v)


def _f32(v: float) -> float:
    return float(np.float32(v))


def _reference(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Dequantized values (float64 of the fp32 products) and scales of one matrix, tile by tile,
    written out with scalar float64 arithmetic (correctly rounded to fp32 where torch rounds)."""
    m, n = x.shape
    tr, tc = -(-m // block), -(-n // block)
    scales = np.zeros((tr, tc))
    out = np.zeros((m, n))
    for i in range(tr):
        for j in range(tc):
            tile = x[i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax = float(np.abs(tile).max())
            scale = _f32(amax / FP8_MAX) if math.isfinite(amax) else math.nan
            scale = 1.0 if scale == 0 else scale
            scales[i, j] = scale
            for (a, b), v in np.ndenumerate(tile):
                code = _round_e4m3(_f32(v / scale)) if math.isfinite(scale) else math.nan
                out[i * block + a, j * block + b] = _f32(code * scale)
    return out, scales


def _check(x: torch.Tensor, block: int) -> None:
    codes, scales = quantize_tiles(x[None], block)
    values = dequantize_tiles(codes, scales, block, torch.float32)[0]
    want, want_scales = _reference(x.double().numpy(), block)
    np.testing.assert_array_equal(scales[0].double().numpy(), want_scales)
    np.testing.assert_array_equal(values.double().numpy(), want)
    bf16 = dequantize_tiles(codes, scales, block, torch.bfloat16)[0]
    want_bf16 = torch.from_numpy(want).float().bfloat16()
    torch.testing.assert_close(bf16, want_bf16, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(8, 8), (11, 6), (5, 13)])
def test_random_tiles_match_the_reference(shape):
    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[1])  # tiles of very different ranges
    _check(x, 4)


def test_zero_subnormal_and_saturating_tiles():
    x = torch.zeros(8, 8)
    x[4:, :4] = torch.tensor([1e-43, -2e-44, 0.0, 3e-45])  # amax / 448 underflows to 0
    x[:4, 4:] = torch.linspace(-1, 1, 16).reshape(4, 4) * 2.0**-14  # subnormal codes
    x[:4, 4:][0, 0] = 1.0  # ... beside the tile's largest value
    x[4:, 4:] = torch.tensor([3.4e38, -3.4e38, 1.0, 2.0]).repeat(4, 1)  # near 448
    _check(x, 4)
    codes, scales = quantize_tiles(x[None], 4)
    assert scales[0, 0, 0] == 1 and scales[0, 1, 0] == 1  # the zero rules
    assert not torch.isnan(codes.float()).any()
    assert codes.float().abs().max() == FP8_MAX


def test_ties_round_to_even_and_the_tile_maximum_is_exact():
    # scale = 448/448 = 1: values are rounded as they are
    tile = torch.tensor([448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -1.0625, 0.0, 1.0])
    codes, scales = quantize_tiles(tile.reshape(1, 2, 4), 4)
    assert scales.item() == 1
    assert codes.float().flatten().tolist() == [448, 1, 1.25, 0, 2.0**-8, -1, 0, 1]


def test_non_finite_values_make_their_tile_nan_only():
    x = torch.ones(8, 8)
    x[0, 0] = float("nan")
    x[5, 1] = float("inf")
    codes, scales = quantize_tiles(x[None], 4)
    values = dequantize_tiles(codes, scales, 4, torch.bfloat16)[0]
    assert values[:4, :4].isnan().all() and values[4:, :4].isnan().all()
    assert (values[:, 4:] == 1).all()
    _check(x, 4)


def test_stacked_matrices_are_tiled_each_on_its_own():
    torch.manual_seed(0)
    x = torch.randn(3, 6, 5)
    codes, scales = quantize_tiles(x, 4)
    assert scales.shape == (3, 2, 2)
    for e in range(3):
        c, s = quantize_tiles(x[e : e + 1], 4)
        assert torch.equal(s, scales[e : e + 1])
        assert torch.equal(c.view(torch.uint8), codes[e : e + 1].view(torch.uint8))


@pytest.mark.parametrize("bad", [0, -128, 1.5, True, "128"])
def test_the_policy_names_a_bad_block(bad):
    with pytest.raises(ValueError, match="Float8Blocks: block="):
        Float8Blocks(bad)
    with pytest.raises(ValueError, match="strict="):
        Float8Blocks(128, strict="yes")


# ----------------------------------------------------------------------------- MXFP8
def _mx_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dequantized values and e8m0 bytes of one matrix, block by block, in float64: the
    smallest power of two ``2^e`` with ``amax <= 448 * 2^e`` found by counting up (not by
    ``frexp``, as the code does), ``e`` clamped to e8m0's [-127, 127]."""
    m, n = x.shape
    scales = np.zeros((m, n // 32), dtype=np.uint8)
    out = np.zeros((m, n))
    for i in range(m):
        for j in range(n // 32):
            block = x[i, 32 * j : 32 * (j + 1)]
            amax = float(np.abs(block).max())
            if not math.isfinite(amax):
                scales[i, j], out[i, 32 * j : 32 * (j + 1)] = 255, math.nan
                continue
            e = 0
            if amax > 0:
                e = math.floor(math.log2(amax)) - 11
                while amax > FP8_MAX * 2.0**e:
                    e += 1
                e = min(max(e, -127), 127)
            scales[i, j] = e + 127
            for k, v in enumerate(block):
                assert abs(v / 2.0**e) <= FP8_MAX
                with np.errstate(over="ignore"):  # 256 * 2^120 is fp32's inf
                    out[i, 32 * j + k] = _f32(_round_e4m3(v / 2.0**e) * 2.0**e)
    return out, scales


def _check_mx(x: torch.Tensor) -> None:
    codes, scales = quantize_mx(x[None])
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
    values = dequantize_mx(codes, scales, torch.float32)[0]
    want, want_scales = _mx_reference(x.double().numpy())
    np.testing.assert_array_equal(scales[0].numpy(), want_scales)
    np.testing.assert_array_equal(values.double().numpy(), want)
    bf16 = dequantize_mx(codes, scales, torch.bfloat16)[0]
    want_bf16 = torch.from_numpy(want).float().bfloat16()
    torch.testing.assert_close(bf16, want_bf16, rtol=0, atol=0, equal_nan=True)


def test_mx_random_blocks_match_the_reference():
    torch.manual_seed(1)
    x = torch.randn(6, 128) * torch.logspace(-30, 30, 128)  # blocks of very different ranges
    _check_mx(x)


def test_mx_zero_subnormal_power_of_two_and_non_finite_blocks():
    x = torch.ones(2, 32 * 8)
    x[0, :32] = 0  # zero block: 2^0
    x[0, 32:64] = torch.linspace(-1, 1, 32) * 1e-40  # fp32 subnormals: e clamped to -127
    x[0, 64:96] = torch.linspace(-1, 1, 32) * 2.0**-14  # subnormal codes beside ...
    x[0, 64] = 1.0  # ... the block's largest value (scale 2^-8)
    x[0, 96:128] = 448.0  # amax = 448 exactly: scale 2^0 ...
    x[0, 97:101] = torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10])  # ... and ties
    x[0, 128:160] = 448.5  # a hair above: scale 2^1
    x[0, 160:192] = 3.4e38  # near fp32's largest: the code 256 x 2^120 overflows to inf
    x[1, 5] = float("nan")
    x[1, 40] = float("-inf")
    _check_mx(x)
    codes, scales = quantize_mx(x[None])
    assert scales[0, 0].tolist()[:7] == [127, 0, 119, 127, 128, 247, 119]
    sub = codes[0, 0, 65:96].float().abs()
    assert ((sub > 0) & (sub < 2.0**-6)).sum() >= 8  # e4m3 subnormals, not just zeros
    values = dequantize_mx(codes, scales, torch.bfloat16)[0]
    assert values[1, :64].isnan().all() and (values[1, 64:] == 1).all()
    assert codes[0, 0, 97:101].float().tolist() == [1, 1.25, 0, 2.0**-8]  # ties to even
    assert (values[0, 101:128] == 448).all() and values[0, 160:192].isinf().all()


def test_mx_blocks_follow_rows_and_the_policy_checks_its_flag():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64)
    codes, scales = quantize_mx(x)
    assert scales.shape == (3, 5, 2)
    c, s = quantize_mx(x[1, 2:3, 32:])  # one block on its own
    assert torch.equal(s[0], scales[1, 2, 1:])
    assert torch.equal(c.view(torch.uint8), codes[1, 2:3, 32:].view(torch.uint8))
    assert MXFP8Blocks().tile == (1, 32) and not MXFP8Blocks().keep_weights
    with pytest.raises(ValueError, match="MXFP8Blocks: strict="):
        MXFP8Blocks("yes")
