"""The planner's ep dim (``--mesh dp_replicate=R,dp_shard=S,ep=E``): the shared EP rules, each
EP rank's experts planned over dp_shard_mod_ep as the recipe's ``shard_ep_block`` wraps them
(compared with a real EP-wrapped model at W=4), memory and all-to-all traffic of the three MoE
presets, the old ``--mesh`` forms unchanged, and one-line refusals."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

import raggedfsdp
from raggedfsdp.capacity import Mesh, PlanError, Settings, estimate, load_model
from raggedfsdp.capacity.cli import main
from raggedfsdp.capacity.ep_plan import COUNT_BYTES, ep_local_model, moe_layers
from raggedfsdp.capacity.model_shapes import parse_shapes
from raggedfsdp.capacity.policies import is_expert
from raggedfsdp.sharding.ep_split import check_ep, ep_complement, ep_coordinates, expert_range

DOCS = Path(__file__).resolve().parents[2] / "docs" / "capacity.md"
#: The presets of docs/capacity.md's EP table: (name, top-k, --mesh).
PRESETS = [
    ("deepseek-v3", 8, "dp_replicate=1,dp_shard=256,ep=32"),
    ("qwen3-30b-a3b", 8, "dp_replicate=1,dp_shard=64,ep=8"),
    ("gpt-oss-120b", 4, "dp_replicate=1,dp_shard=64,ep=8"),
]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# ----------------------------------------------------------------------------- the shared rules
def test_ep_rules_hold_neighbouring_experts_and_divide_dp_shard() -> None:
    assert list(expert_range(8, 2, 1)) == [4, 5, 6, 7]
    assert [list(expert_range(6, 3, j)) for j in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert ep_complement(16, 8) == 2 and ep_complement(4, 4) == 1
    assert ep_coordinates(5, 2) == (2, 1)  # rank i * ep + j is (dp_shard_mod_ep i, ep j)
    with pytest.raises(ValueError, match=r"ep=4 does not divide n_experts=6"):
        check_ep(6, 4)
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 16 .* \[1, 2, 4, 8, 16\]"):
        ep_complement(16, 3)
    with pytest.raises(ValueError, match=r"ep rank 2 is outside \[0, 2\)"):
        expert_range(8, 2, 2)


def test_named_mesh_dims_and_the_old_forms() -> None:
    mesh = Mesh.parse("dp_replicate=2,dp_shard=16,ep=8")
    assert mesh == Mesh(2, 16, 1, 8) and mesh.world_size == 32
    assert Mesh.parse(mesh.text) == mesh and mesh.text == "dp_replicate=2,dp_shard=16,ep=8"
    assert Mesh.parse("ep=4, tp=2, dp_shard=8") == Mesh(1, 8, 2, 4)
    assert Mesh.parse("dp_shard=8,tp=2") == Mesh.parse("1x8x2") == Mesh(1, 8, 2)
    assert Mesh.parse("1x8x2").text == "1x8x2" and Mesh.parse("4x256").text == "4x256"


# ----------------------------------------------------------------------------- the runtime's plan
def _tiny_moe():
    from recipes.llama.model_config import MoEConfig
    from recipes.llama.moe import MoETransformer

    cfg = MoEConfig(
        dim=32, n_layers=2, n_heads=2, n_kv_heads=2, n_experts=8, top_k=2, moe_hidden=24
    )
    model = MoETransformer(cfg, seq_len=8)
    model.init_weights(seed=0)
    return model


def _runtime_ep(ep: int) -> dict:
    """This rank's layouts of the tiny MoE model wrapped as the recipe wraps it under EP
    (``docs/expert_parallel.md``): per block the experts' and the dense group's."""
    from recipes.llama.expert_parallel import distribute_experts, ep_meshes, shard_ep_block

    model = _tiny_moe()
    mesh, dp = ep_meshes(ep=ep)
    distribute_experts(model, mesh["ep"])
    for block in model.layers:
        shard_ep_block(block, mesh, dp)
    raggedfsdp.fully_shard(model, mesh=dp)
    layouts = {}
    for i, block in enumerate(model.layers):
        for name, module in (("dense", block), ("experts", block.feed_forward.experts)):
            layout = module._fsdp_state().group.layout
            layouts[f"{i}.{name}"] = {
                "segment": layout.segment_size,
                "world": layout.world_size,
                "units": {t.name.rsplit(".", 1)[-1]: t.unit for t in layout.tensors},
                "shapes": {t.name.rsplit(".", 1)[-1]: tuple(t.shape) for t in layout.tensors},
            }
    # the root's embedding is a group of its own (freed after forward): count both
    root = sum(g.layout.segment_size for g in model._fsdp_state().groups)
    return {"layouts": layouts, "root": root}


def _tiny_moe_shapes():
    """The tiny MoE model as a shapes model: one group per block, the rest the root's."""
    params = [(n, list(p.shape)) for n, p in _tiny_moe().named_parameters()]
    layer = [[n.removeprefix("layers.0."), s] for n, s in params if n.startswith("layers.0.")]
    rest = [[n, s] for n, s in params if not n.startswith("layers.")]
    groups = [
        {"name": "layer", "repeat": 2, "tensors": layer},
        {"name": "root", "tensors": rest, "root": True},
    ]
    return parse_shapes({"name": "tiny-moe", "groups": groups}, "recipes/llama/moe.py")


