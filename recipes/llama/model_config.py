"""Shapes of the recipe's two model families (no torch: checked before any work).

``ModelConfig`` is the dense LLaMA decoder; ``MoEConfig`` is the same decoder with the SwiGLU of
each block past ``n_dense_layers`` replaced by ``n_experts`` SwiGLU experts, of which a router
picks ``top_k`` per token, plus ``n_shared_experts`` experts every token goes through. Both live
here, below ``config.py`` (which reads their fields as ``--model.<name>`` keys) and
``moe_config.py`` (the MoE presets), so neither of those imports the other's module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

__all__ = ["ConfigError", "MoEConfig", "ModelConfig"]


class ConfigError(ValueError):
    """A config file or command line that cannot be applied (the message says what to fix)."""


@dataclass
class ModelConfig:
    """Shape of the LLaMA-style decoder (Llama-3 naming and FFN sizing rule)."""

    dim: Annotated[int, "model width"] = 128
    n_layers: Annotated[int, "transformer blocks"] = 4
    n_heads: Annotated[int, "query heads"] = 4
    n_kv_heads: Annotated[int, "key/value heads (grouped-query attention; = n_heads for MHA)"] = 2
    vocab_size: Annotated[int, "vocabulary size (>= the tokenizer's; 256 for bytes)"] = 256
    ffn_dim_multiplier: Annotated[float, "SwiGLU width multiplier on 8/3·dim (Llama-3: 1.3)"] = 1.0
    multiple_of: Annotated[int, "SwiGLU width is rounded up to a multiple of this"] = 32
    norm_eps: Annotated[float, "RMSNorm epsilon"] = 1e-5
    rope_theta: Annotated[float, "RoPE base (Llama-3: 500000)"] = 10000.0
    tie_embeddings: Annotated[bool, "share the input embedding with the output head"] = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        """Llama-3's rule: 2/3 of 4·dim, times the multiplier, rounded up to ``multiple_of``."""
        hidden = int(self.ffn_dim_multiplier * int(2 * 4 * self.dim / 3))
        return self.multiple_of * -(-hidden // self.multiple_of)

    @property
    def inactive_expert_params(self) -> int:
        """Weights a token does not go through (MoE routed experts it is not sent to): none."""
        return 0

    def heads_split_dim(self) -> bool:
        """Whether the heads split ``dim`` (head_dim = dim / n_heads), so ``dim`` must divide."""
        return True

    def check(self) -> None:
        if self.heads_split_dim() and self.dim % self.n_heads:
            raise ConfigError(f"model.dim={self.dim} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")


@dataclass
class MoEConfig(ModelConfig):
    """The LLaMA shape plus the experts (DeepSeek-V3 / Mixtral naming), and two width knobs the
    real MoE models need: a head width that is not ``dim / n_heads`` (Qwen3, GPT-OSS) and a dense
    SwiGLU width that is not Llama's rule (DeepSeek-V3's first blocks)."""

    n_experts: Annotated[int, "routed experts per MoE block (E)"] = 6
    top_k: Annotated[int, "routed experts each token goes through"] = 2
    moe_hidden: Annotated[int, "hidden width of one expert's SwiGLU (d_ff)"] = 128
    n_shared_experts: Annotated[int, "experts every token goes through (fused into one)"] = 0
    n_dense_layers: Annotated[int, "leading blocks with a dense SwiGLU instead of experts"] = 0
    score_func: Annotated[Literal["softmax", "sigmoid"], "router affinity"] = "softmax"
    bias_update_rate: Annotated[float, "auxiliary-loss-free balancing step (0: off)"] = 1e-3
    expert_impl: Annotated[
        Literal["auto", "grouped_mm", "loop"], "auto: grouped_mm on CUDA, a loop elsewhere"
    ] = "auto"
    attention_head_dim: Annotated[int, "width of one attention head (0: dim / n_heads)"] = 0
    dense_hidden: Annotated[int, "hidden width of the dense blocks' SwiGLU (0: Llama's rule)"] = 0

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return self.dense_hidden or super().ffn_hidden

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def inactive_expert_params(self) -> int:
        """Routed-expert weights a token does *not* go through (``E - top_k`` experts in each
        MoE block): what FLOPs per token leave out of the parameter count."""
        per_expert = 3 * self.dim * self.moe_hidden
        return self.n_moe_layers * (self.n_experts - self.top_k) * per_expert

    def heads_split_dim(self) -> bool:
        return not self.attention_head_dim

    def check(self) -> None:
        super().check()
        if self.n_experts < 1:
            raise ConfigError(f"model.n_experts={self.n_experts} must be >= 1")
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(
                f"model.top_k={self.top_k} must be in [1, n_experts={self.n_experts}]: "
                f"lower top_k or add experts"
            )
        if self.moe_hidden < 1 or self.n_shared_experts < 0:
            raise ConfigError("model.moe_hidden must be >= 1 and n_shared_experts >= 0")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(
                f"model.n_dense_layers={self.n_dense_layers} must be in [0, "
                f"n_layers={self.n_layers}]"
            )
        if self.bias_update_rate < 0:
            raise ConfigError(f"model.bias_update_rate={self.bias_update_rate} must be >= 0")
        if self.attention_head_dim < 0 or self.dense_hidden < 0:
            raise ConfigError("model.attention_head_dim and dense_hidden must be >= 0 (0: derived)")
