"""recipes.llama: configuration (presets, overrides, errors), the model's shapes and FLOPs, the
optimizer choice and the learning-rate schedule. Single process, no process group."""

from __future__ import annotations

import itertools
import json
import math
import types
from pathlib import Path

import pytest
import torch

import raggedfsdp
from recipes.llama import optimizers
from recipes.llama.config import Config, ConfigError, ModelConfig, parse_args, usage
from recipes.llama.model import Transformer, flops_per_token, matmul_params


def test_defaults_are_the_tiny_demo():
    cfg = parse_args([])
    assert cfg == Config()
    assert (cfg.optimizer, cfg.fsdp, cfg.wandb_mode) == ("adamw", "raggedfsdp", "offline")


def test_overrides_both_spellings_and_order():
    cfg = parse_args(
        ["--lr=0.5", "--wandb-mode", "disabled", "--model.n_layers", "3", "--model.tie-embeddings"]
    )
    assert (cfg.lr, cfg.wandb_mode, cfg.model.n_layers, cfg.model.tie_embeddings) == (
        0.5,
        "disabled",
        3,
        True,
    )
    # --config is applied first wherever it appears; later keys override it
    cfg = parse_args(["--steps", "5", "--config", "debug"])
    assert cfg.steps == 5 and cfg.model.dim == 32


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as err:
        parse_args(["--learning-rate", "1e-3"])
    message = str(err.value)
    assert "unknown config key 'learning_rate'" in message
    assert "Valid keys:" in message and "lr" in message and "model.n_kv_heads" in message


def test_close_match_is_suggested():
    with pytest.raises(ConfigError, match="did you mean wandb_mode"):
        parse_args(["--wandb_mod", "offline"])


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--steps", "many"], "steps='many'"),
        (["--optimizer", "sgd"], "expected one of adamw, adamw8bit, muon, shampoo"),
        (["--progress", "maybe"], "expected true or false"),
        (["--model.n_heads", "3"], "must be a multiple of n_heads"),
        (["--steps", "0"], "steps=0 must be >= 1"),
        (["--config", "nope"], "no preset 'nope'; presets: debug"),
        (["stray"], "expected --key value"),
        (["--lr"], "argument --lr: expected one argument"),
        (["--lr", "--steps", "3"], "argument --lr: expected one argument"),
    ],
)
def test_bad_values_are_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(argv)


def test_config_files_toml_and_json(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 7\noptimizer = "adamw8bit"\n[model]\ndim = 64\n')
    cfg = parse_args(["--config", str(toml)])
    assert (cfg.steps, cfg.optimizer, cfg.model.dim) == (7, "adamw8bit", 64)
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"lr": 1, "model": {"n_layers": 1}}))
    cfg = parse_args(["--config", str(js)])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.model.n_layers == 1


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("stepz = 3", "unknown config key 'stepz'"),
        ("[optim]\nlr = 1", r"table \[optim\] is unknown"),
        ("steps = 2.5", "expected an integer"),
        ("steps = ", "cannot be read"),
        ("__import__('os')", "cannot be read"),  # values only: nothing is evaluated
    ],
)
def test_bad_config_files_are_refused(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        parse_args(["--config", str(path)])


def test_usage_lists_every_key():
    text = usage()
    for key in ("--wandb-mode", "--optimizer", "--model.n-kv-heads", "--dp-replicate"):
        assert key in text


# ----------------------------------------------------------------------------- model
def test_presets_build_llama3_shapes_on_meta():
    """The 8B and 70B presets build (on the meta device: no memory) with Meta's parameter
    counts and the shapes raggedfsdp's planner tables use."""
    shapes = json.loads((Path(raggedfsdp.__file__).parent / "data/model_shapes.json").read_text())
    expected = {m["name"]: m for m in shapes["models"]}
    for preset, name, billions in (
        ("llama3_8b", "llama3-8b", 8.03),
        ("llama3_70b", "llama3-70b", 70.55),
    ):
        cfg = parse_args(["--config", preset])
        with torch.device("meta"):
            model = Transformer(cfg.model, cfg.seq_len)
        assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
        layer = next(g for g in expected[name]["groups"] if g["name"] == "layer")
        block = dict(model.layers[0].named_parameters())
        assert {n: list(block[n].shape) for n, _ in layer["tensors"]} == dict(layer["tensors"])
        assert layer["repeat"] == cfg.model.n_layers


def test_flops_per_token_matches_the_formula():
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100)
    untied = Transformer(cfg, seq_len=16)
    total = sum(p.numel() for p in untied.parameters())
    assert matmul_params(untied) == total - 100 * 64  # the embedding lookup is no matmul
    assert (
        flops_per_token(cfg, matmul_params(untied), 16) == 6 * (total - 6400) + 12 * 2 * 4 * 16 * 16
    )
    tied_cfg = ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, tie_embeddings=True
    )
    tied = Transformer(tied_cfg, seq_len=16)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert matmul_params(tied) == sum(p.numel() for p in tied.parameters())


