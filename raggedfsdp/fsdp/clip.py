"""``clip_grad_norm_`` over ragged shards: one scalar all-reduce per shard group.

Each rank's pieces are disjoint, so summing ``|g|^p`` over local pieces and all-reducing that
one number per shard group gives the exact global norm. Plain (replicated) gradients are
identical on every rank and are added once, after the reduction. With HSDP the replicas hold
identical sharded gradients, so only the shard group is reduced. Under tensor parallelism a
TP-sharded gradient's sum is reduced over the TP group too; a replicated one (a
sequence-parallel norm's) is the same on every TP rank and is reduced over data parallel only,
so every element counts once (torchtitan's rule).

``torch.nn.utils.clip_grad_norm_`` works on RaggedTensor gradients too, through whole-tensor
norms with one all-reduce per call; this one accumulates in fp32 whatever the gradients' dtype
(fp64 when a gradient is fp64, as torch would), so bf16 gradients lose nothing to per-tensor bf16
norms. NaN and inf propagate as in torch on every backend (the inf-norm's MAX all-reduce
carries a NaN flag), so ``error_if_nonfinite`` sees a NaN on any rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from raggedfsdp.comm.nan_safe import all_reduce_nan_safe
from raggedfsdp.sharding import RaggedTensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale gradients in place so their global ``norm_type``-norm is at most ``max_norm``.

    Works on ``fully_shard`` parameters (``RaggedTensor`` gradients), plain ones, or a mix;
    returns the total norm before clipping, the same on every rank: fp32, or fp64 when a
    gradient is fp64. With ``error_if_nonfinite``, a NaN or inf norm raises before any
    gradient is touched.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type={norm_type} must be positive (or math.inf)")
    device = grads[0].device
    accumulate = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    # Pieces that combine over the same groups (data parallel, and TP for TP-sharded ones)
    ragged_by_groups: dict[tuple[object, ...], list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for g in grads:
        if isinstance(g, RaggedTensor):
            ragged_by_groups.setdefault(g.reduce_groups, []).append(g.local)
        else:
            plain.append(g)
    partials = []
    for groups, locals_ in ragged_by_groups.items():
        part = _partial(locals_, norm_type, device, accumulate)
        for group in groups if dist.is_initialized() else ():
            part = all_reduce_nan_safe(part, "max" if math.isinf(norm_type) else "sum", group)
        partials.append(part)
    if plain:
        partials.append(_partial(plain, norm_type, device, accumulate))
    stacked = torch.stack(partials)
    total = stacked.max() if math.isinf(norm_type) else stacked.sum().pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total gradient norm is {total.item()}: set error_if_nonfinite=False to clip "
            "anyway, or skip this step"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            (g.local if isinstance(g, RaggedTensor) else g).mul_(coef.to(g.dtype))
    return total


def _partial(
    tensors: list[torch.Tensor], norm_type: float, device: torch.device, accumulate: torch.dtype
) -> torch.Tensor:
    """``max |g|`` or ``sum |g|^p`` over the given tensors, in ``accumulate``."""
    flat = [t.reshape(-1).to(accumulate) for t in tensors if t.numel()]
    if not flat:
        return torch.zeros((), dtype=accumulate, device=device)
    if math.isinf(norm_type):
        return torch.stack([t.abs().max() for t in flat]).max()
    return torch.stack([t.abs().pow(norm_type).sum() for t in flat]).sum()
