"""What sets the decoder families of ``config.json``'s ``model_type`` apart, as data.

The families share one skeleton (embedding, decoder layers of attention + MLP, final norm,
head), so each is a handful of switches over it rather than its own parser; the switches are
the ones that change a tensor's shape or add a tensor. Keys that change no shape (sliding
windows, rope scaling, soft-capping, ``torch_dtype``) are not read at all.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "MOE_KINDS", "Family"]

MOE_KINDS = ("mixtral", "qwen", "deepseek")


@dataclass(frozen=True)
class Family:
    """One ``model_type``'s layout.

    Attributes:
        tied: ``tie_word_embeddings`` when the config leaves it out (the config class's default).
        qkv_bias: q/k/v biases always (Qwen2), not only with ``attention_bias``; then ``o_proj``
            has none.
        qk_norm: per-head RMSNorms of queries and keys (Qwen3, Gemma-3).
        fused: one ``qkv_proj`` and one ``gate_up_proj`` (Phi-3), neither with a bias.
        sandwich: norms before and after the MLP as well (Gemma-2, Gemma-3).
        mla: DeepSeek's multi-head latent attention (low-rank q and compressed kv).
        moe: which MoE layout sparse layers take (``MOE_KINDS``), ``None`` for dense families.
        shared_expert: Qwen2-MoE's gated shared expert beside the routed ones (its
            ``shared_expert_intermediate_size``); Qwen3-MoE dropped it, so its configs lack the key.
        router_bias: the router's ``e_score_correction_bias`` (DeepSeek-V3's aux-loss-free load
            balancing; the checkpoints carry it), unless ``topk_method`` names another router.
    """

    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    fused: bool = False
    sandwich: bool = False
    mla: bool = False
    moe: str | None = None
    shared_expert: bool = False
    router_bias: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "mixtral": Family(moe="mixtral"),
    "qwen2": Family(qkv_bias=True),
    "qwen2_moe": Family(qkv_bias=True, moe="qwen", shared_expert=True),
    "qwen3": Family(qk_norm=True),
    "qwen3_moe": Family(qk_norm=True, moe="qwen"),
    "gemma": Family(tied=True),
    "gemma2": Family(tied=True, sandwich=True),
    "gemma3_text": Family(tied=True, sandwich=True, qk_norm=True),
    "phi3": Family(fused=True),
    "deepseek_v2": Family(mla=True, moe="deepseek"),
    "deepseek_v3": Family(mla=True, moe="deepseek", router_bias=True),
}
