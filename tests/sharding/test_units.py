"""``sharding.units``: every unit rule, the Muon-matrix rule and ``resolve_units``."""

import subprocess
import sys

import pytest

from raggedfsdp.sharding import plan_layout
from raggedfsdp.sharding.planner import TensorSpec
from raggedfsdp.sharding.units import (
    DEFAULT_POLICY,
    GroupShardPolicy,
    MuonShardPolicy,
    TensorMeta,
    adamw8bit_policy,
    combine,
    element_units,
    is_muon_matrix,
    matrix_unit,
    quantized_unit,
    resolve_units,
    row_units,
    shampoo_policy,
    shampoo_slab_rows,
    slice_units,
)


def _unit(policy, name, shape):
    return policy(name, TensorMeta(shape))


def test_the_rules_and_the_planner_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import raggedfsdp.sharding.units, raggedfsdp.sharding.owners, raggedfsdp.sharding\n"
        "import raggedfsdp.capacity\n"
        "from raggedfsdp.capacity.cli import main\n"
        "assert main(['llama3-8b', '-w', '8', '--optimizer', 'muon', '--json']) == 0\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_plain_rules():
    assert _unit(element_units(), "w", (7, 5)) == 1 and DEFAULT_POLICY("w", TensorMeta((7,))) == 1
    assert _unit(row_units(3), "w", (7, 5)) == 15 and _unit(row_units(3), "b", (7,)) == 3
    assert _unit(row_units(2), "e", (4, 6, 5)) == 10  # rows of the stacked matrices
    assert _unit(slice_units(), "e", (4, 6, 5)) == 30 and _unit(slice_units(), "w", (6, 5)) == 30
    assert _unit(slice_units(), "b", (6,)) == 1
    assert matrix_unit((4, 6, 5)) == 30 and matrix_unit((6, 5)) == 30
    assert _unit(combine(row_units(4), lambda n, p: 6), "w", (9, 5)) == 60
    with pytest.raises(ValueError, match="rows=0"):
        row_units(0)
    with pytest.raises(ValueError, match="at least one"):
        combine()


def test_empty_tensors_get_a_positive_unit():
    for policy in (row_units(4), slice_units(), shampoo_policy(8), adamw8bit_policy()):
        assert resolve_units(policy, [("w", (5, 0), "float32")], 2)["w"] >= 1


def test_adamw8bit_rule():
    policy = adamw8bit_policy(block_size=64, min_8bit_size=100)
    assert _unit(policy, "w", (9, 11)) == 1  # 99 elements: full precision
    assert _unit(policy, "w", (10, 11)) == 64
    tiled = adamw8bit_policy(block_size=64, tile=(4, 8), min_8bit_size=100)
    assert _unit(tiled, "w", (10, 11)) == 44 and _unit(tiled, "b", (300,)) == 64
    assert quantized_unit((3, 5, 7), 256, (2, 2)) == 14


def test_shampoo_rule():
    assert _unit(shampoo_policy(4), "w", (10, 6)) == 24
    assert _unit(shampoo_policy(16), "w", (10, 6)) == 60  # fewer rows than B: one slab
    assert _unit(shampoo_policy(4), "b", (10,)) == 1  # vectors are Adam-grafted only
    assert shampoo_slab_rows((2, 3, 5), 4) == 4 and shampoo_slab_rows((2, 3, 5), 8) == 6
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="max_preconditioner_dim"):
            shampoo_policy(bad)


@pytest.mark.parametrize(
    ("name", "shape", "muon"),
    [
        ("layers.0.attn.q_proj.weight", (8, 8), True),
        ("layers.0.experts.w1", (4, 8, 8), True),
        ("layers.0.experts.3.w1", (8, 8), True),
        ("layers.0.norm.weight", (8,), False),
        ("w", (2, 2, 2, 2), False),
        ("model.embed_tokens.weight", (8, 8), False),
        ("tok_embeddings.weight", (8, 8), False),
        ("bert.embeddings.word.weight", (8, 8), False),
        ("transformer.wte.weight", (8, 8), False),
        ("transformer.wpe.weight", (8, 8), False),
        ("lm_head.weight", (8, 8), False),
        ("output.weight", (8, 8), False),
        ("head.weight", (8, 8), False),
        ("classifier.weight", (8, 8), False),
        ("vision.embedding.weight", (8, 8), False),
    ],
)
def test_one_muon_matrix_rule(name, shape, muon):
    assert is_muon_matrix(name, shape) is muon


def test_muon_policy_decides_per_group():
    tensors = [("a.weight", (64, 64), "float32"), ("b.weight", (64,), "float32")]
    assert isinstance(MuonShardPolicy(), GroupShardPolicy)
    assert resolve_units(MuonShardPolicy(True), tensors, 2) == {"a.weight": 4096, "b.weight": 1}
    assert resolve_units(MuonShardPolicy(False), tensors, 2) == {"a.weight": 1, "b.weight": 1}
    assert MuonShardPolicy("auto")("a.weight", TensorMeta((64, 64))) == 1
    assert MuonShardPolicy(True)("a.weight", TensorMeta((64, 64))) == 4096
    with pytest.raises(ValueError, match="whole_matrices"):
        MuonShardPolicy("yes")


def test_muon_auto_keeps_matrices_whole_only_without_extra_padding():
    tensors = [(f"l{i}.weight", (96, 64), "float32") for i in range(3)]
    units = resolve_units(MuonShardPolicy("auto"), tensors, 3)
    assert units == {n: 96 * 64 for n, _, _ in tensors}  # one matrix per rank: free
    odd = [("a.weight", (96, 64), "float32"), ("b.weight", (96, 64), "float32")]
    units = resolve_units(MuonShardPolicy("auto"), odd, 3)

    def padding(u):
        lay = plan_layout([TensorSpec(n, s, d, u[n]) for n, s, d in odd], 3)
        return lay.buffer_numel - lay.numel

    assert padding(units) == padding(dict.fromkeys(units, 1))


def test_combine_with_a_group_policy_is_a_group_policy():
    tensors = [("a.weight", (64, 64), "float32"), ("b.weight", (64,), "float32")]
    combined = combine(row_units(2), MuonShardPolicy(True))
    assert isinstance(combined, GroupShardPolicy)
    assert resolve_units(combined, tensors, 2) == {"a.weight": 4096, "b.weight": 2}
    assert combined("a.weight", TensorMeta((64, 64))) == 4096


def test_resolve_units_names_the_parameter_and_the_fix():
    for bad in (0, -3, 2.0, None, True):
        with pytest.raises(ValueError, match=r"unit=.* for parameter 'w'.*row_units\(32\)"):
            resolve_units(lambda n, p, bad=bad: bad, [("w", (4, 4), "float32")], 2)


def test_resolve_units_passes_the_real_parameters_when_given():
    seen = []
    units = resolve_units(
        lambda n, p: seen.append(p) or 1, [("w", (4, 4), "float32")], 2, {"w": "the param"}
    )
    assert units == {"w": 1} and seen == ["the param"]
