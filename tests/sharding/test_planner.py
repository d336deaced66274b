"""The structure-aware planner: guarantees, optimality against the exact solver, errors."""

import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raggedfsdp.sharding import TensorSpec, plan_layout, plan_layout_exact
from tests.support.work import counted_lines

SHAPES = Path(__file__).resolve().parents[2] / "raggedfsdp" / "data" / "model_shapes.json"


def _tensor_sets(max_tensors: int, max_rows: int):
    one = st.tuples(
        st.integers(0, max_rows),  # rows
        st.sampled_from([1, 2, 3, 4, 8, 16]),  # row length
        st.sampled_from([1, 2, 3, 4, 8]),  # rows per unit
    )
    return st.lists(one, min_size=1, max_size=max_tensors).map(
        lambda items: [
            TensorSpec.rows(f"t{i}", (rows, cols) if cols > 1 else (rows,), "float32", k)
            for i, (rows, cols, k) in enumerate(items)
        ]
    )


def _assert_shards_match_offsets(layout):
    """Each tensor's RaggedShard must describe exactly the pieces the segments hold."""
    for rank in range(layout.world_size):
        pieces = {name: (off_t, n) for name, _, off_t, n in layout.local_pieces(rank)}
        for t in layout.tensors:
            start, stop = layout.shards[t.name].local_range(rank)
            assert pieces.get(t.name, (start, 0)) == (start, stop - start)


@settings(max_examples=150)
@given(tensors=_tensor_sets(10, 200), world=st.integers(1, 16), align=st.sampled_from([4, 16]))
def test_every_layout_keeps_every_guarantee(tensors, world, align):
    layout = plan_layout(tensors, world, alignment_bytes=align)
    layout.check()  # aligned, disjoint, contiguous, no cut unit, equal segments
    assert layout.segment_size >= layout.lower_bound
    # padding counted independently: every rank's segment elements that hold no tensor element
    unheld = sum(
        layout.segment_size - sum(n for *_, n in layout.local_pieces(r)) for r in range(world)
    )
    assert layout.padding == unheld >= 0
    assert sum(math.prod(t.shape) for t in tensors) + unheld == world * layout.segment_size
    assert layout.padding >= layout.lower_bound_padding
    _assert_shards_match_offsets(layout)


@settings(max_examples=60)
@given(tensors=_tensor_sets(5, 60), world=st.integers(1, 8))
def test_heuristic_is_never_below_the_optimum_nor_far_above(tensors, world):
    exact = plan_layout_exact(tensors, world)
    exact.check()
    heuristic = plan_layout(tensors, world)
    assert exact.lower_bound <= exact.segment_size <= heuristic.segment_size
    assert heuristic.segment_size <= 1.25 * exact.segment_size


def test_heuristic_finds_the_optimum_in_95_percent_of_small_instances():
    rng = random.Random(1234)
    optimal, ratios = 0, []
    cases = 300
    for _ in range(cases):
        tensors = [
            TensorSpec.rows(
                f"t{i}",
                (rng.randint(0, 48), rng.choice([1, 2, 3, 4, 8])),
                "float32",
                rng.choice([1, 2, 3, 4, 8]),
            )
            for i in range(rng.randint(1, 6))
        ]
        world = rng.randint(1, 8)
        exact = plan_layout_exact(tensors, world).segment_size
        found = plan_layout(tensors, world).segment_size
        optimal += found == exact
        ratios.append(found / exact)
    assert optimal >= 0.95 * cases, f"optimal in {optimal}/{cases}"
    assert max(ratios) <= 1.25


def test_units_spanning_segments_force_the_lcm_and_are_reported():
    # Two tensors that each cover several segments, with units 6 and 4 elements: S must be a
    # multiple of lcm(6, 4, alignment 4) = 12.
    tensors = [TensorSpec("a", (60,), unit=6), TensorSpec("b", (64,), unit=4)]
    layout = plan_layout(tensors, 8)
    layout.check()
    assert layout.segment_size % 12 == 0
    assert layout.lower_bound == layout.segment_size == 24
    assert any("LCM" in note for note in layout.notes)


def test_a_unit_larger_than_the_even_share_is_reported():
    layout = plan_layout([TensorSpec.rows("experts", (4, 64), k=4)], 16)
    assert layout.segment_size >= 256
    assert any("exceed the even share" in note for note in layout.notes)


def test_cuts_only_at_unit_multiples_from_the_tensor_start():
    # 576 rows in 128-row units: the short last unit (64 rows) is never split either.
    layout = plan_layout([TensorSpec.rows("kv_a", (576, 8), k=128)], 4)
    layout.check()
    shard = layout.shards["kv_a"]
    assert shard.num_units == 5
    for rank in range(4):
        start, _ = shard.local_range(rank)
        assert start % (128 * 8) == 0 or start == shard.numel