def test_expert_bytes_are_what_an_ep_wrapped_model_holds(dist_pool) -> None:
    runtime = dist_pool(4).run(_runtime_ep, 2)
    assert all(r["layouts"] == runtime[0]["layouts"] for r in runtime)  # same shapes everywhere
    est = estimate(_tiny_moe_shapes(), Settings(Mesh(1, 4, 1, 2), top_k=2))
    plans = {p.group.name: p for p in est.plans}
    experts, dense = plans["layer.experts"], plans["layer"]
    seen = runtime[0]["layouts"]
    for i in range(2):
        assert seen[f"{i}.experts"]["world"] == experts.layout.world_size == 2
        assert seen[f"{i}.experts"]["segment"] == experts.segment
        for key in ("units", "shapes"):  # 4 of the 8 experts, (4, 24, 32) for w1
            assert seen[f"{i}.experts"][key] == {
                t.name.rsplit(".", 1)[-1]: t.unit if key == "units" else tuple(t.shape)
                for t in experts.layout.tensors
            }
        assert seen[f"{i}.dense"]["world"] == dense.layout.world_size == 4
        assert seen[f"{i}.dense"]["segment"] == dense.segment
    assert seen["0.experts"]["shapes"]["w1"] == (4, 24, 32)
    assert runtime[0]["root"] == plans["root"].segment
    # the planner's per-rank expert bytes (fp32 master) are the runtime's experts' storage
    assert est.memory["expert_params"] == 4 * sum(seen[f"{i}.experts"]["segment"] for i in range(2))
    runtime_total = sum(v["segment"] for v in seen.values()) + runtime[0]["root"]
    assert est.memory["params"] == 4 * runtime_total


# ----------------------------------------------------------------------------- memory, traffic
def _expert_numel(name: str) -> tuple[int, int]:
    """(experts, elements of one expert across its tensors) of a preset's MoE block."""
    (layer,) = {(m.n_experts, m.name) for m in moe_layers(load_model(name))}
    group = next(g for g in load_model(name).groups if g.name == layer[1])
    numel = sum(math.prod(s) for n, s in group.tensors if is_expert(n))
    return layer[0], numel // layer[0]


@pytest.mark.parametrize(("name", "top_k", "mesh"), PRESETS, ids=[p[0] for p in PRESETS])
def test_presets_under_ep(name: str, top_k: int, mesh: str) -> None:
    ep_mesh = Mesh.parse(mesh)
    plain = estimate(load_model(name), Settings(Mesh(1, ep_mesh.shard)))
    ep = estimate(load_model(name), Settings(ep_mesh, top_k=top_k))
    n_experts, per_expert = _expert_numel(name)
    (layer,) = ep.moe
    local, mod_ep = n_experts // ep_mesh.ep, ep_mesh.shard // ep_mesh.ep
    # one experts group gathered holds this EP rank's experts whole, in bf16
    assert ep.memory["expert_gathered"] >= 2 * local * per_expert
    assert ep.memory["expert_gathered"] < 2 * local * per_expert * 1.001
    # sharded bytes hardly change (E / ep / dp_shard_mod_ep = E / dp_shard), gathers shrink
    assert abs(ep.memory["params"] / plain.memory["params"] - 1) < 0.001
    assert ep.memory["expert_params"] <= 4 * layer.repeat * local * per_expert / mod_ep * 1.001
    assert ep.memory["peak_unsharded"] < plain.memory["peak_unsharded"] / 2
    assert ep.traffic["all_gather"] < plain.traffic["all_gather"] / 2
    assert ep.traffic["all_reduce"] == 0
    rows = 4 * 4096 * top_k * layer.dim * 2  # bf16 rows of the router's width
    off = (ep_mesh.ep - 1) / ep_mesh.ep
    assert ep.traffic["all_to_all"] == layer.repeat * off * (rows + n_experts * COUNT_BYTES)
    assert ep.traffic["fsdp2_all_to_all"] == ep.traffic["all_to_all"]
    assert "all_to_all" not in plain.traffic and "expert_params" not in plain.memory


