"""``fully_shard`` + a raggedfsdp optimizer, end to end, on a small LLaMA-style model.

    torchrun --nproc-per-node 2 examples/fully_shard_llama.py [--steps 30] [--dim 128]
    python examples/fully_shard_llama.py    # one process: the same code, nothing to shard

Each block is one communication group and the root (embedding, final norm, head) another;
the parameters become ``RaggedTensor``s cut at the optimizer's blocks (8-bit AdamW's 256
elements), gathered in bf16 for compute and reduced in fp32 into the fp32 master shards. The
data is synthetic: each rank draws its own sequences of a fixed random "language" (every token
is followed by one token chosen for it), so the loss falls within a few dozen steps. On CUDA
(``torchrun`` on GPUs) it uses NCCL and one GPU per rank; that path has not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import raggedfsdp
from raggedfsdp.optim import AdamW8bit  # or AdamW, Muon, Shampoo, SOAP; torch.optim works


class Block(nn.Module):
    """Pre-norm attention and a SwiGLU MLP, each added to the residual stream."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        hidden = 8 * dim // 3
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.wqkv(self.attention_norm(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.transpose(1, 3).unbind(2)  # each (b, heads, t, head_dim)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attended.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Transformer(nn.Module):
    """Token embedding, ``layers`` blocks, final norm and output head (no positional
    encoding: the synthetic language needs only the previous token)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def synthetic_batches(
    args: argparse.Namespace, rank: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``args.steps`` batches of (tokens, next tokens): the language (which token follows
    which) is the same on every rank, the sequences are each rank's own."""
    follows = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(0))
    draw = torch.Generator().manual_seed(1 + rank)
    for _ in range(args.steps):
        seq = [torch.randint(0, args.vocab, (args.batch,), generator=draw)]
        for _ in range(args.seq):
            seq.append(follows[seq[-1]])
        seq = torch.stack(seq, dim=1).to(device)
        yield seq[:, :-1], seq[:, 1:]


def train(model: nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Shard ``model`` block by block, then the root, and train it; the losses, step by step."""
    policy = AdamW8bit.shard_policy()  # units = the optimizer's blocks: never cut between ranks
    mp = raggedfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:  # one communication group per block, then the root
        raggedfsdp.fully_shard(block, mp_policy=mp, shard_policy=policy)
    raggedfsdp.fully_shard(model, mp_policy=mp, shard_policy=policy)
    opt = AdamW8bit(model.parameters(), lr=3e-3)  # updates local pieces, no communication

    losses = []
    for tokens, targets in batches:
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
        loss.backward()  # gradients reduce-scattered in place, group by group
        raggedfsdp.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    args = parser.parse_args()

    device = torch.device("cpu")
    if "RANK" in os.environ:  # under torchrun
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)  # the same initial weights on every rank
    with device:
        model = Transformer(args.vocab, args.dim, args.layers, args.heads)
    losses = train(model, synthetic_batches(args, rank, device))
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        print(f"{world} rank(s), {args.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
