"""Built-in presets given as Hugging Face configs (the architecture keys of public
``config.json`` files), to cover what ``model_shapes.json`` does not: fused vs per-expert MoE
(Mixtral), a wide dense model with QKV biases (Qwen2-72B), shared experts (Qwen1.5-MoE) and
tied embeddings (Llama-3.2-1B). Their shapes come from :mod:`raggedfsdp.capacity.hf_config`, so
the presets also exercise the config parser."""

from __future__ import annotations

from typing import Any

__all__ = ["HF_PRESETS"]

HF_PRESETS: dict[str, dict[str, Any]] = {
    "llama3.2-1b": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
    },
    "mistral-7b": {
        "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "tie_word_embeddings": False,
    },
    "mixtral-8x7b": {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    "qwen2-72b": {
        "model_type": "qwen2", "hidden_size": 8192, "intermediate_size": 29568,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 152064, "tie_word_embeddings": False,
    },
    "qwen1.5-moe-a2.7b": {
        "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "vocab_size": 151936, "tie_word_embeddings": False,
    },
}  # fmt: skip