def _docs_table() -> dict[str, list[str]]:
    """docs/capacity.md's expert-parallel rows, by model."""
    text = DOCS.read_text().split("### Expert parallelism", 1)[1]
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| `")]
    return {cells[0].strip().strip("`"): [c.strip() for c in cells[1:]] for cells in rows}


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f}"


@pytest.mark.parametrize(("name", "top_k", "mesh"), PRESETS, ids=[p[0] for p in PRESETS])
def test_the_docs_table_is_the_planners(name: str, top_k: int, mesh: str) -> None:
    ep_mesh = Mesh.parse(mesh)
    plain = estimate(load_model(name), Settings(Mesh(1, ep_mesh.shard)))
    ep = estimate(load_model(name), Settings(ep_mesh, top_k=top_k))
    m, t = ep.memory, ep.traffic
    expected = [
        f"`{mesh}`",
        str(top_k),
        f"{_gib(m['params'])} / {_gib(m['grads'])} / {_gib(m['optimizer'])}",
        f"{_gib(m['expert_params'])} / {_gib(m['expert_optimizer'])}",
        f"{_gib(m['expert_gathered'])}",
        f"{_gib(m['peak_unsharded'])} ({_gib(plain.memory['peak_unsharded'])})",
        f"{_gib(m['total'])} ({_gib(plain.memory['total'])})",
        f"{_gib(t['all_gather'])} ({_gib(plain.traffic['all_gather'])})",
        f"{_gib(t['reduce_scatter'])}",
        f"{_gib(t['all_to_all'])}",
    ]
    assert _docs_table()[name] == expected


def test_the_report_and_json_name_the_ep_dim(capsys) -> None:
    mesh = "dp_replicate=2,dp_shard=64,ep=8"
    code, out, err = _run(capsys, "gpt-oss-120b", "--mesh", mesh, "--top-k", "4")
    assert code == 0, err
    for needle in (
        "mesh 2 x 64 (replicate x shard), ep 8 of the shard ranks (dp_shard_mod_ep 8) = 128",
        "of which experts (layer: 16 of 128 per EP rank, sharded over dp_shard_mod_ep = 8",
        "all-to-all (EP dispatch + combine)",
        "4,096 tokens per rank, top-4, uniform routing (7/8 of the rows leave the rank)",
        "layer.experts",
        "raggedfsdp  FSDP2 x EP",
    ):
        assert needle in out, needle
    code, out, _ = _run(capsys, "gpt-oss-120b", "--mesh", mesh, "--top-k", "4", "--json")
    result = json.loads(out)
    assert result["mesh"] == {
        "replicate": 2, "shard": 64, "tp": 1, "ep": 8, "dp_shard_mod_ep": 8, "world": 128
    }  # fmt: skip
    assert result["expert_parallel"]["layers"] == [
        {"name": "layer", "repeat": 36, "n_experts": 128, "dim": 2880, "experts_per_ep_rank": 16}
    ]
    assert result["traffic_bytes"]["all_reduce"] > 0  # the replicate dim, experts included
    experts = next(g for g in result["groups"] if g["name"] == "layer.experts")
    assert experts["segment_elements"] * 8 >= 16 * 2880 * (5760 + 2880)  # 16 experts over 8


