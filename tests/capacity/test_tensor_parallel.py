"""The planner's tp dim (``--mesh RxSxT``): torchtitan's TP plan by name, TP-local planning equal
to what ``fully_shard`` plans for parallelize_module's DTensors, per-rank memory and traffic, the
notes, and one-line errors."""

from __future__ import annotations

import json
import math

import pytest
from torch.distributed.device_mesh import init_device_mesh

import raggedfsdp
from raggedfsdp.capacity import (
    Mesh,
    OptimizerSpec,
    PlanError,
    Settings,
    UnitPolicy,
    estimate,
    load_model,
)
from raggedfsdp.capacity.cli import main
from raggedfsdp.capacity.model_shapes import parse_shapes
from raggedfsdp.capacity.optimizer_state import STEP_BYTES
from raggedfsdp.capacity.policies import shard_policy
from raggedfsdp.capacity.tp_plan import tp_dim
from raggedfsdp.sharding.tp_split import tp_block_note, tp_local_shape
from tests.support.tp_models import make_llama, parallelize_llama

TIMINGS = ("planning_time_s", "elapsed_s")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _json(capsys, *argv: str) -> dict:
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 0, err
    result = json.loads(out)
    for group in result["groups"]:
        group.pop("plan_ms")
    return {k: v for k, v in result.items() if k not in TIMINGS}


def _untimed(report: str) -> str:
    """A text report without its timings: the groups' last column (plan ms) and the last line.
    The padding before that column goes too: it is as wide as the slowest group's time."""
    head, groups = report.rsplit("planned in", 1)[0].split("\nGroups (")
    rows = [line.rsplit(" ", 1)[0].rstrip() for line in groups.splitlines()]
    return head + "\n".join(rows)


def _layer(est):
    return next(p for p in est.plans if p.group.name == "layer")


# ----------------------------------------------------------------------------- the plan by name
@pytest.mark.parametrize(
    ("name", "ndim", "dim"),
    [
        ("attention.wq.weight", 2, 0),
        ("layers.3.feed_forward.w3.weight", 2, 0),
        ("self_attn.q_proj.bias", 1, 0),  # a colwise bias is split with its rows
        ("self_attn.o_proj.weight", 2, 1),
        ("self_attn.o_proj.bias", 1, None),  # a rowwise bias is replicated
        ("mlp.down_proj.weight", 2, 1),
        ("mlp.shared_experts.gate_proj.weight", 2, 0),  # shared experts are dense MLPs
        ("tok_embeddings.weight", 2, 0),  # RowwiseParallel on an embedding: the vocab dim
        ("embed_tokens.weight", 2, 0),
        ("output.weight", 2, 0),
        ("lm_head.weight", 2, 0),
        ("self_attn.kv_a_proj_with_mqa.weight", 2, None),  # torchtitan's NoParallel
        ("self_attn.kv_b_proj.weight", 2, 0),
        ("attention_norm.weight", 1, None),
        ("mlp.gate.weight", 2, None),  # the router: Replicate() (apply_tp_to_moe)
        ("feed_forward.router.weight", 2, None),
        ("mlp.shared_expert.down_proj.weight", 2, 1),
        # fused experts on d_ff (apply_tp_to_moe): gate/up (E, d_ff, d), down (E, d, d_ff)
        ("feed_forward.experts.w1", 3, 1),
        ("feed_forward.experts.w3", 3, 1),
        ("feed_forward.experts.w2", 3, 2),
        ("mlp.experts.gate_up_proj", 3, 1),
        ("mlp.experts.down_proj", 3, 2),
        ("mlp.experts.gate_proj.weight", 3, 1),  # a per-expert stack, fused
        ("mlp.experts.down_proj.weight", 3, 2),
        ("mlp.experts.3.gate_proj.weight", 2, None),  # one expert: fused before the split
        ("mlp.experts.gate_up_proj_bias", 2, None),  # expert biases: replicated
    ],
)
def test_torchtitans_plan_by_module_name(name: str, ndim: int, dim: int | None) -> None:
    assert tp_dim(name, ndim) == dim


