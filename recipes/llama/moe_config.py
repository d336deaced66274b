"""Shape of the Mixture-of-Experts decoder and its presets (no torch: checked before any work).

A MoE model is the LLaMA decoder with the SwiGLU of each block past ``n_dense_layers``
replaced by ``n_experts`` SwiGLU experts, of which a router picks ``top_k`` per token, plus
``n_shared_experts`` experts every token goes through. Presets are named shapes; a typo in a
name is refused with the closest names, before any process-group work.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Annotated, Literal

from recipes.llama.config import ConfigError, ModelConfig

__all__ = ["MOE_PRESETS", "MoEConfig", "moe_preset"]


@dataclass
class MoEConfig(ModelConfig):
    """The LLaMA shape plus the experts (DeepSeek-V3 / Mixtral naming)."""

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
