"""``fully_shard`` x tensor parallelism on a 2-D mesh, torchtitan's way, on a small Llama.

    torchrun --nproc-per-node 4 examples/tensor_parallel.py --tp 2   # dp 2 x tp 2
    python examples/tensor_parallel.py                              # one process: a 1 x 1 mesh

``parallelize_module`` applies torchtitan's TP plan to each block (wq/wk/wv and w1/w3 colwise,
wo and w2 rowwise, the norms sequence-parallel), then ``raggedfsdp.fully_shard`` shards every
block over the data-parallel dim of the same mesh, exactly as with FSDP2 (only the import
differs). Parameters become ``RaggedTensor``s with the global shape, each rank holding a ragged
piece of its TP block; forward sees the DTensors TP expects. The data is synthetic: every token
is followed by one token chosen for it, each data-parallel rank draws its own sequences (the
TP ranks of one data-parallel rank share them), so the loss falls within a few dozen steps. On
CUDA it uses NCCL and one GPU per rank; that path has not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
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

import raggedfsdp
from raggedfsdp.optim import AdamW  # element-wise: exact on TP pieces (torch.optim.AdamW too)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: this TP rank's heads (the colwise layers' outputs are local tensors)
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm attention and a SwiGLU MLP, with torchtitan's module names."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.feed_forward = FeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """torchtitan's plan: sequence-parallel activations between blocks, replicated logits."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    gather_sequence = PrepareModuleInput(  # sequence-sharded in, whole for the colwise layers
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )
    for block in model.layers:
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": gather_sequence,
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": gather_sequence,
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, plan)


def synthetic_batches(
    args: argparse.Namespace, dp_rank: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``args.steps`` batches of (tokens, next tokens): the language is the same on every rank,
    the sequences each data-parallel rank's own (its TP ranks draw the same)."""
    follows = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(0))
    draw = torch.Generator().manual_seed(1 + dp_rank)
    for _ in range(args.steps):
        seq = [torch.randint(0, args.vocab, (args.batch,), generator=draw)]
        for _ in range(args.seq):
            seq.append(follows[seq[-1]])
        seq = torch.stack(seq, dim=1).to(device)
        yield seq[:, :-1], seq[:, 1:]


def train(model: Transformer, mesh: DeviceMesh, batches: Iterator) -> list[float]:
    """TP inside each block, then FSDP over the data-parallel dim: blocks, then the root."""
    apply_tp(model, mesh["tp"])
    for block in model.layers:
        raggedfsdp.fully_shard(block, mesh=mesh["dp_shard"])
    raggedfsdp.fully_shard(model, mesh=mesh["dp_shard"])
    opt = AdamW(model.parameters(), lr=3e-3)  # updates local pieces, no communication

    losses = []
    for tokens, targets in batches:
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
        loss.backward()  # TP's reductions by DTensor, then reduce-scatter over dp_shard
        raggedfsdp.clip_grad_norm_(model.parameters(), 1.0)  # over dp and tp, each element once
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq", type=int, default=16, help="a multiple of --tp")
    parser.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank")
    args = parser.parse_args()

    device = torch.device("cpu")
    if "RANK" in os.environ:  # under torchrun
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    else:  # one process: a group of one, so the same mesh code runs
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    dims = (world // args.tp, args.tp)  # (data parallel, tensor parallel)
    mesh = init_device_mesh(device.type, dims, mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)  # the same initial weights on every rank
    with device:
        model = Transformer(args.vocab, args.dim, args.layers, args.heads)
    batches = synthetic_batches(args, mesh["dp_shard"].get_local_rank(), device)
    losses = train(model, mesh, batches)
    if dist.get_rank() == 0:
        print(f"{world} rank(s), {args.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