def test_gqa_model_is_causal_and_block_materialization_matches_full_init():
    cfg = ModelConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=50, tie_embeddings=True
    )
    full = Transformer(cfg, seq_len=12)
    full.init_weights(seed=3)
    with torch.device("meta"):
        lazy = Transformer(cfg, seq_len=12)
    for i in reversed(range(cfg.n_layers)):  # any order gives the same weights
        lazy.materialize_block(i, torch.device("cpu"), seed=3)
    lazy.materialize_root(torch.device("cpu"), seed=3)
    assert lazy.output.weight is lazy.tok_embeddings.weight
    for (name, a), (_, b) in zip(full.named_parameters(), lazy.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, 50, (2, 12))
    out = full(tokens)
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 50
    assert torch.equal(full(changed)[:, :8], out[:, :8])  # the future does not leak back
    assert torch.equal(lazy(tokens), out)


def test_activation_checkpointing_gives_the_same_gradients():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50)
    grads = []
    for ac in (False, True):
        model = Transformer(cfg, seq_len=8, activation_checkpointing=ac)
        model.init_weights(seed=0)
        model(torch.arange(16).view(2, 8)).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


# ----------------------------------------------------------------------------- optimizers
def test_unavailable_optimizer_says_what_is_missing(monkeypatch):
    empty = types.SimpleNamespace()  # a raggedfsdp.optim that has none of the optimizers yet
    monkeypatch.setattr(optimizers, "library", lambda: empty)
    with pytest.raises(ConfigError, match=r"needs raggedfsdp.optim.AdamW8bit, which this"):
        optimizers.optimizer_class("adamw8bit", "raggedfsdp")
    assert optimizers.optimizer_class("adamw", "raggedfsdp") is torch.optim.AdamW  # fallback
    with pytest.raises(ConfigError, match="fsdp2 runs with --optimizer adamw only"):
        optimizers.optimizer_class("adamw8bit", "fsdp2")


def test_muon_groups_split_block_matrices_from_the_rest():
    cfg = Config(model=ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2))
    model = Transformer(cfg.model, seq_len=8)
    groups = optimizers.param_groups(model, cfg, split_matrices=True)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, decay, no_decay = ([names[id(p)] for p in g["params"]] for g in groups)
    assert [g["use_muon"] for g in groups] == [True, False, False]
    assert groups[0]["lr"] == cfg.muon_lr
    assert len(muon) == 2 * 7 and all(n.startswith("layers.") for n in muon)
    assert decay == ["tok_embeddings.weight", "output.weight"]
    assert no_decay and all(n.endswith("norm.weight") for n in no_decay)


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_lr_schedule_warms_up_then_decays_to_the_floor(schedule):
    cfg = Config(steps=100, warmup_steps=10, min_lr_ratio=0.1, lr_schedule=schedule)
    factors = [optimizers.lr_factor(s, cfg) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(factors[9:]))
    assert min(factors[10:]) >= 0.1 - 1e-12
    assert factors[-1] == pytest.approx(0.1, abs=0.01)
    if schedule == "wsd":
        assert factors[79] == 1.0 and factors[80] < 1.0  # decay over the last 20%
    else:
        assert factors[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