# ----------------------------------------------------------------------------- memory, traffic
def test_tp_splits_weights_by_t_and_keeps_norms_whole() -> None:
    plain = estimate(load_model("llama3-8b"), Settings(Mesh(1, 8)))
    tp = estimate(load_model("llama3-8b"), Settings(Mesh(1, 8, 4)))
    plain_layer, tp_layer = _layer(plain), _layer(tp)
    for (name, full), (same, local) in zip(
        plain_layer.group.tensors, tp_layer.group.tensors, strict=True
    ):
        assert name == same
        expected = 1 if tp_dim(name, len(full)) is None else 4
        assert math.prod(local) * expected == math.prod(full), name
    assert dict(tp_layer.group.tensors)["attention_norm.weight"] == (4096,)
    norms = 2 * 4096
    assert tp_layer.layout.numel == (plain_layer.layout.numel - norms) // 4 + norms
    # element units pad nothing here, so every per-rank byte is the TP-local elements'
    assert tp.padding["elements"] == plain.padding["elements"] == 0
    local = sum(p.instances * p.layout.numel for p in tp.plans)
    assert tp.memory["params"] == 4 * local / 8
    assert tp.memory["optimizer"] == 2 * tp.memory["params"] + STEP_BYTES  # AdamW: 2 moments
    assert 0.249 < tp.memory["params"] / plain.memory["params"] < 0.251
    assert 0.249 < tp.traffic["all_gather"] / plain.traffic["all_gather"] < 0.251
    assert tp.traffic["all_reduce"] == 0  # no replicate dim


def test_hsdp_times_tp_reduces_over_replicate(capsys) -> None:
    result = _json(capsys, "llama3-8b", "--mesh", "2x8x4")
    assert result["mesh"] == {"replicate": 2, "shard": 8, "tp": 4, "world": 64}
    assert result["traffic_bytes"]["all_reduce"] > 0
    assert result["traffic_excludes"] == ["tensor-parallel activation collectives"]


def test_tp_1_is_todays_output(capsys) -> None:
    for argv in (["--mesh", "2x8"], ["--mesh", "2x8x1"]):
        code, out, _ = _run(capsys, "llama3-8b", *argv, "--optimizer", "muon")
        assert code == 0
        text = _untimed(out)
        if argv == ["--mesh", "2x8"]:
            expected = text
    assert text == expected and "mesh 2 x 8 (replicate x shard) = 16 ranks" in text
    assert "tensor-parallel" not in text and "TP-local" not in text
    hsdp = _json(capsys, "llama3-8b", "--mesh", "2x8", "--optimizer", "adamw8bit")
    assert hsdp == _json(capsys, "llama3-8b", "--mesh", "2x8x1", "--optimizer", "adamw8bit")
    assert hsdp["mesh"]["tp"] == 1 and hsdp["traffic_excludes"] == []
    assert Mesh.parse("2x8x1") == Mesh(2, 8) == Mesh.parse("2x8")


def test_the_report_names_the_tp_dim(capsys) -> None:
    code, out, _ = _run(capsys, "llama3-70b", "--mesh", "4x32x8", "--gpu-memory", "80")
    assert code == 0
    for needle in (
        "mesh 4 x 32 x 8 (replicate x shard x tp) = 1,024 ranks",
        "tensor-parallel activation collectives are not included",
        "Groups (TP-local tensors, S = elements per rank)",
        "fits in 80 GiB: yes",
    ):
        assert needle in out, needle


