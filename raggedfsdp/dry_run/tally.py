"""Live tensor bytes, byte-exact, for real and fake tensors alike: ``MemoryTally``.

A ``TorchDispatchMode`` sees every op's outputs, so it sees every storage as it is created;
a weak reference to the storage says when it dies. The storage's byte count is what the
allocator is asked for (views share a storage and count once; a flat buffer's padding
counts), so the sum of live storages is the process's tensor memory. Fake tensors
(``FakeTensorMode``) have storages of the right size and no data, so the same tally measures
the per-rank memory of a model that would not fit here without allocating it.

``UntypedStorage.resize_`` is not an op and no mode sees it, yet both FSDPs free and
re-allocate their unsharded buffers with it, so the tally wraps it while active.

What the tally does not see: memory inside a backend (a collective's scratch copies, gloo's
or NCCL's own buffers), temporaries that a tensor subclass (DTensor, RaggedTensor) allocates
and frees within one op (no mode sees a subclass's inner ops; its outputs' inner tensors are
counted), and allocator rounding and caching. On CUDA ``torch.cuda.max_memory_allocated``
adds the rounding; here the tally is the tensor bytes the runtime keeps.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from raggedfsdp.sharding.ragged_tensor import RaggedTensor

__all__ = ["MemoryTally", "storages_of"]


def storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``tensor``'s elements: its own, or for a wrapper subclass without
    one (DTensor, RaggedTensor) those of the tensors it wraps. A wrapper's op allocates its
    inner tensors where no mode sees them, so the tally finds them through the outputs."""
    if isinstance(tensor, RaggedTensor):
        return storages_of(tensor.local)
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, name) for name in names)
        return [s for t in inner if isinstance(t, torch.Tensor) for s in storages_of(t)]
    return [tensor.untyped_storage()]


class MemoryTally(TorchDispatchMode):
    """Counts live tensor bytes while active and records peaks by phase.

    ``live`` is the bytes of every storage created while active and still alive; ``peak``
    the most ``live`` has been since the last ``phase`` began (``peaks`` keeps each phase's).
    Storages that existed before the tally started are not counted: start it before the
    model is built.
    """

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0
        self.peaks: dict[str, int] = {}
        self._phase: str | None = None
        self._resize: Any = None

    # ------------------------------------------------------------------- storages in and out
    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self._refs[key] = weakref.ref(storage, lambda _, k=key: self._drop(k))
        self._grow(size)

    def _drop(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _grow(self, nbytes: int) -> None:
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
            if self._phase is not None:
                self.peaks[self._phase] = self.peak

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes:
            new = storage.nbytes()
            old, self._sizes[key] = self._sizes[key], new
            self._grow(new - old)

    def track(self, value: Any) -> None:
        """Count the storages of the tensors in ``value`` (outputs of an op)."""
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                for storage in storages_of(leaf):
                    self._add(storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out

    # --------------------------------------------------------------------------- phases
    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the peak of ``live`` inside the block as ``peaks[name]``."""
        self._phase, self.peak = name, self.live
        self.peaks[name] = self.live
        try:
            yield
        finally:
            self._phase = None

    def __enter__(self) -> MemoryTally:
        original = torch.UntypedStorage.resize_
        tally = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            tally._resized(storage)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def bytes_of(self, tensors: Any) -> int:
        """Bytes of the distinct storages behind ``tensors`` (shared storages count once)."""
        seen: dict[int, int] = {}
        for leaf in tree_leaves(tensors):
            if isinstance(leaf, torch.Tensor):
                for storage in storages_of(leaf):
                    seen[id(storage)] = storage.nbytes()
        return sum(seen.values())
