"""The planner's estimate: per-rank accounting, optimizer models, traffic, Muon owner balance."""

from __future__ import annotations

import math
import random

import pytest

from raggedfsdp.capacity import (
    Group,
    Mesh,
    ModelShapes,
    OptimizerSpec,
    PlanError,
    Precision,
    Settings,
    UnitPolicy,
    estimate,
    load_model,
)
from raggedfsdp.capacity.memory import per_rank
from raggedfsdp.capacity.optimizer_state import state_per_rank
from raggedfsdp.sharding import TensorSpec, plan_layout, resolve_units
from raggedfsdp.sharding.baselines import fsdp2_cuts_units
from tests.support.work import counted_lines


def _toy(repeat: int = 3) -> ModelShapes:
    block = (("wq", (48, 32)), ("w1", (80, 32)), ("w2", (32, 80)), ("norm", (32,)))
    groups = (
        Group("embed", 1, (("embed_tokens.weight", (100, 32)),)),
        Group("block", repeat, block),
        Group("head", 1, (("norm.weight", (32,)), ("lm_head.weight", (100, 32)))),
    )
    return ModelShapes("toy", "test", groups)


def test_per_rank_counts_every_element_once() -> None:
    rng = random.Random(0)
    for _ in range(50):
        specs = [
            TensorSpec.rows(
                f"t{i}",
                (rng.randint(0, 60), rng.choice([1, 3, 8])),
                "float32",
                rng.choice([1, 2, 5]),
            )
            for i in range(rng.randint(1, 8))
        ]
        layout = plan_layout(specs, rng.randint(1, 9))
        held = per_rank(layout, [1.0] * len(specs))
        expected = [sum(n for *_, n in layout.local_pieces(r)) for r in range(layout.world_size)]
        assert held.tolist() == expected


