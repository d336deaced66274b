"""The block-wise FP8 all-gathers (``Float8Blocks``, ``MXFP8Blocks``): units, payload, bitwise
equality with one process, training."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from raggedfsdp import MixedPrecisionPolicy, fully_shard
from raggedfsdp.fsdp import Float8BlockLinear, Float8Blocks, MXFP8Blocks, float8_block_linear
from raggedfsdp.fsdp.float8 import quantize_tiles
from raggedfsdp.fsdp.float8_gather import Float8Format, Float8Gather
from raggedfsdp.fsdp.state import STATE_ATTR
from raggedfsdp.sharding import (
    DEFAULT_POLICY,
    TensorMeta,
    TensorSpec,
    combine,
    plan_layout,
    resolve_units,
    row_units,
)
from raggedfsdp.sharding.float8_payload import Float8Payload
from raggedfsdp.sharding.units import float8_block_policy, float8_tiles
from tests.support.fsdp_training import ROWS, my_rows, shard_blocks, train
from tests.support.tiny_models import batch, loss_fn, make_model

BLOCK = 4  # small tiles, so tiny tensors have partial edges, several tiles and uneven shards
FP8 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather=Float8Blocks(BLOCK))

#: name -> shape: edge tiles in both dims, unaligned experts (6 rows: whole experts per rank),
#: aligned experts (8 rows: 4-row bands), and tensors kept in bf16 (too few rows, vectors).
SHAPES = {
    "dense": (10, 13),
    "experts.w1": (3, 6, 5),
    "experts.w2": (2, 8, 6),
    "small": (3, 16),
    "bias": (7,),
    "tall": (40, 4),
}
MX = MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather=MXFP8Blocks())
#: For 1x32 blocks: uneven rows, experts cut between any rows, fewer rows than ranks (empty
#: pieces), and tensors kept in bf16 (rows of 48, vectors).
MX_SHAPES = {
    "dense": (10, 64),
    "experts.w1": (3, 5, 32),
    "wide": (2, 96),
    "odd": (7, 48),
    "bias": (7,),
}


class Params(nn.Module):
    def __init__(self, shapes: dict = SHAPES) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = nn.Module()
        for name, shape in shapes.items():
            owner, leaf = (self.experts, name[8:]) if name.startswith("experts.") else (self, name)
            owner.register_parameter(leaf, nn.Parameter(torch.randn(shape) * 3))
        with torch.no_grad():
            self.dense[:4, : 4 if shapes is SHAPES else 32] = 0  # a zero tile / 4 zero blocks


# ----------------------------------------------------------------------------- unit rule
def test_the_unit_rule_keeps_tiles_whole_and_lists_the_rest():
    assert float8_tiles("w", (10, 13), 4) == (10, 13)
    assert float8_tiles("experts.w1", (3, 6, 5), 4) == (6, 5)  # tiles restart per expert
    assert float8_tiles("experts.w2", (2, 8, 6), 4) == (16, 6)  # = tiles of the (16, 6) view
    assert float8_tiles("w", (3, 16), 4) is None and float8_tiles("b", (7,), 4) is None
    assert float8_tiles("conv", (8, 8, 3, 3), 4) is None  # rows of 3: last dim too short
    policy = float8_block_policy(128)
    assert policy("w", TensorMeta((4096, 1024))) == 128 * 1024
    assert policy("experts.w", TensorMeta((8, 200, 256))) == 200 * 256
    assert policy("experts.w", TensorMeta((8, 256, 512))) == 128 * 512
    assert policy("norm", TensorMeta((4096,))) == 1
    combined = combine(row_units(32), policy)  # an optimizer's 32-row blocks: still 128 rows
    assert combined("w", TensorMeta((4096, 1024))) == 128 * 1024
    with pytest.raises(ValueError, match="block=0"):
        float8_block_policy(0)


def test_mx_units_are_whole_rows_of_weights_with_whole_blocks():
    assert float8_tiles("w", (10, 64), (1, 32)) == (10, 64)
    assert float8_tiles("experts.w1", (3, 5, 32), (1, 32)) == (15, 32)  # blocks never span rows
    for shape in [(7, 48), (8, 16), (0, 64), (7,)]:
        assert float8_tiles("w", shape, (1, 32)) is None
    policy = float8_block_policy((1, 32))
    assert policy("layers.0.w2", TensorMeta((4096, 14336))) == 14336  # not 128 x 14336
    assert policy("experts.w", TensorMeta((8, 200, 256))) == 256
    assert combine(row_units(32), policy)("w", TensorMeta((64, 96))) == 32 * 96
    with pytest.raises(ValueError, match=r"block=\(1, 0\)"):
        float8_block_policy((1, 0))


def _plan(world: int, shapes: dict = SHAPES, block=BLOCK, scale_bytes: int = 4) -> Float8Payload:
    tensors = [(n, s, "float32") for n, s in shapes.items()]
    units = resolve_units(float8_block_policy(block), tensors, world)
    layout = plan_layout(
        [TensorSpec(n, s, "float32", units[n]) for n, s, _ in tensors],
        world,
    )
    tiles = {n: float8_tiles(n, s, block) for n, s in shapes.items()}
    eligible = {n: t for n, t in tiles.items() if t}
    return Float8Payload(layout, eligible, block, 2, scale_bytes=scale_bytes)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize(
    ("shapes", "block", "scale_bytes", "want_scales"),
    [
        (SHAPES, BLOCK, 4, 3 * 4 + 3 * 2 * 2 + 4 * 2 + 10 * 1),  # dense, w1, w2, tall
        (MX_SHAPES, (1, 32), 1, 10 * 2 + 15 * 1 + 2 * 3),  # dense, w1, wide
    ],
    ids=["128x128", "mx"],
)
def test_the_payload_holds_every_element_once_and_its_scales(
    world, shapes, block, scale_bytes, want_scales
):
    plan = _plan(world, shapes, block, scale_bytes)
    seen = {}
    for pieces in plan.pieces:
        for p in pieces:
            seen.setdefault(p.name, []).append((p.tensor_offset, p.numel))
            assert p.data_offset % 16 == 0 and p.scale_offset % 16 == 0
    for name, shape in shapes.items():
        spans = sorted(seen[name])
        assert spans[0][0] == 0 and sum(n for _, n in spans) == torch.Size(shape).numel()
    scales = sum(p.num_scales for pieces in plan.pieces for p in pieces)
    assert scales == want_scales
    assert plan.segment_bytes >= max(plan.rank_bytes(r) for r in range(world))


def test_a_unit_that_cuts_tiles_is_refused():
    layout = plan_layout([TensorSpec("w", (8, 8), "float32", 8)], 2)
    with pytest.raises(ValueError, match="cuts its 4x4 FP8 tiles"):
        Float8Payload(layout, {"w": (8, 8)}, BLOCK, 2)


# ----------------------------------------------------------------------------- the gather
def _reference(
    name: str, full: torch.Tensor, fmt: Float8Format = FP8.all_gather
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One process's codes, scales and dequantized bf16 weight (the policy's own math)."""
    matrix_rows, cols = float8_tiles(name, full.shape, fmt.tile)
    codes, scales = fmt.quantize(full.reshape(-1, matrix_rows, cols))
    return codes, scales, fmt.dequantize(codes, scales, torch.bfloat16).view(full.shape)