def test_ep_with_tp_splits_experts_on_d_ff() -> None:
    """EP x TP (Qwen3-30B-A3B: 128 experts of d_ff 768, hidden 2048, 48 layers; ep 8, tp 2,
    dp_shard 16): each EP rank's 16 experts keep half their d_ff, sharded over the 2
    dp_shard_mod_ep ranks; the dense weights are TP's, the router whole."""
    est = estimate(load_model("qwen3-30b-a3b"), Settings(Mesh(1, 16, 2, 8), top_k=8))
    plans = {p.group.name: p for p in est.plans}
    experts = dict(plans["layer.experts"].group.tensors)
    assert experts["mlp.experts.up_proj.weight"] == (16, 384, 2048)
    assert experts["mlp.experts.down_proj.weight"] == (16, 2048, 384)
    dense = dict(plans["layer"].group.tensors)
    assert dense["self_attn.q_proj.weight"] == (2048, 2048)
    assert dense["mlp.gate.weight"] == (128, 2048)
    assert plans["layer.experts"].layout.world_size == 2
    per_rank = 48 * 16 * 3 * 384 * 2048 / 2  # fp32 master elements
    assert est.memory["expert_params"] == pytest.approx(4 * per_rank, rel=1e-3)
    assert est.memory["expert_gathered"] == pytest.approx(2 * 16 * 3 * 384 * 2048, rel=1e-3)


#: A parameter's global shape and its ``(mesh dim, Shard dim)`` pairs.
Placed = tuple[tuple[int, ...], tuple[tuple[str, int], ...]]


def _placed(p) -> Placed:
    """``p``'s global shape and the mesh dims its ``Shard`` placements split (none: plain)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return tuple(p.shape), ()
    pairs = zip(p.device_mesh.mesh_dim_names, p.placements, strict=True)
    return tuple(p.shape), tuple((m, pl.dim) for m, pl in pairs if isinstance(pl, Shard))


def _recipe_placements(ep: int) -> dict[str, Placed]:
    """A MoE block of the recipe (shared expert too) as TP rank 0 of tp 2 on the fake process
    group, after ``apply_tp_to_block`` and, with ``ep``, ``distribute_experts`` on
    ``mesh["ep", "tp"]``: each parameter's global shape and placements."""
    from raggedfsdp.dry_run.world import fake_world
    from recipes.llama.expert_parallel import distribute_experts, ep_meshes
    from recipes.llama.moe import MoEBlock
    from recipes.llama.moe_config import MoEConfig
    from recipes.llama.tensor_parallel import apply_tp_to_block

    cfg = MoEConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2)
    cfg = dataclasses.replace(cfg, moe_hidden=24, n_shared_experts=1, n_dense_layers=0)
    with fake_world(0, 4 * ep):
        mesh, _ = ep_meshes(ep, world=4 * ep, tp=2)
        block = MoEBlock(dataclasses.replace(cfg, expert_impl="loop"))
        apply_tp_to_block(block, mesh["tp"])
        if ep > 1:
            distribute_experts(block, mesh["ep", "tp"])
        return {name: _placed(p) for name, p in block.named_parameters()}


def _verify_placements(recipe: dict[str, Placed], mesh: Mesh) -> dict[str, Placed]:
    """The same tensors as ``--verify`` builds them (its ``Chain`` of the planner's local
    model, on the recipe's meshes), as rank 0 on the fake process group."""
    import torch

    from raggedfsdp.capacity import verify
    from raggedfsdp.dry_run.world import fake_world

    group = {"name": "layer", "tensors": [[n, list(s)] for n, (s, _) in recipe.items()]}
    model = parse_shapes({"name": "moe", "groups": [group]}, "recipe")
    with fake_world(0, mesh.world_size):
        meshes = verify.device_meshes(mesh)
        chain = verify.Chain(verify.local_model(model, mesh), torch.float32, meshes, mesh)
        return {name.split(".", 2)[2]: _placed(p) for name, p in chain.named_parameters()}


