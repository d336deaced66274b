"""A tiny Llama (torchtitan's module names) and torchtitan's tensor-parallel plan for it, for the
``fully_shard`` x TP tests and the example: wq/wk/wv and w1/w3 colwise, wo and w2 rowwise,
norms sequence-parallel, the embedding rowwise and the head colwise (replicated logits)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VOCAB, DIM, HEADS, HIDDEN, SEQ = 32, 16, 4, 32, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        head_dim = DIM // HEADS
        # -1 heads: this TP rank's heads (colwise outputs are local tensors), as torchtitan
        q, k, v = (
            w(x).view(b, t, -1, head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def make_llama(seed: int = 0, layers: int = 2, dtype: torch.dtype = torch.float32) -> Llama:
    torch.manual_seed(seed)
    model = Llama(layers).to(dtype)
    with torch.no_grad():  # norm weights off 1, so their gradients and updates show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def parallelize_llama(model: Llama, tp_mesh: DeviceMesh) -> Llama:
    """torchtitan's ``apply_tp`` (without loss parallel): sequence-parallel activations between
    the blocks, replicated logits."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
    return model


def llama_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``, the same on every rank (ranks take their dp rows)."""
    gen = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def llama_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    logits = logits.reshape(-1, VOCAB)  # bf16 logits in fp32, fp64 ones as they are
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets.reshape(-1))


def tp_meshes(dims: tuple[int, ...]) -> tuple[DeviceMesh, DeviceMesh, int, int]:
    """(TP mesh, data-parallel mesh for fully_shard, this rank's dp index, dp size) of a 2-D
    ``(dp_shard, tp)`` or 3-D ``(dp_replicate, dp_shard, tp)`` CPU mesh of shape ``dims``."""
    if len(dims) == 2:
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("dp_shard", "tp"))
        dp = mesh["dp_shard"]
        return mesh["tp"], dp, dp.get_local_rank(), dims[0]
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    dp = mesh["dp_replicate", "dp_shard"]
    index = dp.get_local_rank(0) * dims[1] + dp.get_local_rank(1)
    return mesh["tp"], dp, index, dims[0] * dims[1]


def wrapped_llama(
    dims: tuple[int, ...], wrap, dtype: torch.dtype = torch.float32, **kwargs
) -> tuple[Llama, int, int]:
    """``make_llama`` (in ``dtype``) with torchtitan's TP plan, each block and the root wrapped
    by ``wrap`` (``raggedfsdp.fully_shard`` or FSDP2's) over the data-parallel mesh; (model, dp
    index, dp size)."""
    tp_mesh, dp_mesh, index, size = tp_meshes(dims)
    model = parallelize_llama(make_llama(dtype=dtype), tp_mesh)
    for block in model.layers:
        wrap(block, mesh=dp_mesh, **kwargs)
    wrap(model, mesh=dp_mesh, **kwargs)
    return model, index, size