def test_planning_at_100k_ranks_is_fast():
    tensors = [
        TensorSpec.rows(name, shape, "bfloat16", 1)
        for name, shape in [("wq", (8192, 8192)), ("w1", (28672, 8192)), ("norm", (8192,))]
    ]
    layout = plan_layout(tensors, 100_000)
    layout.check()
    assert layout.planning_time_s < 2.0
    assert layout.shards["w1"].world_size == 100_000


@pytest.mark.slow
def test_real_model_layers_meet_the_paper_targets():
    """Where the bound's own padding is < 1%, the plan is within 1 point of it; < 0.3 s each."""
    models = {m["name"]: m for m in json.loads(SHAPES.read_text())["models"]}
    for model, group in [("llama3-8b", "layer"), ("deepseek-v3", "moe_layer")]:
        tensors = next(g for g in models[model]["groups"] if g["name"] == group)["tensors"]
        for world in (8, 64, 256, 1024):
            for rows in (1, 16, 128):
                specs = [TensorSpec.rows(n, s, "bfloat16", rows) for n, s in tensors]
                layout = plan_layout(specs, world)
                layout.check()
                bound = layout.lower_bound_padding / layout.numel
                if bound < 0.01:
                    assert layout.padding_ratio <= bound + 0.01, (model, world, rows)
                assert layout.planning_time_s < 0.6, (model, world, rows)


@pytest.mark.parametrize(
    ("tensors", "world", "kwargs", "match"),
    [
        ([TensorSpec("a", (4,))], 0, {}, "world_size=0 must be an int >= 1"),
        ([], 2, {}, "tensors is empty"),
        ([TensorSpec("a", (4,)), TensorSpec("a", (2,))], 2, {}, "repeated: \\['a'\\]"),
        (
            [TensorSpec("w", (4,), "float32"), TensorSpec("b", (4,), "bfloat16")],
            2,
            {},
            "tensor 'b' has dtype bfloat16 .* one flat buffer holds one dtype",
        ),
        ([TensorSpec("a", (4,))], 2, {"alignment_bytes": 6}, "not a multiple of the dtype size"),
    ],
)
def test_bad_input_names_the_problem_and_the_fix(tensors, world, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_layout(tensors, world, **kwargs)


def test_bad_units_name_the_tensor():
    with pytest.raises(ValueError, match="tensor 'wq': unit=0"):
        TensorSpec("wq", (4, 4), unit=0)
    with pytest.raises(ValueError, match="tensor 'wq': rows per unit k=-1"):
        TensorSpec.rows("wq", (4, 4), k=-1)
    with pytest.raises(ValueError, match="plan_layout_exact is exponential"):
        plan_layout_exact([TensorSpec(f"t{i}", (4,)) for i in range(13)], 2)


def _moe_layer(experts: int) -> list[tuple[str, list[int]]]:
    """DeepSeek-V3's MoE layer with ``experts`` routed experts (384: Kimi-K2's count; with the
    shared expert, 1,166 tensors)."""
    models = {m["name"]: m for m in json.loads(SHAPES.read_text())["models"]}
    groups = {g["name"]: g["tensors"] for g in models["deepseek-v3"]["groups"]}
    layer = groups["moe_layer"]
    head = [(n, s) for n, s in layer if ".experts." not in n and "shared_experts" not in n]
    head = [(n, [experts, *s[1:]] if n.startswith("mlp.gate.") else s) for n, s in head]
    one = [(n.removeprefix("mlp.experts.0."), s) for n, s in layer if ".experts.0." in n]
    routed = [(f"mlp.experts.{e}.{n}", s) for e in range(experts) for n, s in one]
    shared = [(n, s) for n, s in layer if "shared_experts" in n]
    return head + routed + shared


def test_a_1166_tensor_moe_layer_plans_within_the_budget():
    """A 385-expert layer at W=256 with 128-row units (1,166 tensors): each packing scanned
    every padding hole for every tensor, O(T x holes), 0.5 s of CPU where 0.3 s was the budget.
    The plan depends on the shapes alone (every rank computes it), so it must stay cheap: the
    budget is in lines of the planner's Python, deterministic on a loaded machine (today 2.7
    million, about 0.08 s; benchmarks/planner_scale.py has the times)."""
    specs = [TensorSpec.rows(n, s, "bfloat16", 128) for n, s in _moe_layer(384)]
    assert len(specs) == 1166
    with counted_lines() as work:
        layout = plan_layout(specs, 256)
    layout.check()
    assert layout.offsets == plan_layout(specs, 256).offsets
    assert work.lines <= 4_000_000, f"planning ran {work.lines:,} lines (budget 4,000,000)"