@pytest.mark.parametrize("ep", [1, 2])
def test_the_planners_placements_are_the_recipes(ep: int) -> None:
    """Every parameter of the recipe's TP (and EP x TP) MoE block is split where the planner
    splits it (``rank_splits``: the dims and the mesh dims; experts on d_ff, router whole,
    the shared expert as a dense MLP) and where ``--verify`` builds it."""
    from raggedfsdp.capacity.tp_plan import rank_splits

    recipe = _recipe_placements(ep)
    mesh = Mesh(1, 2 * ep, 2, ep)
    planner = {}
    for name, (shape, _) in recipe.items():
        experts = ep > 1 and is_expert(name)
        local = (shape[0] // ep, *shape[1:]) if experts else shape
        splits = rank_splits(name, local, experts, mesh)[1]
        planner[name] = (shape, tuple((m, d) for m, d, _ in splits))
    assert planner == recipe
    assert recipe["feed_forward.experts.w2"][1] == (("ep", 0), ("tp", 2))[2 - ep :]
    assert _verify_placements(recipe, mesh) == recipe


def test_ep_1_is_todays_plan() -> None:
    model = load_model("qwen3-30b-a3b")
    assert ep_local_model(model, Mesh(1, 8)) == (model, [])
    a = estimate(model, Settings(Mesh.parse("dp_shard=8"))).to_dict()
    b = estimate(model, Settings(Mesh(1, 8))).to_dict()
    for d in (a, b):
        d.pop("elapsed_s"), d.pop("planning_time_s")
        for g in d["groups"]:
            g.pop("plan_ms")
    assert a == b and "expert_parallel" not in a and "ep" not in a["mesh"]


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["qwen3-30b-a3b", "--mesh", "dp_shard=12,ep=8", "--top-k", "8"],
            "--mesh dp_replicate=1,dp_shard=12,ep=8: expert parallelism: ep=8 does not divide "
            "the 12 data-parallel shard ranks",
        ),
        (
            ["qwen3-30b-a3b", "--mesh", "dp_shard=96,ep=48", "--top-k", "8"],
            "layer: expert parallelism: ep=48 does not divide n_experts=128; each EP rank holds "
            "n_experts / ep whole experts: pick ep from the divisors of 128; use an ep that "
            "divides 128 and dp_shard 96, e.g. --mesh dp_replicate=1,dp_shard=96,ep=32",
        ),
        (
            ["qwen3-30b-a3b", "--mesh", "dp_shard=16,ep=8"],
            "the all-to-all bytes need the experts each token is routed to: give --top-k K",
        ),
        (["qwen3-30b-a3b", "--mesh", "dp_shard=16,ep=8", "--top-k", "200"], "--top-k 200"),
        (
            ["qwen3-30b-a3b", "--mesh", "dp_shard=16,ep=8", "--top-k", "8", "--optimizer", "muon"],
            "--optimizer muon: Muon's owners over EP experts are not modelled",
        ),
        (
            ["gpt-oss-120b", "--mesh", "dp_shard=16,ep=8", "--top-k", "4", "--all-gather", "fp8"],
            "--all-gather fp8: fully_shard refuses FP8 gathers of the experts' DTensors",
        ),
        (
            ["llama3-8b", "--mesh", "dp_shard=16,ep=8", "--top-k", "2"],
            "model 'llama3-8b' has no expert tensors",
        ),
        (["llama3-8b", "--mesh", "dp_shard=16,pp=2"], "'pp=2' is not NAME=SIZE"),
        (["llama3-8b", "--mesh", "tp=2,ep=2"], "dp_shard is missing"),
        (["llama3-8b", "--mesh", "2x2x2x2"], "fold the outer dimensions into REPLICATE"),
    ],
)
def test_bad_ep_input_is_one_clear_line(capsys, argv: list[str], message: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and not out
    assert err.startswith("raggedfsdp plan: error: ") and message in err, err
    assert err.count("\n") == 1


def test_per_expert_stacks_must_be_whole_to_fuse() -> None:
    tensors = [["mlp.gate.weight", [4, 8]], ["mlp.experts.0.w.weight", [3, 8]]]
    tensors += [["mlp.experts.2.w.weight", [3, 8]]]  # expert 1 missing
    model = parse_shapes({"name": "m", "groups": [{"name": "b", "tensors": tensors}]}, "t")
    with pytest.raises(PlanError, match=re.escape("b: the per-expert tensors 'mlp.experts.w.")):
        estimate(model, Settings(Mesh(1, 4, 1, 2), top_k=1))
    no_router = [["mlp.experts.w", [4, 3, 8]]]
    model = parse_shapes({"name": "m", "groups": [{"name": "b", "tensors": no_router}]}, "t")
    with pytest.raises(PlanError, match=r"b: 4 experts but no router weight \(4, dim\)"):
        estimate(model, Settings(Mesh(1, 4, 1, 2), top_k=1))
