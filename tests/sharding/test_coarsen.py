"""The shared search for coarser units (``coarsen_units``): its padding budget and its speed-ups.

``max_extra_padding`` lets whole experts (and whole Muon matrices) add padding up to a fraction
of the group; 0 must give exactly the plans of the search before the budget existed, which
planned the group in full for every trial. ``REFERENCE`` below is that search, kept here as the
oracle: ``fits_within`` (stop at the first packing that proves the answer) and the planner's
run-at-once packing of identical element-unit tensors may only make it faster.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggedfsdp.capacity import Mesh, PlanError, Settings, estimate, load_model, parse_shapes
from raggedfsdp.capacity.policies import OptimizerSpec, UnitPolicy
from raggedfsdp.optim import Muon
from raggedfsdp.sharding.planner import (
    DEFAULT_ALIGNMENT_BYTES,
    TensorSpec,
    _earliest_start,
    _Holes,
    _Packer,
    fits_within,
    plan_layout,
)
from raggedfsdp.sharding.units import (
    MAX_COARSEN_TRIALS,
    ExpertShardPolicy,
    MuonShardPolicy,
    coarsen_units,
    expert_matrix,
    expert_unit_options,
    is_muon_matrix,
    matrix_unit,
    planned_padding,
    resolve_units,
)


def reference(tensors, world, options, alignment_bytes=DEFAULT_ALIGNMENT_BYTES):
    """The search before ``max_extra_padding``: full plans, padding never above elements'."""
    units = {name: 1 for name, _, _ in tensors}
    if not options:
        return units
    budget = planned_padding(tensors, units, world, alignment_bytes)
    every = units | {name: choices[0] for name, choices in options.items()}
    if planned_padding(tensors, every, world, alignment_bytes) <= budget:
        return every
    sizes = {name: math.prod(shape) for name, shape, _ in tensors}
    for name in sorted(options, key=lambda n: -sizes[n])[:MAX_COARSEN_TRIALS]:
        for unit in options[name]:
            trial = units | {name: unit}
            if planned_padding(tensors, trial, world, alignment_bytes) <= budget:
                units = trial
                break
    return units


def expert_options(tensors, world):
    """``ExpertShardPolicy``'s options for a group."""
    options = {}
    for name, shape, _ in tensors:
        matrix = expert_matrix(name, shape)
        if matrix is not None and matrix[1] * matrix[2] > 1:
            options[name] = expert_unit_options(*matrix, world)
    return options


#: A group: fused and per-expert expert tensors among dense ones, with odd sizes.
expert_shapes = st.tuples(
    st.sampled_from([2, 3, 6, 8, 10]), st.sampled_from([8, 24, 48, 64]), st.sampled_from([4, 16])
)
entries = st.one_of(
    expert_shapes.map(lambda s: ("mlp.experts.w{}", s)),
    st.tuples(st.sampled_from([8, 40]), st.sampled_from([8, 12])).map(
        lambda s: ("mlp.experts.{}.w.weight", s)
    ),
    st.lists(st.integers(1, 70), min_size=1, max_size=2).map(
        lambda s: ("attn.t{}.weight", tuple(s))
    ),
)
groups = st.lists(entries, min_size=1, max_size=8).map(
    lambda items: [(kind.format(i), shape, "float32") for i, (kind, shape) in enumerate(items)]
)
worlds = st.sampled_from([2, 3, 4, 5, 8, 16])


@settings(max_examples=60)
@given(tensors=groups, world=worlds)
def test_no_budget_gives_the_plans_of_the_full_search(tensors, world):
    options = expert_options(tensors, world)
    expected = reference(tensors, world, options)
    assert coarsen_units(tensors, world, options, max_extra_padding=0) == expected
    assert resolve_units(ExpertShardPolicy(max_extra_padding=0), tensors, world) == expected
    muon = MuonShardPolicy("auto", max_extra_padding=0)
    options = {
        n: [matrix_unit(s)] for n, s, _ in tensors if is_muon_matrix(n, s) and matrix_unit(s) > 1
    }
    assert resolve_units(muon, tensors, world) == reference(tensors, world, options)


@settings(max_examples=60)
@given(tensors=groups, world=worlds, extra=st.sampled_from([0.0, 1e-3, 0.01, 0.1, 0.5, 1.0]))
def test_padding_stays_within_the_budget(tensors, world, extra):
    units = resolve_units(ExpertShardPolicy(max_extra_padding=extra), tensors, world)
    elements = planned_padding(tensors, dict.fromkeys(units, 1), world, DEFAULT_ALIGNMENT_BYTES)
    numel = sum(math.prod(shape) for _, shape, _ in tensors)
    padding = planned_padding(tensors, units, world, DEFAULT_ALIGNMENT_BYTES)
    assert padding <= elements + math.floor(extra * numel)


