"""Parameter shapes from a Hugging Face ``config.json`` (LLaMA / Mistral / Qwen families).

Users deciding how many GPUs to rent have a config, not a shapes file. The shapes are those of the
``transformers`` modules (``nn.Linear`` weights are ``(out, in)``), grouped the way FSDP wraps a
decoder: the embedding, one group per decoder layer (identical consecutive layers become one
group with a repeat count) and the head. With ``tie_word_embeddings`` the shared weight cannot
live in two groups, so it goes to the root group (with the final norm), which stays unsharded
through forward and backward.

MoE experts come either as one tensor per expert and projection (``transformers``' modules, the
default) or *fused* into stacked ``(E, 2F, H)`` / ``(E, H, F)`` tensors as grouped-GEMM kernels
want them. Architectures with other attention or MLP layouts (MLA, fused QKV, ...) are refused
with a pointer to a shapes file, rather than planned with made-up shapes.
"""

from __future__ import annotations

import itertools
from typing import Any

from raggedfsdp.capacity.model_shapes import Group, ModelShapes, PlanError, Shape

__all__ = ["EXPERT_LAYOUTS", "SUPPORTED_MODEL_TYPES", "is_hf_config", "shapes_from_hf_config"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
EXPERT_LAYOUTS = ("per-expert", "fused")
_MOE_TYPES = {"mixtral", "qwen2_moe", "qwen3_moe"}

Tensors = list[tuple[str, Shape]]


def is_hf_config(data: Any) -> bool:
    """Whether parsed JSON looks like a HF config rather than a shapes file."""
    return isinstance(data, dict) and ("model_type" in data or "hidden_size" in data)


def shapes_from_hf_config(
    cfg: Any, where: str, *, experts: str = "per-expert", name: str | None = None
) -> ModelShapes:
    """Derive the model's FSDP groups from a parsed ``config.json`` (see the module docstring)."""
    if not isinstance(cfg, dict):
        raise PlanError(f"{where}: a config.json must be a JSON object")
    if experts not in EXPERT_LAYOUTS:
        raise PlanError(f"experts={experts!r}: choose one of {list(EXPERT_LAYOUTS)}")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise PlanError(
            f"{where}: model_type {model_type!r} is not supported; supported: "
            f"{list(SUPPORTED_MODEL_TYPES)}. For another architecture write a shapes file in "
            "raggedfsdp/data/model_shapes.json's format and pass its path instead"
        )
    c = _Config(cfg, where)
    hidden, vocab = c.integer("hidden_size"), c.integer("vocab_size")
    layers = c.integer("num_hidden_layers")
    kinds = [_layer_kind(c, model_type, i) for i in range(layers)]
    tensors = {kind: _layer(c, model_type, kind, experts) for kind in set(kinds)}
    label = {"dense": "dense_layer", "moe": "moe_layer"} if len(tensors) > 1 else {}
    runs = [
        Group(label.get(kind, "layer"), len(list(run)), tuple(tensors[kind]))
        for kind, run in itertools.groupby(kinds)
    ]
    embed = ("embed_tokens.weight", (vocab, hidden))
    norm = ("norm.weight", (hidden,))
    if c.flag("tie_word_embeddings", False):
        groups = [Group("root", 1, (embed, norm), root=True), *runs]
    else:
        head = ("lm_head.weight", (vocab, hidden))
        groups = [Group("embed", 1, (embed,)), *runs, Group("head", 1, (norm, head))]
    moe = f", experts {experts}" if "moe" in kinds else ""
    source = f"Hugging Face config ({model_type}{moe}): {where}"
    return ModelShapes(name or str(cfg.get("_name_or_path") or model_type), source, tuple(groups))


class _Config:
    """Typed access to config keys with errors that name the key, the file and the fix."""

    def __init__(self, cfg: dict[str, Any], where: str) -> None:
        self.cfg, self.where = cfg, where

    def integer(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.cfg.get(key, default)
        if value is None:
            raise PlanError(f"{self.where}: missing {key!r}; add it (a positive integer)")
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise PlanError(f"{self.where}: {key!r} must be an integer >= {minimum}, got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key, default)
        if not isinstance(value, bool):
            raise PlanError(f"{self.where}: {key!r} must be true or false, got {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.cfg.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
            raise PlanError(f"{self.where}: {key!r} must be a list of layer indices")
        return value

    def attention_dims(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head dim), checked for consistency."""
        hidden, heads = self.integer("hidden_size"), self.integer("num_attention_heads")
        kv = self.integer("num_key_value_heads", heads)
        if heads % kv:
            raise PlanError(
                f"{self.where}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv}; grouped-query attention needs it to be"
            )
        if self.cfg.get("head_dim") is None and hidden % heads:
            raise PlanError(
                f"{self.where}: hidden_size={hidden} is not a multiple of "
                f"num_attention_heads={heads}; add 'head_dim'"
            )
        return heads, kv, self.integer("head_dim", hidden // heads)


def _layer_kind(c: _Config, model_type: str, index: int) -> str:
    if model_type == "mixtral":
        return "moe"
    if model_type not in _MOE_TYPES or c.integer("num_experts", 0, minimum=0) == 0:
        return "dense"
    step = c.integer("decoder_sparse_step", 1)
    sparse = index not in c.int_list("mlp_only_layers") and (index + 1) % step == 0
    return "moe" if sparse else "dense"


def _layer(c: _Config, model_type: str, kind: str, experts: str) -> Tensors:
    hidden = c.integer("hidden_size")
    heads, kv, head_dim = c.attention_dims()
    qwen2 = model_type.startswith("qwen2")
    qkv_bias = qwen2 or c.flag("attention_bias", False)
    o_bias = not qwen2 and c.flag("attention_bias", False)
    t: Tensors = [("input_layernorm.weight", (hidden,))]
    for proj, rows, bias in (
        ("q", heads * head_dim, qkv_bias),
        ("k", kv * head_dim, qkv_bias),
        ("v", kv * head_dim, qkv_bias),
        ("o", hidden, o_bias),
    ):
        cols = heads * head_dim if proj == "o" else hidden
        t.append((f"self_attn.{proj}_proj.weight", (rows, cols)))
        if bias:
            t.append((f"self_attn.{proj}_proj.bias", (rows,)))
    if model_type.startswith("qwen3"):
        t += [("self_attn.q_norm.weight", (head_dim,)), ("self_attn.k_norm.weight", (head_dim,))]
    t.append(("post_attention_layernorm.weight", (hidden,)))
    if kind == "dense":
        return t + _mlp(c, "mlp", hidden, c.integer("intermediate_size"))
    n_experts = c.integer("num_local_experts" if model_type == "mixtral" else "num_experts")
    ffn = c.integer("intermediate_size" if model_type == "mixtral" else "moe_intermediate_size")
    t.append(("mlp.gate.weight", (n_experts, hidden)))
    if experts == "fused":
        t += [
            ("mlp.experts.gate_up_proj", (n_experts, 2 * ffn, hidden)),
            ("mlp.experts.down_proj", (n_experts, hidden, ffn)),
        ]
    else:
        for e in range(n_experts):
            t += _mlp(c, f"mlp.experts.{e}", hidden, ffn)
    if model_type == "qwen2_moe":
        shared = c.integer("shared_expert_intermediate_size")
        t += _mlp(c, "mlp.shared_expert", hidden, shared)
        t.append(("mlp.shared_expert_gate.weight", (1, hidden)))
    return t


def _mlp(c: _Config, prefix: str, hidden: int, ffn: int) -> Tensors:
    t: Tensors = []
    bias = c.flag("mlp_bias", False)
    for proj, shape in (("gate", (ffn, hidden)), ("up", (ffn, hidden)), ("down", (hidden, ffn))):
        t.append((f"{prefix}.{proj}_proj.weight", shape))
        if bias:
            t.append((f"{prefix}.{proj}_proj.bias", (shape[0],)))
    return t