def _gathered(hsdp: bool = False, mp: MixedPrecisionPolicy = FP8) -> dict:
    fmt = mp.all_gather
    shapes = MX_SHAPES if isinstance(fmt, MXFP8Blocks) else SHAPES
    originals = dict(Params(shapes).named_parameters())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = fully_shard(Params(shapes), mesh=mesh, mp_policy=mp, shard_policy=row_units(1))
    group = getattr(model, STATE_ATTR).group
    captured = {}
    real_unpack = Float8Gather.unpack

    def unpack(self, full, compute):
        captured.update(self.weights(full))
        real_unpack(self, full, compute)

    with mock.patch.object(Float8Gather, "unpack", unpack):
        model.unshard()
    result = {"notes": group.notes, "mismatch": []}
    for name, param in model.named_parameters():
        full = originals[name].detach()
        want = full.bfloat16()
        if float8_tiles(name, full.shape, fmt.tile) is not None:
            want_codes, want_scales, want = _reference(name, full, fmt)
            codes, scales = captured[name]
            if not torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)):
                result["mismatch"].append(f"{name} codes")
            if not torch.equal(scales, want_scales):
                result["mismatch"].append(f"{name} scales")
        if param.dtype != torch.bfloat16 or not torch.equal(param, want):
            result["mismatch"].append(name)
    model.reshard()
    return result


