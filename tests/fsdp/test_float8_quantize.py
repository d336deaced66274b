"""The block-wise FP8 quantizer against a written-out float64 reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raggedfsdp.fsdp.float8 import FP8_MAX, Float8Blocks, dequantize_tiles, quantize_tiles


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
