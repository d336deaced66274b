"""The tensors of one decoder layer of a Hugging Face family, as ``transformers`` names them.

Shapes are those of the modules (``nn.Linear`` weights are ``(out, in)``). MoE experts come one
module per expert (``transformers``' layout) or *fused* into stacked ``(E, 2F, H)`` /
``(E, H, F)`` tensors, as grouped-GEMM kernels want them.
"""

from __future__ import annotations

from raggedfsdp.capacity.hf_families import Family
from raggedfsdp.capacity.hf_keys import ConfigKeys
from raggedfsdp.capacity.model_shapes import Shape

__all__ = ["Tensors", "decoder_layer", "layer_kind"]

Tensors = list[tuple[str, Shape]]


def layer_kind(c: ConfigKeys, family: Family, index: int) -> str:
    """``"moe"`` or ``"dense"`` for layer ``index``, by each family's own rule."""
    if family.moe == "mixtral":
        return "moe"
    if family.moe == "qwen" and c.integer("num_experts", 0, minimum=0) > 0:
        step = c.integer("decoder_sparse_step", 1)
        sparse = index not in c.int_list("mlp_only_layers") and (index + 1) % step == 0
        return "moe" if sparse else "dense"
    if family.moe == "deepseek" and c.get("n_routed_experts") is not None:
        first_dense = c.integer("first_k_dense_replace", 0, minimum=0)
        sparse = index >= first_dense and index % c.integer("moe_layer_freq", 1) == 0
        return "moe" if sparse else "dense"
    return "dense"


def decoder_layer(c: ConfigKeys, family: Family, kind: str, experts: str) -> Tensors:
    hidden = c.integer("hidden_size")
    t: Tensors = [("input_layernorm.weight", (hidden,))]
    t += _mla(c) if family.mla else _attention(c, family)
    t.append(("post_attention_layernorm.weight", (hidden,)))
    if family.sandwich:
        t.append(("pre_feedforward_layernorm.weight", (hidden,)))
    if kind == "dense":
        t += _mlp(c, "mlp", hidden, c.integer("intermediate_size"), family.fused)
    else:
        t += _moe(c, family, hidden, experts)
    if family.sandwich:
        t.append(("post_feedforward_layernorm.weight", (hidden,)))
    return t


def _attention(c: ConfigKeys, family: Family) -> Tensors:
    hidden = c.integer("hidden_size")
    heads, kv, head_dim = c.attention_dims()
    q_rows, kv_rows = heads * head_dim, kv * head_dim
    if family.fused:
        return [
            ("self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, hidden)),
            ("self_attn.o_proj.weight", (hidden, q_rows)),
        ]
    bias = c.flag("attention_bias", False)
    qkv_bias, o_bias = (True, False) if family.qkv_bias else (bias, bias)
    t: Tensors = []
    for proj, shape, has_bias in (
        ("q", (q_rows, hidden), qkv_bias),
        ("k", (kv_rows, hidden), qkv_bias),
        ("v", (kv_rows, hidden), qkv_bias),
        ("o", (hidden, q_rows), o_bias),
    ):
        t += _linear(f"self_attn.{proj}_proj", *shape, has_bias)
    if family.qk_norm:
        t += [("self_attn.q_norm.weight", (head_dim,)), ("self_attn.k_norm.weight", (head_dim,))]
    return t


def _mla(c: ConfigKeys) -> Tensors:
    """DeepSeek-V2/V3 attention: queries through a low-rank ``q_lora_rank`` bottleneck (or one
    ``q_proj`` without it), keys and values from a ``kv_lora_rank`` latent plus a shared rotary
    key. ``attention_bias`` adds biases to the down projections and ``o_proj``."""
    hidden, heads = c.integer("hidden_size"), c.integer("num_attention_heads")
    nope, rope = c.integer("qk_nope_head_dim"), c.integer("qk_rope_head_dim")
    v_dim, kv_rank = c.integer("v_head_dim"), c.integer("kv_lora_rank")
    q_rank = c.optional_integer("q_lora_rank")
    bias = c.flag("attention_bias", False)
    q_rows = heads * (nope + rope)
    if q_rank is None:
        t = _linear("self_attn.q_proj", q_rows, hidden)
    else:
        t = _linear("self_attn.q_a_proj", q_rank, hidden, bias)
        t.append(("self_attn.q_a_layernorm.weight", (q_rank,)))
        t += _linear("self_attn.q_b_proj", q_rows, q_rank)
    t += _linear("self_attn.kv_a_proj_with_mqa", kv_rank + rope, hidden, bias)
    t.append(("self_attn.kv_a_layernorm.weight", (kv_rank,)))
    t += _linear("self_attn.kv_b_proj", heads * (nope + v_dim), kv_rank)
    t += _linear("self_attn.o_proj", hidden, heads * v_dim, bias)
    return t


def _moe(c: ConfigKeys, family: Family, hidden: int, experts: str) -> Tensors:
    if family.moe == "mixtral":
        n, ffn = c.integer("num_local_experts"), c.integer("intermediate_size")
    elif family.moe == "qwen":
        n, ffn = c.integer("num_experts"), c.integer("moe_intermediate_size")
    else:
        n, ffn = c.integer("n_routed_experts"), c.integer("moe_intermediate_size")
    t: Tensors = [("mlp.gate.weight", (n, hidden))]
    if family.router_bias and c.get("topk_method", "noaux_tc") == "noaux_tc":
        t.append(("mlp.gate.e_score_correction_bias", (n,)))
    if experts == "fused":
        t += [
            ("mlp.experts.gate_up_proj", (n, 2 * ffn, hidden)),
            ("mlp.experts.down_proj", (n, hidden, ffn)),
        ]
    else:
        for e in range(n):
            t += _mlp(c, f"mlp.experts.{e}", hidden, ffn)
    if family.shared_expert:
        t += _mlp(c, "mlp.shared_expert", hidden, c.integer("shared_expert_intermediate_size"))
        t.append(("mlp.shared_expert_gate.weight", (1, hidden)))
    if family.moe == "deepseek" and c.get("n_shared_experts") is not None:
        shared = c.integer("n_shared_experts") * ffn
        t += _mlp(c, "mlp.shared_experts", hidden, shared)
    return t


def _mlp(c: ConfigKeys, prefix: str, hidden: int, ffn: int, fused: bool = False) -> Tensors:
    if fused:
        return [
            (f"{prefix}.gate_up_proj.weight", (2 * ffn, hidden)),
            (f"{prefix}.down_proj.weight", (hidden, ffn)),
        ]
    t: Tensors = []
    bias = c.flag("mlp_bias", False)
    for proj, shape in (("gate", (ffn, hidden)), ("up", (ffn, hidden)), ("down", (hidden, ffn))):
        t += _linear(f"{prefix}.{proj}_proj", *shape, bias)
    return t


def _linear(name: str, rows: int, cols: int, bias: bool = False) -> Tensors:
    """An ``nn.Linear(cols, rows)`` named ``name``: its weight, then its bias if it has one."""
    weight = (f"{name}.weight", (rows, cols))
    return [weight, (f"{name}.bias", (rows,))] if bias else [weight]
