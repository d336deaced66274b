"""The default shard policy keeps fused experts whole on ranks wherever that fits its budget.

Fused expert tensors ``(E, m, n)`` with ``E`` not divisible by ``W`` are where an even split
cuts through experts; the default (``DEFAULT_POLICY``) keeps each expert, or ``k`` of its rows
when ``E < W``, on one rank whenever the group's planned padding stays within element units'
plus ``max_extra_padding`` (0.1 %) of the group's elements.
"""

from __future__ import annotations

import itertools
import math

import pytest

from raggedfsdp.sharding.planner import DEFAULT_ALIGNMENT_BYTES, TensorSpec
from raggedfsdp.sharding.units import (
    DEFAULT_MAX_EXTRA_PADDING,
    DEFAULT_POLICY,
    ExpertShardPolicy,
    GroupShardPolicy,
    MuonShardPolicy,
    TensorMeta,
    adamw8bit_policy,
    combine,
    expert_matrix,
    expert_notes,
    planned_padding,
    resolve_units,
)

#: (E, m, n) of fused experts whose E no test world size divides, and a few that it does
EXPERT_SHAPES = [(6, 64, 32), (8, 48, 64), (10, 32, 16), (2, 64, 32), (3, 96, 8), (12, 8, 8)]
#: other tensors of the same group (none, a norm, a dense matrix and a bias)
EXTRAS = [(), (("norm.weight", (32,)),), (("attn.wq.weight", (32, 32)), ("attn.bias", (36,)))]


def _group(shape: tuple[int, ...], extras) -> list[tuple[str, tuple[int, ...], str]]:
    e, m, n = shape
    experts = [("mlp.experts.w1", (e, m, n)), ("mlp.experts.w2", (e, n, m))]
    return [(name, s, "float32") for name, s in (*experts, *extras)]


def _padding(tensors, units, world: int) -> int:
    return planned_padding(tensors, units, world, DEFAULT_ALIGNMENT_BYTES)


def test_default_is_a_group_policy_answering_elements_per_tensor():
    assert isinstance(DEFAULT_POLICY, GroupShardPolicy)
    assert DEFAULT_POLICY("mlp.experts.w1", TensorMeta((6, 64, 32))) == 1
    tensors = _group((6, 64, 32), ())
    assert set(resolve_units(DEFAULT_POLICY, tensors, 1).values()) == {1}


@pytest.mark.parametrize(("shape", "world"), [((6, 64, 32), 3), ((8, 48, 64), 4)])
def test_whole_experts_where_they_divide_evenly(shape, world):
    _, m, n = shape
    units = resolve_units(DEFAULT_POLICY, _group(shape, ()), world)
    assert units == {"mlp.experts.w1": m * n, "mlp.experts.w2": m * n}


def test_k_rows_of_each_expert_when_fewer_experts_than_ranks():
    # 2 experts over 4 ranks: whole experts leave ranks empty (padding); half experts do not
    units = resolve_units(DEFAULT_POLICY, [("experts.w", (2, 64, 32), "float32")], 4)
    assert units == {"experts.w": 32 * 32}


def test_element_units_where_whole_experts_would_pad():
    # 6 experts over 4 ranks alone: whole experts need 8 slots, elements pad nothing
    units = resolve_units(DEFAULT_POLICY, [("experts.w", (6, 64, 32), "float32")], 4)
    assert units == {"experts.w": 1}


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0.0, DEFAULT_MAX_EXTRA_PADDING, 0.05])
def test_padding_within_the_budget_and_whole_experts_when_they_fit(world, extra):
    policy = (
        DEFAULT_POLICY
        if extra == DEFAULT_MAX_EXTRA_PADDING
        else ExpertShardPolicy(max_extra_padding=extra)
    )
    for shape, extras in itertools.product(EXPERT_SHAPES, EXTRAS):
        tensors = _group(shape, extras)
        units = resolve_units(policy, tensors, world)
        elements = {name: 1 for name, _, _ in tensors}
        numel = sum(math.prod(s) for _, s, _ in tensors)
        budget = _padding(tensors, elements, world) + math.floor(extra * numel)
        assert _padding(tensors, units, world) <= budget, (shape, extras)
        _, m, n = shape
        whole = elements | {"mlp.experts.w1": m * n, "mlp.experts.w2": m * n}
        if _padding(tensors, whole, world) <= budget:
            assert units == whole, (shape, extras)
        for name, s, _ in tensors:
            if name.startswith("mlp.experts."):
                rows, row = s[1], s[2]
                # a unit never spans two experts: elements, whole experts or k rows, k | rows
                assert units[name] == 1 or (rows * row) % units[name] == 0, (name, units[name])
                assert units[name] == 1 or units[name] % row == 0, (name, units[name])
            else:
                assert units[name] == 1, name


