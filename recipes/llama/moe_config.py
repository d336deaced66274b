"""The Mixture-of-Experts presets (no torch: checked before any work).

``MoEConfig`` (defined in ``model_config.py``, re-exported here) is the LLaMA decoder with
routed experts. Presets are named shapes: ``--config NAME`` on the recipe's command line, or
``moe_preset(NAME)``; a typo in a name is refused with the closest names, before any
process-group work. The real shapes build on the meta device and their parameter counts are
checked against ``raggedfsdp/data/model_shapes.json`` (tests/recipes/test_moe_presets.py):
exactly where the architecture is the one modelled here, part by part where it is not (each
preset's comment says what is not modelled).
"""

from __future__ import annotations

import dataclasses
import difflib

from recipes.llama.model_config import ConfigError, MoEConfig

__all__ = ["MOE_PRESETS", "MoEConfig", "moe_preset"]


MOE_PRESETS: dict[str, MoEConfig] = {
    # CPU-sized. E=6 so that W=4 does not divide the experts: an even dim-0 split then pads and
    # cuts through expert matrices, the case expert-aware sharding exists for.
    "moe_tiny": MoEConfig(
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        n_experts=6,
        top_k=2,
        moe_hidden=48,
        n_shared_experts=1,
        n_dense_layers=1,
    ),
    # Mixtral-8x7B (public config): 46,702,792,704 parameters.
    "mixtral_8x7b": MoEConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        rope_theta=1e6,
        n_experts=8,
        top_k=2,
        moe_hidden=14336,
    ),
    # Qwen3-30B-A3B (public config): every parameter as published except QK-norm (the two
    # 128-wide RMSNorms per block on queries and keys, 12,288 parameters), not modelled.
    "qwen3_30b_a3b": MoEConfig(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        attention_head_dim=128,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1e6,
        n_experts=128,
        top_k=8,
        moe_hidden=768,
    ),
    # DeepSeek-V3 (public config, without the multi-token-prediction module): embeddings, head,
    # norms, the 3 dense blocks' SwiGLU, routers, the 256 routed and the shared expert of the 58
    # MoE blocks as published, and the sigmoid router with its bias (DeepSeek's
    # e_score_correction_bias is our expert_bias buffer). Not modelled: multi-head latent
    # attention (this preset has plain 128-head attention in its place), node-limited (group)
    # routing and the routed-output scale of 2.5.
    "deepseek_v3": MoEConfig(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        vocab_size=129280,
        norm_eps=1e-6,
        n_experts=256,
        top_k=8,
        moe_hidden=2048,
        n_shared_experts=1,
        n_dense_layers=3,
        dense_hidden=18432,
        score_func="sigmoid",
    ),
    # GPT-OSS-120B (public config): attention, router and expert weights as published (the
    # fused gate_up_proj is our w1 and w3). Not modelled: the biases of attention, router and
    # experts, the attention sinks, sliding-window layers and the clamped SwiGLU.
    "gpt_oss_120b": MoEConfig(
        dim=2880,
        n_layers=36,
        n_heads=64,
        n_kv_heads=8,
        attention_head_dim=64,
        vocab_size=201088,
        rope_theta=150000.0,
        n_experts=128,
        top_k=4,
        moe_hidden=2880,
    ),
}


def moe_preset(name: str, **overrides: object) -> MoEConfig:
    """A copy of preset ``name`` with ``overrides`` applied, checked."""
    if name not in MOE_PRESETS:
        close = difflib.get_close_matches(name, MOE_PRESETS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"no MoE preset {name!r}; {hint}presets: {', '.join(MOE_PRESETS)}")
    cfg = dataclasses.replace(MOE_PRESETS[name], **overrides)
    cfg.check()
    return cfg
