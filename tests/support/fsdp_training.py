"""Shared by the fully_shard tests: wrapping helpers and a training loop on per-rank rows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import raggedfsdp.fsdp.param_group as param_group_module
from raggedfsdp import clip_grad_norm_, fully_shard
from raggedfsdp.sharding import RaggedTensor
from tests.support.tiny_models import batch, loss_fn

ROWS = 12  # global batch rows: divisible by every world size tested


def my_rows(x: torch.Tensor) -> torch.Tensor:
    world, rank = dist.get_world_size(), dist.get_rank()
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per]


def shard_blocks(model: nn.Module, wrap=fully_shard, **kwargs) -> nn.Module:
    """Each block, then the root (``wrap``: ours or FSDP2's ``fully_shard``)."""
    for layer in model.layers:
        wrap(layer, **kwargs)
    wrap(model, **kwargs)
    return model


def train(model, opt, steps: int, start: int = 0, sharded: bool = True, clip: float | None = None):
    losses = []  # with clip: the norm before each step's loss
    for step in range(start, start + steps):
        inputs, targets = batch(step % 2, ROWS)  # two batches, alternating: the loss falls
        if sharded:
            inputs, targets = my_rows(inputs), my_rows(targets)
        loss = loss_fn(model, inputs, targets)
        loss.backward()
        if clip is not None:
            norm = clip_grad_norm_(model.parameters(), clip)
            losses.append(norm.item())
        opt.step()
        opt.zero_grad()
        if sharded and dist.is_initialized():
            loss = loss.detach().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (ours or FSDP2's), by name."""
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def max_diff(sharded: nn.Module, reference: nn.Module) -> float:
    diffs = []
    for (name, p), (ref_name, q) in zip(
        sharded.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert name == ref_name
        full = p.full_tensor() if isinstance(p, RaggedTensor) else p
        diffs.append((full.detach().float() - q.detach().float()).abs().max().item())
    return max(diffs)


def torchtitan_wrap(model: nn.Module, wrap) -> nn.Module:
    """torchtitan's apply_fsdp: the embedding alone, each block, the final norm and the output
    projection as one group kept unsharded after forward (backward needs them first), the root."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    wrap(model.embed, mesh=mesh)
    for layer in model.layers:
        wrap(layer, mesh=mesh)
    wrap([model.norm, model.head], mesh=mesh, reshard_after_forward=False)
    wrap(model, mesh=mesh)
    return model


@contextmanager
def counting(
    collective: str, model: nn.Module | None = None, by_size: bool = False
) -> Iterator[Counter]:
    """Count ``collective`` calls (e.g. ``all_gather_flat``) per group of ``model`` (keyed by
    the group's name; ``"?"`` for buffers that are not a group's, or without a model), and
    with ``by_size`` by (name, number of ranks the collective ran over)."""
    names = {}
    for m in model.modules() if model is not None else []:
        for group in m._raggedfsdp_state.groups if hasattr(m, "_raggedfsdp_state") else []:
            names[id(group.compute.full)] = names[id(group.grads.full)] = group.name
    calls: Counter = Counter()
    original = getattr(param_group_module, collective)

    def counted(*args, **kwargs):
        name = names.get(id(args[0]), "?")
        calls[(name, dist.get_world_size(args[2])) if by_size else name] += 1
        return original(*args, **kwargs)

    setattr(param_group_module, collective, counted)
    try:
        yield calls
    finally:
        setattr(param_group_module, collective, original)