def test_a_padding_budget_buys_whole_experts():
    # 6 experts over 4 ranks: whole experts take 2 slots a rank, 8 in all: 2/6 of the data
    tensors = [("experts.w", (6, 64, 32), "float32")]
    assert resolve_units(ExpertShardPolicy(max_extra_padding=0.3), tensors, 4) == {"experts.w": 1}
    whole = resolve_units(ExpertShardPolicy(max_extra_padding=0.34), tensors, 4)
    assert whole == {"experts.w": 64 * 32}


def test_dense_groups_keep_element_units():
    tensors = [
        ("attn.wq.weight", (64, 64), "float32"),
        ("mlp.w1.weight", (176, 64), "float32"),
        ("norm.weight", (64,), "float32"),
    ]
    for world in (2, 3, 4, 7):
        assert set(resolve_units(DEFAULT_POLICY, tensors, world).values()) == {1}


def test_expert_matrix_reads_fused_per_expert_and_3d_tensors():
    assert expert_matrix("layers.0.mlp.experts.w1", (6, 64, 32)) == (6, 64, 32)
    assert expert_matrix("conv.weight", (3, 40, 36)) == (3, 40, 36)
    assert expert_matrix("mlp.experts.3.w1.weight", (48, 64)) == (1, 48, 64)
    assert expert_matrix("mlp.experts.router_bias", (6, 10)) == (6, 1, 10)
    assert expert_matrix("mlp.experts.bias", (6,)) is None
    assert expert_matrix("attn.wq.weight", (64, 64)) is None


def test_notes_say_what_the_units_chose():
    specs = [
        TensorSpec("a.experts.w1", (6, 8, 4), "float32", 32),
        TensorSpec("a.experts.w2", (2, 8, 4), "float32", 8),
        TensorSpec("a.experts.w3", (6, 8, 4), "float32", 1),
        TensorSpec("a.wq.weight", (8, 8), "float32", 1),
    ]
    assert expert_notes(specs) == (
        "a.experts.w1 (6, 8, 4): whole experts on ranks",
        "a.experts.w2 (2, 8, 4): 2 of each expert's 8 rows together on a rank",
        "a.experts.w3 (6, 8, 4): experts cut between ranks (unit 1): whole ones did not fit the "
        "padding budget",
    )


def test_notes_summarise_a_choice_shared_by_many_tensors():
    specs = [TensorSpec(f"m.experts.{i}.w1", (8, 4), "float32", 32) for i in range(6)]
    assert expert_notes(specs) == (
        "6 expert tensors (m.experts.0.w1 (8, 4), ..., m.experts.5.w1 (8, 4)): whole experts "
        "on ranks",
    )


@pytest.mark.parametrize("world", [3, 4])
def test_with_adamw8bit_blocks_ranks_hold_whole_experts_and_whole_blocks(world):
    block = 256
    policy = combine(DEFAULT_POLICY, adamw8bit_policy(block, min_8bit_size=1024))
    for shape in [(6, 64, 32), (8, 48, 64), (12, 8, 32)]:
        tensors = _group(shape, ())
        units = resolve_units(policy, tensors, world)
        alone = resolve_units(DEFAULT_POLICY, tensors, world)
        for name, _, _ in tensors:
            assert units[name] % block == 0 and units[name] % alone[name] == 0, (shape, name)
            assert units[name] == math.lcm(block, alone[name])


def test_muon_auto_shares_the_search_and_is_unchanged():
    tensors = [("a.weight", (64, 64), "float32"), ("b.weight", (64,), "float32")]
    assert resolve_units(MuonShardPolicy("auto"), tensors, 1) == {"a.weight": 1, "b.weight": 1}
    assert resolve_units(MuonShardPolicy(True), tensors, 1) == {"a.weight": 4096, "b.weight": 1}
    pair = [("a.weight", (64, 64), "float32"), ("b.weight", (64, 64), "float32")]
    assert resolve_units(MuonShardPolicy("auto"), pair, 2) == {"a.weight": 4096, "b.weight": 4096}
