"""A Mixture-of-Experts decoder: the LLaMA blocks with routed SwiGLU experts.

Attention, norms, RoPE and the dense SwiGLU are the LLaMA recipe's (``recipes.llama.model``);
what is new here is the feed-forward of the MoE blocks:

* **Fused experts.** All routed experts of a block are three parameters, ``experts.w1`` and
  ``experts.w3`` of shape ``(E, d_ff, d)`` and ``experts.w2`` of shape ``(E, d, d_ff)`` (as
  GPT-OSS, DeepSeek-V3 and torchtitan store them), so a shard policy sees whole experts as
  slices of dim 0 and Muon orthogonalises each ``(d_ff, d)`` expert matrix on its own.
* **Router.** ``router.weight`` ``(E, d)`` scores each token (softmax, as Mixtral, or sigmoid,
  as DeepSeek-V3); each token goes to its ``top_k`` experts, weighted by its scores of those
  experts renormalised to sum to one.
* **Balancing without an auxiliary loss** (DeepSeek-V3, arXiv:2412.19437 §2.1.2). A per-expert
  bias, a buffer not trained by the optimizer, is added to the scores only to *choose* the
  top-k experts, never to weight their outputs. After each optimizer step ``balance_routers``
  moves every bias by ``bias_update_rate`` towards balance: down for an expert that got more
  than the mean number of tokens since the last update, up for one that got fewer. The loss
  is the language-model loss alone, so balancing does not pull on the gradients.
* **Shared experts** (DeepSeek-V3): ``n_shared_experts`` experts every token goes through,
  fused into one dense SwiGLU of width ``n_shared_experts * d_ff``.
* **Expert compute.** ``torch.nn.functional.grouped_mm`` multiplies every expert's tokens in
  one call. It runs on CUDA; on CPU (torch 2.13) forward and backward run in fp32 when the
  incoming gradient is contiguous (an expanded one fails with "Invalid strides/sizes"), which
  ``_ContiguousGrad`` ensures. ``expert_impl="auto"`` uses it on CUDA and a per-expert loop of
  plain matmuls elsewhere; both give the same results (tested on CPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from recipes.llama.expert_parallel import dispatch
from recipes.llama.model import Attention, FeedForward, RMSNorm, Transformer
from recipes.llama.model_config import ModelConfig, MoEConfig
from recipes.llama.tensor_parallel import moe_tp_forward

__all__ = [
    "Experts",
    "MoEBlock",
    "MoEFeedForward",
    "MoETransformer",
    "balance_routers",
    "model_class",
    "router_load",
]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (grouped_mm's CPU backward
    rejects expanded gradients, such as the one ``y.sum()`` sends)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class Experts(nn.Module):
    """``E`` SwiGLU experts stored fused; tokens arrive sorted by expert with ``counts``."""

    def __init__(self, n_experts: int, dim: int, hidden: int, impl: str) -> None:
        super().__init__()
        self.impl = impl
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        impl = self.impl
        if impl == "auto":
            impl = "grouped_mm" if x.is_cuda else "loop"
        if impl == "grouped_mm":
            return self._grouped(x, counts)
        return self._loop(x, counts)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w1, w3, w2)``; under expert parallelism (``Shard(0)`` DTensors over ``ep``) the
        local tensors, this EP rank's experts (``recipes.llama.expert_parallel``)."""
        return tuple(  # type: ignore[return-value]
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2)
        )

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = counts.cumsum(0).to(torch.int32)
        w1, w3, w2 = self.local_weights()

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            out = F.grouped_mm(a, w.transpose(-2, -1).to(a.dtype), offs=offs)
            return _ContiguousGrad.apply(out)

        return mm(F.silu(mm(x, w1)) * mm(x, w3), w2)

    def _loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = []
        weights = self.local_weights()
        for e, rows in enumerate(x.split(counts.tolist())):
            w1, w3, w2 = (w[e].to(x.dtype) for w in weights)
            outs.append((F.silu(rows @ w1.T) * (rows @ w3.T)) @ w2.T)
        return torch.cat(outs)