def test_tp_splits_moe_experts_on_d_ff(capsys) -> None:
    """Qwen3-30B-A3B at tp 2, by its config (hidden 2048, 32 query and 4 key/value heads of
    128, 128 experts of d_ff 768): attention halves, norms and the router stay whole, every
    expert keeps half its d_ff, fused (E, d_ff, d) / (E, d, d_ff) as the recipe's."""
    tp = estimate(load_model("qwen3-30b-a3b"), Settings(Mesh(1, 32, 2)))
    layer = _layer(tp)
    attention = (4096 * 2048 + 2 * 512 * 2048 + 2048 * 4096) // 2
    whole = 2 * 128 + 2 * 2048 + 128 * 2048  # q/k norms, the two layer norms, the router
    experts = 128 * 3 * (768 // 2) * 2048
    assert layer.layout.numel == attention + whole + experts
    tensors = dict(layer.group.tensors)
    assert tensors["mlp.experts.gate_proj.weight"] == (128, 384, 2048)
    assert tensors["mlp.experts.down_proj.weight"] == (128, 2048, 384)
    assert tensors["mlp.gate.weight"] == (128, 2048)
    # the gradients' reduce-scatter moves the TP-local layer: (W - 1) / W of it, fp32
    plain = estimate(load_model("qwen3-30b-a3b"), Settings(Mesh(1, 32)))
    assert tp.traffic["reduce_scatter"] < 0.51 * plain.traffic["reduce_scatter"]
    notes = _json(capsys, "qwen3-30b-a3b", "--mesh", "1x32x2")["notes"]
    assert any("144 of 144 expert tensors split on d_ff over the 2 TP ranks" in n for n in notes)
    assert any("one tensor per expert is planned fused as (E, m, n)" in n for n in notes)


# ----------------------------------------------------------------------------- notes
def test_blocks_the_tp_split_cuts_are_noted(capsys) -> None:
    notes = " ".join(
        _json(
            capsys, "llama3-8b", "--mesh", "1x8x4", "--optimizer", "adamw8bit", "--tile", "32x32"
        )["notes"]
    )
    assert "'attention.wo.weight': the TP split Shard(dim=1) over 4 ranks cuts" in notes
    assert "'feed_forward.w2.weight'" in notes
    assert "'attention.wq.weight'" not in notes  # Shard(0): 32-row tiles stay whole
    # flat 256-element blocks of wo's global flat index cross its Shard(1) blocks: AdamW8bit
    # refuses that at construction, so the planner does (tests/capacity/test_quantized_splits)
    code, out, err = _run(capsys, "llama3-8b", "--mesh", "1x8x4", "--optimizer", "adamw8bit")
    assert code == 2 and not out and err.count("\n") == 1
    assert "--optimizer adamw8bit with --mesh 1x8x4: layer tensor 'attention.wo.weight'" in err
    assert "quantize it in tiles (--tile RxC, cols dividing 1024)" in err


def test_muon_owners_gather_over_dp_times_tp(capsys) -> None:
    plain = _json(capsys, "llama3-8b", "--mesh", "1x8", "--optimizer", "muon")
    tp = _json(capsys, "llama3-8b", "--mesh", "1x8x4", "--optimizer", "muon")
    assert tp["muon"]["matrices"] == plain["muon"]["matrices"] == 7 * 32
    assert tp["muon"]["local_matrices"] == 0  # every matrix is split by TP: pieces on 4 ranks
    assert any("over dp_shard x tp (8 x 4 ranks)" in note for note in tp["notes"])
    moe = _json(capsys, "qwen1.5-moe-a2.7b", "--mesh", "1x4x2", "--optimizer", "muon")
    assert (
        moe["muon"]["matrices"]
        == _json(capsys, "qwen1.5-moe-a2.7b", "-w", "4", "--optimizer", "muon")["muon"]["matrices"]
    )  # each expert once, its TP blocks gathered on one owner
    assert any("expert tensors split on d_ff over the 2 TP ranks" in n for n in moe["notes"])


def test_tp_block_note_is_none_where_blocks_stay_whole() -> None:
    assert tp_block_note("w", 0, 2, (64, 16), 64, 64) is None  # 4 rows in 32-row blocks
    assert tp_block_note("w", 1, 2, (64, 16), 64, 32) is not None  # rows of 8 now
    assert tp_block_note("w", 1, 2, (64, 16), 1, 1) is None  # element units: nothing to cut


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["llama3-8b", "--mesh", "1x8x3"],
            "--mesh 1x8x3: layer tensor 'attention.wq.weight' (4096, 4096) is split on dim 0 by "
            "torchtitan's TP plan, and 4096 does not divide by tp 3; use a tp degree that "
            "divides every split dim, e.g. --mesh 1x8x2",
        ),
        (["llama3-8b", "--mesh", "2x2x2x2"], "fold the outer dimensions into REPLICATE"),
        (["llama3-8b", "--mesh", "1x8x0"], "every dimension must be >= 1"),
        (
            ["llama3-8b", "--mesh", "1x8x2", "--all-gather", "fp8"],
            "--all-gather fp8 with tp 2 (--mesh 1x8x2): fully_shard refuses FP8 gathers",
        ),
    ],
)
def test_bad_tp_meshes_are_one_clear_line(capsys, argv: list[str], message: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and not out
    assert err.startswith("raggedfsdp plan: error: ") and message in err, err
    assert err.count("\n") == 1


def test_local_shape_is_the_even_split() -> None:
    assert tp_local_shape((1024, 4096), 0, 8) == (128, 4096)
    assert tp_local_shape((4096, 14336), 1, 8) == (4096, 1792)
    assert tp_local_shape((4096,), None, 8) == (4096,)
    with pytest.raises(ValueError, match="does not divide by the TP degree 3"):
        tp_local_shape((1024, 4096), 0, 3)
    with pytest.raises(PlanError, match="--mesh 1x2x3"):
        estimate(load_model("llama3-8b"), Settings(Mesh(1, 2, 3)))


# ----------------------------------------------------------------------------- the runtime's plan
#: (unit kind, unit rows, optimizer): the default unit, rows cut by Shard(1), a group policy
POLICIES = [("elements", 1, "adamw"), ("rows", 4, "adamw"), ("elements", 1, "muon")]


def _policy(unit: str, rows: int, optimizer: str):
    return shard_policy(UnitPolicy(unit, rows), OptimizerSpec(optimizer))


def _runtime_layer(unit: str, rows: int, optimizer: str) -> dict:
    """rank's view of layer 0 after torchtitan's TP plan and ``fully_shard`` at (dp 2 x tp 2):
    each parameter's TP dim, and the layout and notes ``fully_shard`` planned."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = parallelize_llama(make_llama(), mesh["tp"])
    dims = {
        name: (p.ndim, getattr(p.placements[0], "dim", None))
        for name, p in model.named_parameters()
    }
    block = model.layers[0]
    raggedfsdp.fully_shard(
        block, mesh=mesh["dp_shard"], shard_policy=_policy(unit, rows, optimizer)
    )
    group = block._fsdp_state().group
    layout = group.layout
    return {
        "dims": dims,
        "segment": layout.segment_size,
        "offsets": dict(layout.offsets),
        "units": {t.name: t.unit for t in layout.tensors},
        "tp_notes": [n for n in group.notes if "the TP split" in n],
    }


def _tiny_llama_shapes():
    """The tiny Llama of ``tests/support/tp_models.py`` as a shapes model, in its own order."""
    params = [(n, list(p.shape)) for n, p in make_llama().named_parameters()]
    layer = [[n.removeprefix("layers.0."), s] for n, s in params if n.startswith("layers.0.")]
    rest = [[n, s] for n, s in params if not n.startswith("layers.")]
    groups = [{"name": "layer", "repeat": 2, "tensors": layer}, {"name": "root", "tensors": rest}]
    return parse_shapes({"name": "tiny-llama", "groups": groups}, "tp_models.py")


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p[0]}-{p[1]}-{p[2]}")
def test_tp_local_plans_are_what_fully_shard_plans(dist_pool, policy) -> None:
    runtime = dist_pool(4).run(_runtime_layer, *policy)
    assert all(r == runtime[0] for r in runtime)  # every TP rank plans the same local tensors
    runtime = runtime[0]
    for name, (ndim, dim) in runtime["dims"].items():  # torchtitan's plan, as applied
        assert tp_dim(name, ndim) == dim, name
    unit, rows, optimizer = policy
    settings = Settings(Mesh(1, 2, 2), UnitPolicy(unit, rows), OptimizerSpec(optimizer))
    layer = _layer(estimate(_tiny_llama_shapes(), settings))
    assert layer.segment == runtime["segment"]
    assert dict(layer.layout.offsets) == runtime["offsets"]
    assert {t.name: t.unit for t in layer.layout.tensors} == runtime["units"]
    assert list(layer.tp_notes) == runtime["tp_notes"]
    if policy == ("rows", 4, "adamw"):  # the runtime's own test of its notes, seen here too
        assert any("'attention.wo.weight'" in n for n in runtime["tp_notes"])
