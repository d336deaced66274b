"""Fuzzing the pure-Python inputs: RaggedShard specs, the planner and the capacity CLI.

Whatever comes in (zero-size tensors, prime sizes, more ranks than units, huge W, one-element
tensors, mixed dtypes, malformed shapes files), the answer is a valid result or a ValueError
that says what is wrong, never an exception from deep inside.
"""

from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raggedfsdp.capacity.cli import main as plan_main
from raggedfsdp.sharding import RaggedShard, TensorSpec, plan_layout

PRIMES = [1, 2, 3, 5, 7, 11, 13, 97, 101, 4099]
dims = st.one_of(st.sampled_from([0, 1, *PRIMES]), st.integers(0, 64))
shapes = st.lists(dims, min_size=0, max_size=3).map(tuple)
worlds = st.one_of(st.integers(-2, 9), st.sampled_from([1, 127, 4096, 100_000]))


@settings(max_examples=200)
@given(shape=shapes, unit=st.integers(-3, 5000), counts=st.lists(st.integers(-2, 60), max_size=6))
def test_ragged_shard_is_valid_or_refused_clearly(shape, unit, counts):
    try:
        spec = RaggedShard.from_counts(shape, unit, counts, name="t")
    except ValueError as err:
        assert "tensor 't'" in str(err)
        return
    assert sum(spec.lengths) == math.prod(shape)
    for rank in range(spec.world_size):
        start, stop = spec.local_range(rank)
        assert sum(b.numel for b in spec.boxes(rank)) == stop - start


@settings(max_examples=150)
@given(
    tensors=st.lists(
        st.tuples(shapes, st.integers(-1, 300), st.sampled_from(["float32", "bfloat16", "int8"])),
        min_size=0,
        max_size=6,
    ),
    world=worlds,
    mixed=st.booleans(),
)
def test_planner_gives_a_valid_layout_or_a_clear_error(tensors, world, mixed):
    try:
        specs = [
            TensorSpec(f"t{i}", shape, dtype if mixed else "float32", unit)
            for i, (shape, unit, dtype) in enumerate(tensors)
        ]
        layout = plan_layout(specs, world)
    except ValueError as err:
        message = str(err)
        assert any(
            key in message
            for key in ("unit=", "world_size=", "tensors is empty", "one flat buffer", "dtype")
        ), message
        return
    layout.check()
    assert layout.numel == sum(math.prod(s) for s, _, _ in tensors)


group_entries = st.one_of(
    st.tuples(st.text(max_size=5), st.lists(st.integers(-5, 40), max_size=3)).map(list),
    st.just("nonsense"),
    st.integers(),
)
shapes_files = st.fixed_dictionaries(
    {
        "models": st.lists(
            st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["m", "", 3]),
                    "groups": st.lists(
                        st.fixed_dictionaries(
                            {
                                "name": st.sampled_from(["layer", "", None]),
                                "repeat": st.one_of(st.integers(-1, 4), st.just("x")),
                                "tensors": st.lists(group_entries, max_size=3),
                            }
                        ),
                        max_size=2,
                    ),
                }
            ),
            max_size=2,
        )
    }
)


@settings(
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=shapes_files, world=st.sampled_from(["1", "3", "0", "-4", "x", "100000"]))
def test_plan_cli_answers_or_explains(tmp_path, capsys, data, world):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(data))
    try:
        code = plan_main([str(path), "-w", world, "--json"])
    except SystemExit as exit_:  # argparse: bad flag values
        assert exit_.code == 2
        return
    out, err = capsys.readouterr()
    if code == 0:
        json.loads(out)
    else:
        assert code == 2 and "error:" in err, err