def test_fsdp2_cut_rule_matches_brute_force() -> None:
    """The O(1) rule against every rank boundary of FSDP2's even dim-0 split."""
    rng = random.Random(1)
    for _ in range(300):
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
        world, rows = rng.randint(1, 50), rng.choice([1, 2, 16, 128])
        unit = rows * (shape[-1] if len(shape) > 1 else 1)
        inner = math.prod(shape[1:])
        chunk = -(-shape[0] // world)
        boundaries = [i * chunk * inner for i in range(1, world) if i * chunk < shape[0]]
        expected = any(b % unit for b in boundaries)
        assert fsdp2_cuts_units(shape, world, unit) == expected, (shape, world)


def test_adamw_accounting_is_exact() -> None:
    est = estimate(_toy(), Settings(Mesh(1, 4)))
    mem, world = est.memory, 4
    segments = sum(p.instances * p.segment for p in est.plans)
    assert mem["params"] == mem["grads"] == 4 * segments  # fp32 master, fp32 sharded grads
    # 8 bytes per element held (padding keeps no state) and one fp32 step counter per rank
    assert (mem["optimizer_mean"] - 4) * world == 8 * est.model.numel
    assert mem["optimizer"] >= mem["optimizer_mean"]
    persistent = mem["params"] + mem["optimizer"]
    assert persistent + mem["grads"] <= mem["total"]
    assert mem["total"] <= persistent + mem["grads"] + mem["peak_unsharded"]
    # bf16 gathers cast the master segment into the gathered buffer: no persistent copy
    same = estimate(_toy(), Settings(Mesh(1, 4), precision=Precision("fp32", "fp32", "fp32")))
    assert same.memory["params"] == mem["params"] and same.memory["optimizer"] == mem["optimizer"]


def test_single_rank_has_no_traffic_and_no_padding_beyond_alignment() -> None:
    est = estimate(_toy(), Settings(Mesh(1, 1), optimizer=OptimizerSpec("muon")))
    assert not any(est.traffic[k] for k in ("all_gather", "reduce_scatter", "all_reduce"))
    assert est.padding["pct"] == est.padding["lower_bound_pct"] < 1
    assert est.muon.local_matrices == est.muon.matrices and est.muon.moved_bytes_max == 0


def test_traffic_hsdp_and_reshard_after_forward() -> None:
    model = _toy()
    fsdp = estimate(model, Settings(Mesh(1, 8)))
    hsdp = estimate(model, Settings(Mesh(4, 8)))
    assert hsdp.memory == fsdp.memory  # the replicas hold the same shards
    assert fsdp.traffic["all_reduce"] == 0
    segments = sum(p.instances * p.segment for p in fsdp.plans)
    assert hsdp.traffic["all_reduce"] == pytest.approx(2 * 3 / 4 * segments * 4)
    assert fsdp.traffic["reduce_scatter"] == 7 * segments * 4  # (W - 1) * S * fp32
    assert fsdp.traffic["all_gather"] == 2 * 7 * segments * 2  # twice, bf16
    kept = estimate(model, Settings(Mesh(1, 8), reshard_after_forward=False))
    assert kept.traffic["all_gather"] == fsdp.traffic["all_gather"] / 2
    assert kept.memory["peak_unsharded"] >= fsdp.memory["peak_unsharded"]


def test_root_groups_are_gathered_once() -> None:
    root = Group("root", 1, (("embed_tokens.weight", (100, 32)),), root=True)
    model = ModelShapes("tied", "test", (root, _toy().groups[1]))
    est = estimate(model, Settings(Mesh(1, 8)))
    root_plan = next(p for p in est.plans if p.group.root)
    block_plan = next(p for p in est.plans if not p.group.root)
    expected = 7 * 2 * (root_plan.segment + 2 * 3 * block_plan.segment)
    assert est.traffic["all_gather"] == expected


def _units(policy, shapes: dict[str, tuple[int, ...]], world: int = 1) -> dict[str, int]:
    return resolve_units(policy, [(n, s, "float32") for n, s in shapes.items()], world)


def _state(opt: OptimizerSpec, name: str, shape: tuple[int, ...], world: int = 1) -> list[float]:
    unit = _units(opt.shard_policy(), {name: shape}, world)[name]
    layout = plan_layout([TensorSpec(name, shape, "float32", unit)], world)
    return state_per_rank(layout, [(name, shape)], opt, "float32").tolist()


def test_optimizer_units_and_state_models() -> None:
    big, small = (4096, 64), (64,)
    eight = OptimizerSpec("adamw8bit")
    assert _units(eight.shard_policy(), {"w": big, "b": small}) == {"w": 256, "b": 1}
    assert _state(eight, "w", big) == [4096 * 64 * (2 + 8 / 256)]  # codes + fp32 absmax
    assert _state(eight, "b", small) == [8 * 64]  # below 4,096 elements: fp32 moments
    muon = OptimizerSpec("muon")
    assert _state(muon, "layers.0.wq", big) == [4 * 4096 * 64]
    assert _state(muon, "lm_head.weight", big) == [8 * 4096 * 64]  # AdamW fallback
    shampoo = OptimizerSpec("shampoo", preconditioner_dim=1024)
    assert _units(shampoo.shard_policy(), {"w": (2048, 1536)}) == {"w": 1024 * 1536}
    # two slabs of two 1024-wide column blocks (the 512-wide edge one stored zero-padded):
    # L and R of 1024^2 each per block, and their inverse roots, in fp32
    factors = 2 * (2 * 8 * 1024**2 + 2 * 8 * 1024**2)
    assert _state(shampoo, "w", (2048, 1536)) == [8 * 2048 * 1536 + factors]
    assert _state(shampoo, "w", (2048, 1536), 2) == [8 * 1024 * 1536 + factors / 2] * 2
    assert _state(shampoo, "b", (1500,)) == [8 * 1500]  # vectors: grafting only, no factors
    # The unit policy and the optimizer's blocks combine by LCM: 8-bit blocks never cut.
    est = estimate(_toy(), Settings(Mesh(1, 8), optimizer=eight))
    for plan in est.plans:
        for t in plan.layout.tensors:
            assert t.unit % (256 if t.numel >= 4096 else 1) == 0


def test_shampoo_factors_sit_on_the_rank_holding_their_block() -> None:
    model = ModelShapes("m", "t", (Group("g", 1, (("w", (4096, 1024)),)),))
    est = estimate(model, Settings(Mesh(1, 4), optimizer=OptimizerSpec("shampoo")))
    state = est.plans[0].state  # one 1024-row slab per rank: 8 B/elem + 2 factors and inverses
    assert state.tolist() == [8 * 1024 * 1024 + 8 * 2 * 1024**2] * 4


def test_unit_policies() -> None:
    rows = UnitPolicy("rows", 16).policy()
    assert _units(rows, {"w": (64, 32), "norm": (64,)}) == {"w": 16 * 32, "norm": 16}
    assert _units(UnitPolicy("elements").policy(), {"w": (64, 32)}) == {"w": 1}
    assert UnitPolicy() == UnitPolicy("elements")  # fully_shard's default
    expert = UnitPolicy("expert", 4)
    assert _units(
        expert.policy(),
        {
            "mlp.experts.3.up_proj.weight": (16, 8),
            "mlp.experts.gate_up_proj": (8, 16, 4),
            "self_attn.q_proj.weight": (16, 8),
        },
    ) == {
        "mlp.experts.3.up_proj.weight": 128,
        "mlp.experts.gate_up_proj": 64,
        "self_attn.q_proj.weight": 32,
    }
    assert _units(UnitPolicy("matrix").policy(), {"w": (3, 16, 4), "b": (5,)}) == {"w": 64, "b": 1}
    with pytest.raises(PlanError, match="--unit expert: model 'toy' has no expert tensors"):
        estimate(_toy(), Settings(Mesh(1, 4), units=expert))
    with pytest.raises(PlanError, match="--unit-rows 0"):
        UnitPolicy("rows", 0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("4x", "expected SHARD or REPLICATExSHARD"),
        ("ax2", "expected SHARD"),
        ("2x3x4x5", "expected SHARD"),
        ("0x8", "every dimension must be >= 1"),
        ("-2", "every dimension must be >= 1"),
        ("20000000", "above the planner's limit"),
    ],
)
def test_impossible_meshes(text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Mesh.parse(text)


def test_mesh_and_precision_parsing() -> None:
    assert Mesh.parse("4x256") == Mesh(4, 256) and Mesh.parse(" 8 ") == Mesh(1, 8)
    assert Mesh.parse("2×16").world_size == 32
    assert Precision("bf16", "fp32", "bfloat16").bytes("reduce") == 2
    with pytest.raises(PlanError, match="--param-dtype 'fp7'"):
        Precision(param="fp7")


def test_muon_owner_balance_of_a_transformer_at_w4() -> None:
    est = estimate(load_model("llama3-8b"), Settings(Mesh(1, 4), optimizer=OptimizerSpec("muon")))
    mu = est.muon
    assert mu.matrices == 32 * 7  # embeddings and the head go to AdamW
    assert mu.max_over_mean <= 1.3
    assert mu.bound_over_mean <= mu.max_over_mean
    assert 0 < mu.local_matrices < mu.matrices
    assert mu.moved_bytes_max >= mu.moved_bytes_mean > 0


def test_muon_prefers_the_rank_that_holds_a_matrix() -> None:
    # Four equal matrices, one per rank: every owner is its holder, nothing moves.
    mats = tuple((f"layers.{i}.w", (64, 64)) for i in range(4))
    model = ModelShapes("m", "t", (Group("g", 1, mats),))
    mu = estimate(model, Settings(Mesh(1, 4), optimizer=OptimizerSpec("muon"))).muon
    assert (mu.local_matrices, mu.max_over_mean, mu.moved_bytes_max) == (4, 1.0, 0.0)
    # One matrix split over two ranks: its owner receives the other half and returns it.
    split = ModelShapes("m", "t", (Group("g", 1, (("w", (64, 64)),)),))
    mu = estimate(split, Settings(Mesh(1, 2), optimizer=OptimizerSpec("muon"))).muon
    assert mu.local_matrices == 0
    # each rank sends half the matrix in bf16: the holder its piece, the owner the result back
    assert mu.moved_bytes_max == mu.moved_bytes_mean == 2 * 64 * 32


def test_w_100k_whole_model_is_fast() -> None:
    matrices = 0
    with counted_lines() as work:
        for name in ("deepseek-v3", "llama3-405b", "gpt-oss-120b"):
            est = estimate(
                load_model(name), Settings(Mesh(1, 100_000), optimizer=OptimizerSpec("muon"))
            )
            matrices += est.muon.matrices
        assert math.isfinite(est.memory["total"])
    # About a second each; bounded in lines of the package's Python, deterministic under load
    # (test_cli.py's W=100k test): a few dozen per rank and per Muon matrix.
    assert work.lines <= 40 * (3 * 100_000 + matrices), f"{work.lines:,} lines"
