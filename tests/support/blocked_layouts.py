"""World-size tests shared by the optimizers on Shampoo's blocks (Shampoo, SOAP): the same
gradients on every rank, explicit layouts that keep or cut blocks, and one training run whose
full parameters and states are compared with one process's."""

from __future__ import annotations

import math
from typing import Any

import torch

from raggedfsdp.sharding import RaggedShard, RaggedTensor
from tests.support.optim_helpers import (
    counted_params,
    exact_grads,
    init_tensors,
    ragged_params,
    rank_world,
    set_ragged_grads,
)

Shapes = dict[str, tuple[int, ...]]
#: How ``train_on_layout`` holds the parameters: the optimizer's own plan, explicit splits that
#: keep slabs whole but leave ranks empty (``uneven``) or cut blocks (``cut``), plain tensors
#: under a process group (``drop-in``), or one process (``single``).
MODES = ("planned", "uneven", "drop-in", "cut")


#: The options that change the block layout (the shard policy's arguments; the last three are
#: SOAP's).
LAYOUT_OPTIONS = (
    "merge_dims",
    "precondition_1d",
    "large_dims",
    "tensor_factors",
    "normalize_grads",
)


def layout_options(config: dict) -> dict:
    """The options of ``config`` that change the block layout (the shard policy's arguments)."""
    return {k: config[k] for k in LAYOUT_OPTIONS if k in config}


def same_grads(shapes: Shapes, steps: int, world: int = 1) -> list[dict[str, torch.Tensor]]:
    """``steps`` gradients per tensor, identical on every rank (so results are W-invariant)."""
    return [
        {n: g[0] for n, g in exact_grads(shapes, step, world, same=True).items()}
        for step in range(steps)
    ]


def explicit_layout(policy: Any, shapes: Shapes, kind: str, world: int) -> dict[str, RaggedShard]:
    """``uneven``: whole slabs (``policy``'s units) piled on the last ranks, rank 0 mostly
    empty; ``cut``: element splits that cut blocks, ragged."""
    out = {}
    for i, (n, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        if kind == "uneven":
            unit = policy(n, torch.empty(shape))
            counts = [0] * world
            for u in range(-(-numel // unit)):
                counts[(world - 1 - (u + i) % 2) % world] += 1
            out[n] = RaggedShard.from_counts(shape, unit, sorted(counts), n)
        else:
            cuts = sorted((numel * (3 * r + i)) // (3 * world + 2) for r in range(1, world))
            bounds = [0, *cuts, numel]
            counts = [bounds[r + 1] - bounds[r] for r in range(world)]
            out[n] = RaggedShard.from_counts(shape, 1, counts, n)
    return out


def train_on_layout(
    opt_cls: Any, block: int, shapes: Shapes, base: dict, mode: str, config: dict, steps: int
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Full parameters and states (``name.state_key``) after ``steps`` steps of ``opt_cls`` on
    ``mode``'s layout (see ``MODES``), and the per-step ``last_step_stats``."""
    rank, world = rank_world()
    init = init_tensors(shapes)
    policy = opt_cls.shard_policy(block, **layout_options(config))
    if mode == "planned":
        params, gbuf = ragged_params(init, policy, world, rank)
    elif mode in ("uneven", "cut"):
        layout = explicit_layout(policy, shapes, mode, world)
        params, gbuf = counted_params(init, layout, rank), None
    else:
        params, gbuf = {n: torch.nn.Parameter(t) for n, t in init.items()}, None
    opt = opt_cls(list(params.items()), **{**base, **config})
    stats = []
    for grads in same_grads(shapes, steps, world):
        if mode in ("planned", "uneven", "cut"):
            set_ragged_grads(params, grads, gbuf)
        else:
            for n, p in params.items():
                p.grad = grads[n].clone()
        opt.step()
        stats.append(dict(opt.last_step_stats))
    out = {}
    for i, (n, p) in enumerate(params.items()):
        out[n] = p.full_tensor() if isinstance(p, RaggedTensor) else p.detach().clone()
        for key, value in opt.state_dict()["state"][i].items():
            full = value.full_tensor() if isinstance(value, RaggedTensor) else value
            out[f"{n}.{key}"] = full.clone()
    return out, stats
