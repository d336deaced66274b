"""Merging this rank's pieces into flat runs, and the small tensor helpers the optimizers share.

Sharded optimizers update only this rank's piece of each parameter (a
:class:`~raggedfsdp.optim.contract.Piece`): a 1-D view of a flat buffer. Pieces of neighbouring
parameters are usually neighbours in memory too (the planner packs a group's tensors back to
back), so element-wise math can run on the *run* they form as one tensor: a few large kernels per
step instead of one per parameter. ``merge_runs`` finds those runs by address, so it is correct
whatever made the buffers; it never merges across a gap, because a gap may hold another group's
parameter or padding that is not ours to touch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from raggedfsdp.sharding import RaggedTensor

__all__ = ["flat", "is_view_of", "merge_runs", "scalar_dtype", "storage_bytes", "unwrap"]


def unwrap(t: Tensor) -> Tensor:
    """The local data of a state tensor (``RaggedTensor.local``, or the tensor itself)."""
    return t.local if isinstance(t, RaggedTensor) else t


def _adjacent(a: Tensor, b: Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()
    )


def _span(first: Tensor, numel: int) -> Tensor:
    return first.as_strided((numel,), (1,))


def merge_runs(entries: Sequence[Sequence[Tensor]]) -> list[list[Tensor]]:
    """Merge entries (one per piece: its parameter, gradient and state tensors, all 1-D and
    contiguous) into runs whose every component is one contiguous stretch of memory.

    Entries are taken in parameter-address order; an entry joins the current run only if *each*
    of its tensors starts exactly where the run's corresponding tensor ends. Empty entries are
    dropped (nothing to update).
    """
    live = [e for e in entries if e[0].numel() > 0]
    live.sort(key=lambda e: (e[0].device.type, e[0].device.index or 0, e[0].data_ptr()))
    runs: list[list[Tensor]] = []
    firsts: list[Tensor] = []
    lasts: list[Tensor] = []
    sizes: list[int] = []
    for entry in live:
        if lasts and all(_adjacent(a, b) for a, b in zip(lasts, entry, strict=True)):
            lasts = list(entry)
            sizes[-1] += entry[0].numel()
            continue
        if firsts:
            runs.append([_span(t, sizes[-1]) for t in firsts])
        firsts, lasts = list(entry), list(entry)
        sizes.append(entry[0].numel())
    if firsts:
        runs.append([_span(t, sizes[-1]) for t in firsts])
    return runs


def flat(t: Tensor) -> Tensor:
    """A 1-D view (sharded pieces already are; single-mode tensors must be contiguous)."""
    return t if t.dim() == 1 else t.view(-1)


def is_view_of(view: Tensor, t: Tensor | None) -> bool:
    """Whether ``t`` is exactly ``view`` (same memory, shape and dtype)."""
    return (
        t is not None
        and t.dtype == view.dtype
        and t.shape == view.shape
        and t.device == view.device
        and (view.numel() == 0 or t.data_ptr() == view.data_ptr())
    )


def storage_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes of the local data of ``tensors``, each object once (step counters are shared)."""
    unique = {id(t): unwrap(t) for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def scalar_dtype(fused: bool = False) -> torch.dtype:
    """torch's dtype for step counters: float32 (fused kernels always), float64 when that is the
    default dtype."""
    if not fused and torch.get_default_dtype() == torch.float64:
        return torch.float64
    return torch.float32