@pytest.mark.parametrize("model", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b"])
@pytest.mark.parametrize("world", [8, 64])
def test_no_budget_gives_todays_plans_on_moe_models(model, world):
    (group,) = [g for g in load_model(model).groups if any("experts" in n for n, _ in g.tensors)]
    tensors = [(name, shape, "bfloat16") for name, shape in group.tensors]
    options = expert_options(tensors, world)
    assert coarsen_units(tensors, world, options, max_extra_padding=0) == reference(
        tensors, world, options
    )


def specs_of(sizes):
    return [TensorSpec(f"t{i}", (n,), "float32", u) for i, (n, u) in enumerate(sizes)]


sizes_lists = st.lists(
    st.tuples(st.sampled_from([0, 1, 3, 16, 17, 64, 100, 256]), st.sampled_from([1, 2, 4, 8, 16])),
    min_size=1,
    max_size=10,
)


@settings(max_examples=100)
@given(sizes=sizes_lists, world=st.integers(1, 6), slack=st.integers(0, 300))
def test_fits_within_answers_as_the_full_plan(sizes, world, slack):
    specs = specs_of(sizes)
    layout = plan_layout(specs, world)
    for max_padding in (layout.padding - 1 - slack, layout.padding, layout.padding + slack):
        assert fits_within(specs, world, max_padding) == (layout.padding <= max_padding)


def one_by_one(packer, order, seg, world):
    """The packing before runs: every tensor placed on its own (the oracle for ``runs``)."""
    offsets, holes, cursor = [0] * len(packer.sizes), _Holes(packer.align), 0
    for i in order:
        numel, unit, step = packer.sizes[i]
        start = holes.fill(numel, unit, step, seg)
        if start >= 0:
            offsets[i] = start
            continue
        start = _earliest_start(cursor, numel, unit, step, seg, packer.align)
        if start < 0 or start + numel > world * seg:
            return None
        holes.add(cursor, start)
        offsets[i], cursor = start, start + numel
    return offsets


@settings(max_examples=150)
@given(
    sizes=st.lists(
        st.sampled_from([(4, 1), (4, 4), (12, 1), (12, 12), (7, 1), (40, 1)]), max_size=12
    ),
    world=st.integers(1, 5),
    seg_units=st.integers(1, 20),
)
def test_runs_of_element_tensors_pack_as_one_by_one(sizes, world, seg_units):
    align = 4
    packer = _Packer([(n, u, math.lcm(u, align)) for n, u in sizes], align)
    order = list(range(len(sizes)))
    seg = seg_units * align
    assert packer.pack(packer.runs(order), seg, world=world) == one_by_one(
        packer, order, seg, world
    )


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "0.1", None, True])
def test_bad_budgets_are_refused_naming_the_parameter(value):
    tensors = [("experts.w", (6, 64, 32), "float32")]
    with pytest.raises(ValueError, match=r"max_extra_padding=.*fraction.*\[0, 1\]"):
        ExpertShardPolicy(max_extra_padding=value)
    with pytest.raises(ValueError, match="max_extra_padding="):
        MuonShardPolicy("auto", max_extra_padding=value)
    with pytest.raises(ValueError, match="max_extra_padding="):
        coarsen_units(tensors, 4, {"experts.w": [2048]}, max_extra_padding=value)


def test_muon_takes_and_forwards_the_budget():
    matrix = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="max_extra_padding=-1"):
        Muon([matrix], max_extra_padding=-1)
    assert Muon([matrix], max_extra_padding=0.01).max_extra_padding == 0.01
    assert Muon.shard_policy("auto", max_extra_padding=0).max_extra_padding == 0


def test_the_capacity_planner_takes_the_same_budget():
    tensors = [["layer.mlp.experts.w", [6, 64, 32]]]
    shapes = parse_shapes({"name": "m", "groups": [{"name": "g", "tensors": tensors}]}, "t")
    for budget, unit in ((0.3, 1), (0.34, 64 * 32)):
        units = UnitPolicy(max_extra_padding=budget)
        (plan,) = estimate(shapes, Settings(Mesh(1, 4), units=units)).plans
        assert plan.layout.by_name["layer.mlp.experts.w"].unit == unit
        muon = OptimizerSpec("muon", max_extra_padding=budget).shard_policy()
        assert muon.max_extra_padding == budget
    with pytest.raises(PlanError, match="max_extra_padding=-1"):
        UnitPolicy(max_extra_padding=-1)
    with pytest.raises(PlanError, match="max_extra_padding=2"):
        OptimizerSpec("muon", max_extra_padding=2)
