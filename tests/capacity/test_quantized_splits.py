"""AdamW8bit's blocks under TP and EP splits: one rule (``sharding.quant_tp``), the same answer
from the rule, the planner (``estimate`` refuses in one line naming the flags) and the runtime
(``AdamW8bit`` built on the DTensors ``--verify`` places as the recipe does, on the fake
process group), case by case."""

from __future__ import annotations

import re

import pytest

from raggedfsdp.capacity import Mesh, OptimizerSpec, PlanError, Settings, estimate
from raggedfsdp.capacity.model_shapes import ModelShapes, parse_shapes
from raggedfsdp.sharding.quant_tp import quant_split_grid

WO = ("attention.wo.weight", [256, 256])  # RowwiseParallel: Shard(1)
WQ = ("attention.wq.weight", [256, 256])  # ColwiseParallel: Shard(0)
ROUTER = ("feed_forward.router.weight", [8, 256])  # replicated, below min_8bit_size
W1 = ("feed_forward.experts.w1", [8, 512, 256])  # (E, d_ff, d): Shard(1) over tp
W2 = ("feed_forward.experts.w2", [8, 256, 512])  # (E, d, d_ff): Shard(2) over tp

#: case: (tensors, --mesh, optimizer settings, the global shape and (dim, ranks) splits of the
#: tensor that decides, what the rule says: grid dims, or a phrase of its refusal)
CASES = {
    "rowwise blocks": ([WO], "1x2x2", {}, ((256, 256), [(1, 2)]), "cross its TP blocks"),
    "rowwise tiles": ([WO], "1x2x2", {"tile": (32, 32)}, ((256, 256), [(1, 2)]), (1,)),
    "rowwise narrow tiles": (
        [WO],
        "1x2x2",
        {"tile": (32, 48)},
        ((256, 256), [(1, 2)]),
        "128 columns per TP rank cut tile=(32, 48)",
    ),
    "colwise blocks": ([WQ], "1x2x2", {}, ((256, 256), [(0, 2)]), (0,)),
    "colwise tall tiles": (
        [WQ],
        "1x2x2",
        {"tile": (48, 32)},
        ((256, 256), [(0, 2)]),
        "128 rows per TP rank cut tile=(48, 32)",
    ),
    "experts' d_ff over tp": (
        [W1, W2],
        "1x2x2",
        {"tile": (32, 32)},
        ((8, 512, 256), [(1, 2)]),
        "the split of dim 1 interleaves",
    ),
    "experts' down over tp": ([W2], "1x2x2", {"tile": (32, 32)}, ((8, 256, 512), [(2, 2)]), (1,)),
    "experts over ep": ([ROUTER, W1], "dp_shard=2,ep=2", {}, ((8, 512, 256), [(0, 2)]), (0,)),
    "experts over ep, odd blocks": (
        [ROUTER, W1],
        "dp_shard=2,ep=2",
        {"block_size": 3000},
        ((8, 512, 256), [(0, 2)]),
        "524288 elements per TP rank cut 3000-element blocks",
    ),
    "ep x tp down": (
        [ROUTER, W2],
        "dp_shard=2,tp=2,ep=2",
        {"tile": (32, 32)},
        ((8, 256, 512), [(0, 2), (2, 2)]),
        (0, 1),
    ),
    "ep x tp gate": (
        [ROUTER, W1],
        "dp_shard=2,tp=2,ep=2",
        {"tile": (32, 32)},
        ((8, 512, 256), [(0, 2), (1, 2)]),
        "the split of dim 1 interleaves",
    ),
}


def _case(case: str) -> tuple[ModelShapes, Settings]:
    tensors, mesh, options, _, _ = CASES[case]
    groups = [{"name": "layer", "repeat": 1, "tensors": [list(t) for t in tensors]}]
    model = parse_shapes({"name": "splits", "groups": groups}, "test")
    optimizer = OptimizerSpec("adamw8bit", **options)
    return model, Settings(Mesh.parse(mesh), optimizer=optimizer, top_k=2)


@pytest.mark.parametrize("case", CASES)
def test_the_rule(case: str) -> None:
    _, _, options, (shape, splits), expected = CASES[case]
    block, tile = options.get("block_size", 256), options.get("tile")
    if isinstance(expected, tuple):
        assert quant_split_grid(shape, splits, block, tile) == expected
        return
    with pytest.raises(ValueError, match=re.escape(expected)) as err:
        quant_split_grid(shape, splits, block, tile)
    assert "AdamW" in str(err.value) and "\n" not in str(err.value)


def test_a_split_over_one_rank_cuts_nothing() -> None:
    """A mesh dim of one rank splits nothing; the others are judged as without it."""
    assert quant_split_grid((256, 256), [(1, 1)], 256, None) == (None,)
    assert quant_split_grid((8, 256, 512), [(0, 1), (2, 2)], 256, (32, 32)) == (None, 1)
    with pytest.raises(ValueError, match="the split of dim 1 interleaves"):
        quant_split_grid((8, 512, 256), [(0, 1), (1, 2)], 256, (32, 32))


@pytest.mark.parametrize("case", CASES)
def test_the_planner_refuses_what_the_rule_refuses(case: str) -> None:
    model, settings = _case(case)
    expected = CASES[case][-1]
    if isinstance(expected, tuple):
        estimate(model, settings)
        return
    with pytest.raises(PlanError, match=re.escape(expected)) as err:
        estimate(model, settings)
    message = str(err.value)
    assert message.startswith(f"--optimizer adamw8bit with --mesh {settings.mesh.text}: ")
    assert "--optimizer adamw" in message and "\n" not in message
    assert "tile=(rows, cols)" not in message  # the CLI's flags, not the constructor's


def _runtime(case: str) -> str | None:
    """Build the case as ``--verify`` does (the planner's placements as DTensors on the
    recipe's meshes, ``fully_shard``) as rank 0 on the fake process group, and AdamW8bit on
    it: its refusal, or ``None``."""
    from raggedfsdp.capacity import verify
    from raggedfsdp.dry_run.run import tensor_mode
    from raggedfsdp.dry_run.world import fake_world
    from raggedfsdp.fsdp import fully_shard

    model, settings = _case(case)
    try:
        with fake_world(0, settings.mesh.world_size), tensor_mode("fake"):
            verify._build(model, settings)(fully_shard)
    except PlanError as err:
        return str(err)
    return None


@pytest.mark.parametrize("case", CASES)
def test_the_runtime_refuses_the_same(case: str) -> None:
    expected = CASES[case][-1]
    refusal = _runtime(case)
    if isinstance(expected, tuple):
        assert refusal is None, refusal
        return
    assert refusal is not None and expected in refusal, refusal
    assert "the runtime refuses it" in refusal and "\n" not in refusal