def test_gathered_weights_and_scales_equal_one_process_quantization(pool):
    for res in pool.run(_gathered):
        assert res["mismatch"] == [], res


@pytest.mark.parametrize("world_size", [4])
def test_hsdp_gathers_over_the_shard_dim_with_the_same_result(pool):
    for res in pool.run(_gathered, True):
        assert res["mismatch"] == [], res


@pytest.mark.parametrize("world_size", [3])
def test_notes_list_what_stays_in_bf16_and_strict_names_it(pool):
    for res in pool.run(_gathered):  # every rank's group notes the same
        assert "FP8 all-gather: kept in bfloat16: small, bias" in res["notes"]
    strict = MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather=Float8Blocks(4, True))
    with pytest.raises(ValueError, match=r"cannot tile small \(3, 16\): each matrix needs"):
        fully_shard(Params(), mp_policy=strict)
    with pytest.raises(TypeError, match="all_gather="):
        MixedPrecisionPolicy(all_gather="fp8")


def test_mx_gathered_weights_and_scales_equal_one_process_quantization(pool):
    for res in pool.run(_gathered, False, MX):
        assert res["mismatch"] == [], res


@pytest.mark.parametrize("world_size", [3])
def test_mx_notes_list_what_stays_in_bf16_and_strict_names_it(pool):
    for res in pool.run(_gathered, False, MX):
        assert "FP8 all-gather: kept in bfloat16: odd, bias" in res["notes"]
    strict = MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather=MXFP8Blocks(True))
    with pytest.raises(ValueError, match=r"cannot tile odd \(7, 48\): each row needs a multiple"):
        fully_shard(Params(MX_SHAPES), mp_policy=strict)


