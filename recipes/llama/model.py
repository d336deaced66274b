"""A LLaMA-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Parameter names follow Meta's Llama code (``tok_embeddings``, ``layers.N.attention.wq``, ...) so
shapes line up with ``raggedfsdp/data/model_shapes.json`` and public checkpoints. The blocks live
in ``layers`` so the recipe can wrap each one with ``fully_shard`` (one communication group per
block), then the root (embeddings, final norm, output head). Q, K, V and the SwiGLU
projections are separate matrices, so Muon orthogonalises each one on its own.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from recipes.llama.model_config import ModelConfig

__all__ = ["Transformer", "flops_per_token", "init_parameter", "matmul_params"]


class RMSNorm(nn.Module):
    """Normalises in fp32 whatever the compute dtype (as Llama does), then scales."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_table(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """``(seq_len, head_dim // 2)`` unit complex numbers: each position's rotation per pair of
    channels. Complex on purpose: mixed-precision input casting (raggedfsdp's and FSDP2's)
    touches floating-point tensors only, so the table stays exact when blocks run in bf16."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs of ``x`` (batch, seq, heads, head_dim), in fp32."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * table[: x.shape[1], None, :]).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with ``n_kv_heads`` key/value heads shared by groups of queries."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism the projections hold this rank's heads (torchtitan)
        q = apply_rope(self.wq(x).view(b, t, -1, self.head_dim), rope)
        k = apply_rope(self.wk(x).view(b, t, -1, self.head_dim), rope)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: attention, then SwiGLU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``.

    Args:
        cfg: the shape.
        seq_len: longest sequence (size of the RoPE table, a buffer not saved in checkpoints).
        activation_checkpointing: recompute each block in backward instead of keeping its
            activations (memory for about one more forward).
    """

    def __init__(
        self, cfg: ModelConfig, seq_len: int, activation_checkpointing: bool = False
    ) -> None:
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.activation_checkpointing = activation_checkpointing
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(self.make_block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer(
            "rope", rope_table(cfg.head_dim, seq_len, cfg.rope_theta), persistent=False
        )

    def make_block(self, cfg: ModelConfig, index: int) -> nn.Module:
        """Block ``index``; a model family with other blocks (the MoE one) overrides this."""
        return Block(cfg)

    def init_weights(self, seed: int) -> None:
        """Initialise every parameter (see ``init_parameter``)."""
        for name, param in self.named_parameters():
            init_parameter(name, param, seed, self.cfg.n_layers)

    def materialize_block(self, index: int, device: torch.device, seed: int) -> None:
        """Allocate block ``index`` of a model built on the meta device on ``device`` and
        initialise it, so a large model is never whole in one process's memory: the recipe
        materializes and shards one block at a time."""
        block = self.layers[index]
        block.to_empty(device=device)
        for name, param in block.named_parameters(prefix=f"layers.{index}"):
            init_parameter(name, param, seed, self.cfg.n_layers)

    def materialize_root(self, device: torch.device, seed: int) -> None:
        """Like ``materialize_block`` for the embeddings, final norm and head (re-tying the
        head to the embedding when they are tied) and the RoPE table."""
        parts = [self.tok_embeddings, self.norm]
        parts += [] if self.cfg.tie_embeddings else [self.output]
        for part in parts:
            part.to_empty(device=device)
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        for name, param in self.named_parameters():
            if not name.startswith("layers."):
                init_parameter(name, param, seed, self.cfg.n_layers)
        self.rope = rope_table(self.cfg.head_dim, self.rope.shape[0], self.cfg.rope_theta).to(
            device
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(block, h, self.rope, use_reentrant=False)
            else:
                h = block(h, self.rope)
        return self.output(self.norm(h))


@torch.no_grad()
def init_parameter(name: str, param: torch.Tensor, seed: int, n_layers: int) -> None:
    """Normal(0, 0.02) matrices, the residual outputs (``wo``, ``w2``, MoE ``experts.w2``) scaled by
    1/sqrt(2·n_layers) (GPT-2), unit norm weights. Each parameter draws from its own generator
    seeded by ``seed`` and its name, so the weights do not depend on the device, the order of
    initialisation or the world size, and every rank gets the same ones, as sharding requires."""
    if param.ndim == 1:
        param.fill_(1.0)
        return
    gen = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    residual = name.endswith(("wo.weight", "w2.weight", "experts.w2"))
    std = 0.02 / (2 * n_layers) ** 0.5 if residual else 0.02
    param.copy_(torch.randn(param.shape, generator=gen) * std)


def matmul_params(model: nn.Module) -> int:
    """Parameters used in matrix multiplies: all but the input embedding (a lookup), unless it
    is tied to the output head. Counted once per tensor (a tied weight is one)."""
    total = sum(p.numel() for p in model.parameters())
    tied = model.output.weight is model.tok_embeddings.weight
    return total if tied else total - model.tok_embeddings.weight.numel()


def flops_per_token(cfg: ModelConfig, n_matmul_params: int, seq_len: int) -> int:
    """Training FLOPs per token (PaLM appendix B, torchtitan): ``6N + 12·L·H·Q·T``, i.e.
    forward + backward of the matmuls plus attention scores and values at full (non-causal)
    length. N counts the weights a token goes through: for a MoE model, the routed experts it
    is not sent to (``cfg.inactive_expert_params``) are left out, so N is top_k routed experts
    plus the shared ones, the router and the rest."""
    active = n_matmul_params - cfg.inactive_expert_params
    return 6 * active + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
