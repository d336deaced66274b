"""Parameter shapes from a Hugging Face ``config.json`` (the families of ``hf_families``).

Users deciding how many GPUs to rent have a config, not a shapes file. The shapes are those of
the ``transformers`` modules, grouped the way FSDP wraps a decoder: the embedding, one group per
decoder layer (identical consecutive layers become one group with a repeat count) and the head.
With tied embeddings (``tie_word_embeddings``, or the family's default when the key is absent)
the shared weight cannot live in two groups, so it goes to the root group (with the final norm),
which stays unsharded through forward and backward.

Other architectures are refused with the supported list and a pointer to a shapes file, rather
than planned with made-up shapes; so are multimodal wrappers (a ``text_config`` inside), whose
vision towers the planner does not model.
"""

from __future__ import annotations

import itertools
from typing import Any

from raggedfsdp.capacity.hf_families import FAMILIES, Family
from raggedfsdp.capacity.hf_keys import ConfigKeys
from raggedfsdp.capacity.hf_layers import decoder_layer, layer_kind
from raggedfsdp.capacity.model_shapes import Group, ModelShapes, PlanError

__all__ = ["EXPERT_LAYOUTS", "SUPPORTED_MODEL_TYPES", "is_hf_config", "shapes_from_hf_config"]

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
EXPERT_LAYOUTS = ("per-expert", "fused")


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
    family = _family(cfg, where)
    c = ConfigKeys(cfg, where)
    hidden, vocab = c.integer("hidden_size"), c.integer("vocab_size")
    kinds = [layer_kind(c, family, i) for i in range(c.integer("num_hidden_layers"))]
    tensors = {kind: decoder_layer(c, family, kind, experts) for kind in set(kinds)}
    label = {"dense": "dense_layer", "moe": "moe_layer"} if len(tensors) > 1 else {}
    runs = [
        Group(label.get(kind, "layer"), len(list(run)), tuple(tensors[kind]))
        for kind, run in itertools.groupby(kinds)
    ]
    embed = ("embed_tokens.weight", (vocab, hidden))
    norm = ("norm.weight", (hidden,))
    if c.flag("tie_word_embeddings", family.tied):
        groups = [Group("root", 1, (embed, norm), root=True), *runs]
    else:
        head = ("lm_head.weight", (vocab, hidden))
        groups = [Group("embed", 1, (embed,)), *runs, Group("head", 1, (norm, head))]
    moe = f", experts {experts}" if "moe" in kinds else ""
    source = f"Hugging Face config ({model_type}{moe}): {where}"
    return ModelShapes(name or str(cfg.get("_name_or_path") or model_type), source, tuple(groups))


def _family(cfg: dict[str, Any], where: str) -> Family:
    """The family of ``model_type``, or an error that names it and says what to do instead."""
    model_type = cfg.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    shapes_file = (
        "write a shapes file in raggedfsdp/data/model_shapes.json's format and pass its path"
    )
    if model_type is None:
        raise PlanError(f"{where}: missing 'model_type'; add it (one of: {supported})")
    text = cfg.get("text_config")
    if isinstance(text, dict):
        raise PlanError(
            f"{where}: model_type {model_type!r} is a multimodal wrapper (a 'text_config' of "
            f"model_type {text.get('model_type')!r} plus other towers), which the planner does "
            f"not model; {shapes_file} for the whole model, or plan the text model alone from "
            f"'text_config' saved as its own config.json (supported: {supported})"
        )
    raise PlanError(
        f"{where}: model_type {model_type!r} is not supported; supported: {supported}. "
        f"For another architecture {shapes_file} instead"
    )