class MoEFeedForward(nn.Module):
    """Router, routed experts and the optional shared expert of one block (module docstring)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        cfg.check()
        self.n_experts, self.top_k, self.score_func = cfg.n_experts, cfg.top_k, cfg.score_func
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.moe_hidden, cfg.expert_impl)
        hidden = cfg.n_shared_experts * cfg.moe_hidden
        self.shared = FeedForward(cfg.dim, hidden) if hidden else None
        # balancing state: buffers, so fully_shard leaves them whole and checkpoints keep them
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts))
        # --tp (tensor_parallel.apply_tp_to_moe): the TP mesh, and whether this rank counts
        # the tokens (TP ranks route the same ones: counted once)
        self.tp_mesh = None
        self.counts_tokens = True
        self.check_shapes()

    def check_shapes(self) -> None:
        """Refuse router or expert tensors whose expert count is not ``n_experts``."""
        e = self.n_experts
        shapes = {
            "router.weight": self.router.weight.shape[0],
            **{f"experts.{n}": getattr(self.experts, n).shape[0] for n in ("w1", "w2", "w3")},
            "expert_bias": self.expert_bias.shape[0],
        }
        for name, rows in shapes.items():
            if rows != e:
                raise ValueError(
                    f"{name} has {rows} experts in dim 0 but n_experts={e}: "
                    f"rebuild it with n_experts={e} or set n_experts={rows}"
                )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids, weights), each ``(tokens, top_k)``; counts the tokens when training."""
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        ids = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        weights = weights / weights.sum(-1, keepdim=True)
        if self.training and self.counts_tokens:
            self.tokens_per_expert += torch.bincount(ids.flatten(), minlength=self.n_experts)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is not None:  # tensor parallelism
            return moe_tp_forward(self, x)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        out = self.routed(x)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(shape)

    def routed(
        self, x: torch.Tensor, enter: Callable[[torch.Tensor], torch.Tensor] = _same
    ) -> torch.Tensor:
        """The routed experts' weighted sum for the tokens ``x`` ``(tokens, dim)``. ``enter``
        is applied to the rows and the routing weights that meet the experts' outputs: the
        identity, or under TP the one whose backward sums their partial gradients."""
        ids, weights = self.route(x)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.n_experts)
        rows = enter(x[token])
        if getattr(self.experts, "ep_mesh", None) is not None:  # expert parallelism
            routed = dispatch(self.experts, rows, counts)
        else:
            routed = self.experts(rows, counts)
        routed = routed * enter(weights.flatten()[order, None].to(x.dtype))
        return torch.zeros_like(x).index_add_(0, token, routed)


class MoEBlock(nn.Module):
    """The LLaMA pre-norm block with ``MoEFeedForward`` in place of the dense SwiGLU."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoEFeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class MoETransformer(Transformer):
    """The LLaMA ``Transformer`` whose blocks past ``n_dense_layers`` are ``MoEBlock``."""

    cfg: MoEConfig

    def make_block(self, cfg: MoEConfig, index: int) -> nn.Module:  # type: ignore[override]
        return super().make_block(cfg, index) if index < cfg.n_dense_layers else MoEBlock(cfg)

    def check_shapes(self) -> None:
        """Every MoE block's router and experts agree with ``n_experts``: call it before
        sharding, so a model edited or loaded with another expert count fails in one line
        instead of inside a collective."""
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.check_shapes()

    def materialize_block(self, index: int, device: torch.device, seed: int) -> None:
        """As the LLaMA model's, then zero the balancing buffers (``to_empty`` left them
        uninitialised)."""
        super().materialize_block(index, device, seed)
        for module in self.layers[index].modules():
            if isinstance(module, MoEFeedForward):
                module.expert_bias.zero_()
                module.tokens_per_expert.zero_()


def router_load(model: nn.Module) -> dict[str, torch.Tensor]:
    """Tokens each MoE block sent to each expert since the last ``balance_routers``. With
    activation checkpointing the recomputed forward counts again, so every count doubles;
    balancing looks only at which side of the mean a count is, so it is unaffected."""
    return {
        name: module.tokens_per_expert.clone()
        for name, module in model.named_modules()
        if isinstance(module, MoEFeedForward)
    }


@torch.no_grad()
def balance_routers(
    model: nn.Module, rate: float, group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's bias update, after an optimizer step: each expert's bias moves by ``rate``
    towards the mean load, then the counts restart. With a process group initialised, the
    counts of every MoE block are summed over ``group`` first (one all-reduce for all blocks),
    so every rank applies the same update and the biases, buffers no optimizer touches, stay
    equal across ranks. Returns the loads it balanced on (block name -> tokens per expert,
    summed over ``group``), for the run's metrics."""
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, MoEFeedForward)}
    if not blocks:
        return {}
    counts = [m.tokens_per_expert for m in blocks.values()]
    loads = torch.cat(counts)
    if dist.is_initialized():
        dist.all_reduce(loads, group=group)
    result = dict(zip(blocks, loads.split([c.numel() for c in counts]), strict=True))
    for name, module in blocks.items():
        load = result[name]
        module.expert_bias += rate * torch.sign(load.mean() - load)
        module.tokens_per_expert.zero_()
    return result


def model_class(cfg: ModelConfig) -> type[Transformer]:
    """The model family a shape belongs to: ``MoETransformer`` for a ``MoEConfig``."""
    return MoETransformer if isinstance(cfg, MoEConfig) else Transformer
