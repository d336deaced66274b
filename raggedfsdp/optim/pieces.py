"""What one rank updates: a ``Piece`` per parameter, and merging pieces into flat runs.

Sharded optimizers update only this rank's piece of each parameter: a 1-D view of a flat
buffer. Pieces of neighbouring parameters are usually neighbours in memory too (the planner packs
a group's tensors back to back), so element-wise math can run on the *run* they form as one
tensor: a few large kernels per step instead of one per parameter. ``merge_runs`` finds those runs
by address, so it is correct whatever made the buffers; it never merges across a gap, because a
gap may hold another group's parameter or padding that is not ours to touch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from raggedfsdp.sharding import RaggedShard, RaggedTensor

if TYPE_CHECKING:
    import torch.distributed as dist

    from raggedfsdp.optim.dropin import DropInBucket

__all__ = ["Mode", "Piece", "merge_runs"]

#: ``single``: plain parameters, one process (torch's behaviour); ``drop-in``: plain replicated
#: parameters kept in the optimizer's ZeRO-2 flat buffers; ``fsdp``: ``RaggedTensor`` parameters
#: from ``fully_shard`` (or built by hand), updated where they lie.
Mode = Literal["single", "drop-in", "fsdp"]


@dataclass(eq=False)
class Piece:
    """This rank's part of one parameter.

    ``spec`` is the parameter's split over ``pgroup`` (None in single mode, where the piece is the
    whole parameter in its own shape); ``bucket`` holds the flat buffers in drop-in mode.
    """

    param: Tensor
    name: str
    group_index: int
    mode: Mode
    spec: RaggedShard | None = None
    rank: int = 0
    pgroup: dist.ProcessGroup | None = None
    bucket: DropInBucket | None = None

    @property
    def sharded(self) -> bool:
        return self.mode != "single"

    @property
    def numel(self) -> int:
        """Elements this rank holds."""
        return self.param.numel() if self.spec is None else self.spec.length(self.rank)

    def local(self) -> Tensor:
        """The values to update in place: the parameter itself (single mode) or a 1-D view."""
        if self.mode == "fsdp":
            return self.param.local
        if self.mode == "drop-in":
            return self.bucket.params.shard_view(self.name)
        return self.param

    def local_grad(self) -> Tensor | None:
        """The (reduced) gradient of the local piece, or None when there is none."""
        if self.mode == "drop-in":
            return self.bucket.grads.shard_view(self.name)
        grad = self.param.grad
        if grad is None or self.mode == "single":
            return grad
        return grad.local

    def wrap(self, local: Tensor, spec: RaggedShard | None = None) -> Tensor:
        """A state tensor as users and checkpoints see it: a ``RaggedTensor`` with the global shape
        in sharded modes (``spec`` defaults to the parameter's), the tensor itself otherwise."""
        if not self.sharded:
            return local
        return RaggedTensor(local, spec or self.spec, self.rank, self.pgroup)


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
