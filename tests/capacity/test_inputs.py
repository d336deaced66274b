"""Capacity planner inputs: presets, HF config.json parsing, shapes files, input errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from raggedfsdp.capacity import PlanError, load_model, preset_names
from raggedfsdp.capacity.hf_config import shapes_from_hf_config

#: A LLaMA-style dense config: GQA, attention biases, tied embeddings.
DENSE = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "attention_bias": True,
    "tie_word_embeddings": True,
}
#: A Qwen2-MoE config: shared expert, MoE every 2nd layer, layer 3 forced dense.
MOE = {
    "model_type": "qwen2_moe",
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 48,
    "num_experts": 4,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 50,
    "tie_word_embeddings": False,
}


def _write(path: Path, data: object) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def _numel(tensors) -> int:
    return sum(math.prod(s) for _, s in tensors)


def test_presets_cover_bundled_shapes_and_hf_configs() -> None:
    names = preset_names()
    assert {"llama3-8b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b", "qwen2-72b"} <= set(names)
    # Public parameter counts, in billions, as the model cards state them.
    expected = {
        "llama3-8b": 8.03,
        "llama3-70b": 70.55,
        "mistral-7b": 7.24,
        "mixtral-8x7b": 46.70,
        "qwen2-72b": 72.71,
        "llama3.2-1b": 1.24,
        "qwen1.5-moe-a2.7b": 14.32,
        "deepseek-v3": 671.03,
    }
    for name, billions in expected.items():
        assert load_model(name).numel / 1e9 == pytest.approx(billions, abs=0.01), name


def test_dense_hf_config_shapes(tmp_path: Path) -> None:
    model = load_model(_write(tmp_path / "config.json", DENSE))
    root, layers = model.groups
    assert (
        root.root
        and root.name == "root"
        and dict(root.tensors) == {"embed_tokens.weight": (100, 64), "norm.weight": (64,)}
    )
    assert layers.repeat == 3 and not layers.root
    shapes = dict(layers.tensors)
    assert shapes["self_attn.q_proj.weight"] == (64, 64)
    assert shapes["self_attn.k_proj.weight"] == shapes["self_attn.v_proj.weight"] == (32, 64)
    assert shapes["self_attn.o_proj.bias"] == (64,)  # LLaMA's attention_bias covers o_proj
    assert shapes["mlp.down_proj.weight"] == (64, 160)
    per_layer = 2 * 4096 + 2 * 2048 + 64 + 32 + 32 + 64 + 2 * 64 + 3 * 160 * 64
    assert model.numel == 3 * per_layer + 100 * 64 + 64


def test_moe_hf_config_layers_and_expert_layouts(tmp_path: Path) -> None:
    path = _write(tmp_path / "config.json", MOE)
    model = load_model(path)
    assert [(g.name, g.repeat) for g in model.groups] == [
        ("embed", 1),
        ("dense_layer", 1),
        ("moe_layer", 1),
        ("dense_layer", 2),
        ("head", 1),
    ]
    moe = dict(model.groups[2].tensors)
    assert moe["mlp.gate.weight"] == (4, 32)
    assert moe["mlp.experts.3.down_proj.weight"] == (32, 16)
    assert moe["mlp.shared_expert.up_proj.weight"] == (48, 32)
    assert moe["mlp.shared_expert_gate.weight"] == (1, 32)
    assert moe["self_attn.q_proj.bias"] == (32,) and "self_attn.o_proj.bias" not in moe  # Qwen2
    attention, dense_mlp = 4 * 1024 + 3 * 32 + 2 * 32, 3 * 64 * 32
    moe_mlp = 4 * 32 + 4 * 3 * 16 * 32 + 3 * 48 * 32 + 32
    assert model.numel == 50 * 32 * 2 + 32 + 3 * (attention + dense_mlp) + attention + moe_mlp
    fused = load_model(path, experts="fused")
    stacked = dict(fused.groups[2].tensors)
    assert stacked["mlp.experts.gate_up_proj"] == (4, 32, 32)
    assert stacked["mlp.experts.down_proj"] == (4, 32, 16)
    assert fused.numel == model.numel
    assert len(fused.groups[2].tensors) == len(model.groups[2].tensors) - 12 + 2


def test_mixtral_and_qwen3_specifics() -> None:
    mixtral = shapes_from_hf_config(
        {
            "model_type": "mixtral",
            "hidden_size": 32,
            "intermediate_size": 48,
            "vocab_size": 40,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 3,
        },
        "fixture",
        experts="fused",
    )
    layer = dict(mixtral.groups[1].tensors)
    assert mixtral.groups[1].repeat == 2
    assert layer["mlp.experts.gate_up_proj"] == (3, 96, 32)
    assert layer["mlp.gate.weight"] == (3, 32)
    qwen3 = shapes_from_hf_config(
        {
            "model_type": "qwen3",
            "hidden_size": 32,
            "intermediate_size": 48,
            "vocab_size": 40,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
        },
        "fixture",
    )
    layer = dict(qwen3.groups[1].tensors)
    assert layer["self_attn.q_proj.weight"] == (64, 32)  # head_dim decoupled from hidden
    assert layer["self_attn.q_norm.weight"] == layer["self_attn.k_norm.weight"] == (16,)


def test_shapes_file_single_and_multi_model(tmp_path: Path) -> None:
    one = {
        "name": "toy",
        "groups": [{"name": "block", "repeat": 4, "tensors": [["w", [8, 4]], ["b", [8]]]}],
    }
    model = load_model(_write(tmp_path / "one.json", one))
    assert (model.name, model.numel, model.num_fsdp_groups) == ("toy", 4 * 40, 4)
    two = {"models": [one, {**one, "name": "other"}]}
    path = _write(tmp_path / "two.json", two)
    assert load_model(path, model="other").name == "other"
    with pytest.raises(PlanError, match="pick one with --model"):
        load_model(path)
    with pytest.raises(PlanError, match="no model named 'nope'"):
        load_model(path, model="nope")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"groups": []}, "'groups' must be a non-empty list"),
        ({"groups": [{"name": "g", "repeat": 0, "tensors": [["w", [2]]]}]}, "'repeat' must be"),
        ({"groups": [{"name": "g", "tensors": [["w", [2, -1]]]}]}, "non-negative integers"),
        ({"groups": [{"name": "g", "tensors": [["w", 7]]}]}, r"expected \[name, \[d0"),
        ({"groups": [{"name": "g", "tensors": [["w", [2]], ["w", [3]]]}]}, "names repeat"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_malformed_shapes_files_name_the_place(tmp_path: Path, data, message) -> None:
    with pytest.raises(PlanError, match=message):
        load_model(_write(tmp_path / "shapes.json", data))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": None}, "missing 'hidden_size'"),
        ({"hidden_size": "64"}, "'hidden_size' must be an integer"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"model_type": "mamba"}, "model_type 'mamba' is not supported; supported: llama"),
        ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
    ],
)
def test_malformed_hf_configs_name_the_key(tmp_path: Path, change, message) -> None:
    cfg = {k: v for k, v in {**DENSE, **change}.items() if v is not None}
    with pytest.raises(PlanError, match=message):
        load_model(_write(tmp_path / "config.json", cfg))


def test_unreadable_inputs(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match=r"not valid JSON \(line 1"):
        load_model(str(bad))
    with pytest.raises(PlanError, match="no such file"):
        load_model(str(tmp_path / "missing.json"))
    with pytest.raises(PlanError, match=r"unknown preset 'llama3-7b'; valid presets: .*llama3-8b"):
        load_model("llama3-7b")


def test_options_that_do_not_apply_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="--experts applies to Hugging Face configs"):
        load_model("gpt-oss-120b", experts="fused")
    with pytest.raises(PlanError, match="--model picks a model inside a shapes file"):
        load_model("mixtral-8x7b", model="x")
    with pytest.raises(PlanError, match="choose one of"):
        load_model(_write(tmp_path / "config.json", MOE), experts="stacked")


def _cli_error(capsys, argv: list[str]) -> str:
    """Run the CLI; return its one stderr line after checking status 2 and no stdout. argparse's
    own errors exit through SystemExit, the planner's return 2: both count."""
    from raggedfsdp.capacity.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and not out, (code, out)
    assert err.count("\n") == 1 and "Traceback" not in err and "usage:" not in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-w", "0"], "argument -w/--world-size: 0 must be an integer >= 1"),
        (["--mesh", "3x"], "--mesh '3x': expected SHARD or REPLICATExSHARD"),
        (["--mesh", "2x2x2x2"], "fold the outer dimensions into REPLICATE"),
        (["-w", "8", "--gpu-memory", "-1"], "argument --gpu-memory: '-1': give a finite number"),
        (["-w", "8", "--gpu-memory", "inf"], "argument --gpu-memory: 'inf': give a finite"),
        (["-w", "8", "--param-dtype", "bf61"], "--param-dtype 'bf61': unknown; use one of"),
        (["-w", "8", "--optimizer", "adamw8bit", "--tile", "0x32"], "--tile: '0x32': expected"),
        (["-w", "8", "--unit-rows", "0"], "argument --unit-rows: 0 must be an integer >= 1"),
        (["-w", "8", "--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'"),
        ([], "one of the arguments -w/--world-size --mesh is required"),
    ],
)
def test_bad_options_are_one_line(capsys, argv: list[str], message: str) -> None:
    err = _cli_error(capsys, ["llama3-8b", *argv])
    assert err.startswith("raggedfsdp plan: error: ") and message in err, err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON (line 1"),
        (json.dumps({k: v for k, v in DENSE.items() if k != "hidden_size"}), "'hidden_size'"),
        (json.dumps({**DENSE, "hidden_size": -64}), "'hidden_size' must be an integer >= 1"),
        (json.dumps({**DENSE, "vocab_size": 0}), "'vocab_size' must be an integer >= 1, got 0"),
        (json.dumps({**DENSE, "model_type": "falcon"}), "model_type 'falcon' is not supported"),
    ],
)
def test_bad_config_files_are_one_line(capsys, tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    assert message in _cli_error(capsys, [str(path), "-w", "8"])
