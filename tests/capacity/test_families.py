"""``raggedfsdp plan`` on Hugging Face configs of families beyond the presets.

Each config holds the architecture keys of a public ``config.json``, written out here by hand.
The parameter count the planner reports is checked against a closed-form count of the same
architecture computed here (independently of the planner's tensor lists) and against the count
published on the model card, at several world sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raggedfsdp.capacity import PlanError, load_model
from raggedfsdp.capacity.cli import main

WORLD_SIZES = ("1", "3", "8", "1024")


def dense_count(cfg: dict, *, norms: int = 2, qkv_bias: bool = False, qk_norm: bool = False):
    """Parameters of a dense decoder: embeddings (+ head unless tied), per layer attention
    (q, k, v, o), a gated MLP, ``norms`` RMSNorms, then the final norm."""
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    attn = 2 * h * heads * hd + 2 * h * kv * hd
    attn += (heads * hd + 2 * kv * hd) if qkv_bias else 0
    attn += 2 * hd if qk_norm else 0
    mlp = 3 * h * cfg["intermediate_size"]
    tied = cfg.get("tie_word_embeddings", False)
    return (1 if tied else 2) * v * h + layers * (attn + mlp + norms * h) + h


def mla_moe_count(cfg: dict) -> int:
    """DeepSeek-V2/V3: MLA attention, ``first_k_dense_replace`` dense layers, then MoE layers
    with routed experts, shared experts and a router (plus V3's correction bias)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    rank_q, rank_kv = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    q = h * heads * qk if rank_q is None else h * rank_q + rank_q + rank_q * heads * qk
    kv = h * (rank_kv + cfg["qk_rope_head_dim"]) + rank_kv
    kv += rank_kv * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
    attn = q + kv + heads * cfg["v_head_dim"] * h + 2 * h
    n, f = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    router = n * h + (n if cfg["model_type"] == "deepseek_v3" else 0)
    moe = router + 3 * h * f * (n + cfg["n_shared_experts"])
    dense_layers = cfg["first_k_dense_replace"]
    layers = cfg["num_hidden_layers"]
    body = dense_layers * (attn + 3 * h * cfg["intermediate_size"])
    body += (layers - dense_layers) * (attn + moe)
    return 2 * cfg["vocab_size"] * h + body + h


LLAMA2_7B_NO_KV_HEADS = {  # multi-head attention: num_key_value_heads left out
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "vocab_size": 32000,
    "torch_dtype": "float16",
    "rope_scaling": None,
}
LLAMA32_3B_TIED = {
    "model_type": "llama",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
MISTRAL_7B_SLIDING = {  # sliding window changes no shape; head_dim null means hidden/heads
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "sliding_window": 4096,
    "head_dim": None,
    "tie_word_embeddings": False,
}
QWEN2_7B = {  # q/k/v biases without an attention_bias key
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "sliding_window": 131072,
}
GEMMA_7B = {  # tied by the family's default; head_dim 256 != 3072 / 16
    "model_type": "gemma",
    "hidden_size": 3072,
    "intermediate_size": 24576,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 256,
    "vocab_size": 256000,
    "hidden_act": "gelu",
}
GEMMA2_9B = {  # pre/post feed-forward norms as well
    "model_type": "gemma2",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "vocab_size": 256000,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "query_pre_attn_scalar": 256,
}
GEMMA3_1B = {  # Gemma-2's layout plus q/k norms
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "sliding_window_pattern": 6,
}
PHI3_MINI = {  # fused qkv_proj and gate_up_proj
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32064,
    "tie_word_embeddings": False,
}
DEEPSEEK_V2_LITE = {  # MLA without a query bottleneck (q_lora_rank null)
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "vocab_size": 102400,
    "topk_method": "greedy",
    "tie_word_embeddings": False,
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "vocab_size": 129280,
    "topk_method": "noaux_tc",
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
}

#: (config, closed-form count, the model card's count in billions)
FAMILIES = {
    "llama2-7b-mha": (LLAMA2_7B_NO_KV_HEADS, dense_count(LLAMA2_7B_NO_KV_HEADS), 6.74),
    "llama3.2-3b-tied": (LLAMA32_3B_TIED, dense_count(LLAMA32_3B_TIED), 3.21),
    "mistral-7b-sliding": (MISTRAL_7B_SLIDING, dense_count(MISTRAL_7B_SLIDING), 7.24),
    "qwen2-7b": (QWEN2_7B, dense_count(QWEN2_7B, qkv_bias=True), 7.62),
    "gemma-7b": (GEMMA_7B, dense_count({**GEMMA_7B, "tie_word_embeddings": True}), 8.54),
    "gemma-2-9b": (
        GEMMA2_9B, dense_count({**GEMMA2_9B, "tie_word_embeddings": True}, norms=4), 9.24
    ),
    "gemma-3-1b": (
        GEMMA3_1B,
        dense_count({**GEMMA3_1B, "tie_word_embeddings": True}, norms=4, qk_norm=True),
        1.00,
    ),
    "phi-3-mini": (PHI3_MINI, dense_count(PHI3_MINI), 3.82),
    "deepseek-v2-lite": (DEEPSEEK_V2_LITE, mla_moe_count(DEEPSEEK_V2_LITE), 15.71),
}  # fmt: skip


def _write(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plan_counts_every_parameter(capsys, tmp_path: Path, family: str) -> None:
    cfg, expected, card_billions = FAMILIES[family]
    assert expected / 1e9 == pytest.approx(card_billions, abs=0.01)
    path = _write(tmp_path, cfg)
    experts = ["--experts", "fused"] if "n_routed_experts" in cfg else []
    for w in WORLD_SIZES:
        assert main([path, "-w", w, "--json", *experts]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["model"]["params"] == expected, (family, w)
        assert out["mesh"]["world"] == int(w)


def test_deepseek_v3_config_matches_the_bundled_shapes(tmp_path: Path) -> None:
    """The MLA + MoE layout from the config is the preset's, tensor for tensor (the preset was
    written from the checkpoint's index, not from this parser)."""
    model = load_model(_write(tmp_path, DEEPSEEK_V3))
    preset = load_model("deepseek-v3")
    assert model.numel == preset.numel == mla_moe_count(DEEPSEEK_V3)
    assert [(g.name, g.repeat) for g in model.groups] == [(g.name, g.repeat) for g in preset.groups]
    for ours, theirs in zip(model.groups, preset.groups, strict=True):
        assert dict(ours.tensors) == dict(theirs.tensors), ours.name


def test_layouts_of_the_new_families(tmp_path: Path) -> None:
    phi = dict(load_model(_write(tmp_path, PHI3_MINI)).groups[1].tensors)
    assert phi["self_attn.qkv_proj.weight"] == (3 * 3072, 3072)
    assert phi["mlp.gate_up_proj.weight"] == (2 * 8192, 3072)
    gemma = load_model(_write(tmp_path, GEMMA2_9B))
    assert gemma.groups[0].root and "lm_head.weight" not in dict(gemma.groups[0].tensors)
    layer = dict(gemma.groups[1].tensors)
    assert layer["self_attn.q_proj.weight"] == (16 * 256, 3584)
    assert layer["post_feedforward_layernorm.weight"] == (3584,)
    untied = load_model(_write(tmp_path, {**GEMMA_7B, "tie_word_embeddings": False}))
    assert [g.name for g in untied.groups] == ["embed", "layer", "head"]
    lite = load_model(_write(tmp_path, DEEPSEEK_V2_LITE))
    assert [(g.name, g.repeat) for g in lite.groups][1:3] == [("dense_layer", 1), ("moe_layer", 26)]
    moe = dict(lite.groups[2].tensors)
    assert moe["self_attn.q_proj.weight"] == (16 * 192, 2048)
    assert moe["mlp.shared_experts.up_proj.weight"] == (2 * 1408, 2048)
    assert "mlp.gate.e_score_correction_bias" not in moe


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            {"model_type": "llava", "text_config": {"model_type": "llama"}, "vision_config": {}},
            "model_type 'llava' is a multimodal wrapper (a 'text_config' of model_type 'llama'",
        ),
        (
            {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}},
            "plan the text model alone from 'text_config' saved as its own config.json",
        ),
        ({"hidden_size": 64, "vocab_size": 10}, "missing 'model_type'; add it (one of: llama"),
        ({**LLAMA2_7B_NO_KV_HEADS, "intermediate_size": None}, "missing 'intermediate_size'"),
        ({**DEEPSEEK_V3, "kv_lora_rank": 0}, "'kv_lora_rank' must be an integer >= 1, got 0"),
        ({**QWEN2_7B, "num_hidden_layers": -2}, "'num_hidden_layers' must be an integer >= 1"),
        ({"model_type": "mamba", "hidden_size": 8}, "model_type 'mamba' is not supported"),
    ],
)
def test_unsupported_configs_say_what_to_do(tmp_path: Path, cfg: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(_write(tmp_path, cfg))