# ----------------------------------------------------------------------------- training
def _quantized_copy(model: nn.Module, fmt: Float8Format) -> nn.Module:
    """``model`` with every tiled weight replaced by its dequantized value (fp32, exact)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if float8_tiles(name, param.shape, fmt.tile) is not None:
                param.copy_(_reference(name, param.detach(), fmt)[2].float())
    return model


def _straight_through(reshard_after_forward: bool, mp: MixedPrecisionPolicy = FP8) -> dict:
    """First-step gradients of the FP8 gather equal the bf16 gather's on the dequantized
    weights (same units, so the same layout and reduction), bitwise; then a few steps train.
    MXFP8 gets a model whose rows are multiples of 32, so every weight is quantized."""
    fmt = mp.all_gather
    dims = {"dim": 32, "hidden": 64} if isinstance(fmt, MXFP8Blocks) else {}
    units = combine(DEFAULT_POLICY, float8_block_policy(fmt.tile))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    kwargs = {"reshard_after_forward": reshard_after_forward}
    ours = shard_blocks(make_model(**dims), mp_policy=mp, **kwargs)
    reference = _quantized_copy(make_model(**dims), fmt)
    ref = shard_blocks(reference, mp_policy=bf16, shard_policy=units, **kwargs)
    grads = []
    for model in (ours, ref):
        inputs, targets = batch(0, ROWS)
        loss_fn(model, my_rows(inputs), my_rows(targets)).backward()
        grads.append({n: p.grad.local.clone() for n, p in model.named_parameters()})
    same = all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    ours.zero_grad()
    losses = train(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2), 4)
    return {"same_grads": same, "losses": losses}


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_gradients_pass_straight_through_and_training_runs(pool, reshard_after_forward):
    for res in pool.run(_straight_through, reshard_after_forward):
        assert res["same_grads"], res
        assert res["losses"][-1] < res["losses"][0], res


@pytest.mark.parametrize("world_size", [3])
def test_mx_gradients_pass_straight_through_and_training_runs(pool):
    for res in pool.run(_straight_through, True, MX):
        assert res["same_grads"], res
        assert res["losses"][-1] < res["losses"][0], res


# ----------------------------------------------------------------------------- FP8 compute
def _kept_codes() -> dict:
    keep = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, all_gather=Float8Blocks(128, keep_weights=True)
    )
    torch.manual_seed(0)
    model = nn.Sequential(Float8BlockLinear(256, 384, bias=True), nn.ReLU(), nn.Linear(384, 200))
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model, mp_policy=keep)
    model.unshard()
    res = {"codes_equal": True}
    for name, param in model.named_parameters():
        kept = getattr(param, "float8_blocks", None)
        if name.endswith("weight"):
            codes, scales = quantize_tiles(want[name][None], 128)
            res["codes_equal"] &= torch.equal(
                kept.codes.view(torch.uint8), codes[0].view(torch.uint8)
            )
            res["codes_equal"] &= torch.equal(kept.scales, scales[0])
        else:
            res["codes_equal"] &= kept is None
    x = torch.randn(3, 5, 256)
    with pytest.warns(UserWarning, match="needs CUDA"):
        out = float8_block_linear(x.bfloat16(), model[0].weight, model[0].bias)
    res["fallback_is_linear"] = torch.equal(
        out, F.linear(x.bfloat16(), model[0].weight, model[0].bias)
    )
    model.reshard()
    model.unshard()  # gathered again: codes again; freed: none
    res["kept_again"] = hasattr(model[0].weight, "float8_blocks")
    model.reshard()
    res["dropped"] = not any(
        hasattr(mp.unsharded, "float8_blocks") for mp in getattr(model, STATE_ATTR).group.params
    )
    return res


@pytest.mark.parametrize("world_size", [1, 3])
def test_kept_codes_feed_the_fp8_linear_and_cpu_falls_back(pool):
    for res in pool.run(_kept_codes):
        assert res == {
            "codes_equal": True,
            "fallback_is_linear": True,
            "kept_again": True,
            "dropped": True,
        }


#: A weight of two units per format (4-row FP8 tiles, MXFP8's rows): at W=4 two ranks hold nothing.
TWO_UNIT_LINEARS = {"fp8": (FP8, 8, 8), "mxfp8": (MX, 64, 2)}


def _empty_ranks(kind: str) -> dict:
    policy, in_features, out_features = TWO_UNIT_LINEARS[kind]
    torch.manual_seed(0)
    model = nn.Linear(in_features, out_features, bias=False)
    want = _reference("weight", model.weight.detach().clone(), policy.all_gather)[2]
    fully_shard(model, mp_policy=policy)
    local = model.weight.local.numel()
    model.unshard()
    return {"equal": torch.equal(model.weight, want), "empty": local == 0}


@pytest.mark.parametrize("world_size", [4])
@pytest.mark.parametrize("kind", sorted(TWO_UNIT_LINEARS))
def test_ranks_holding_nothing_still_gather_everything(pool, kind):
    results = pool.run(_empty_ranks, kind)
    assert all(r["equal"] for r in results) and sum(r["empty"] for r in results) == 2
