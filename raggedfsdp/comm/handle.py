"""Completion handles for collectives, and the stream discipline that makes them safe on CUDA.

Launch protocol with a dedicated communication stream (CUDA only; ignored for CPU tensors):

1. the comm stream waits for everything already queued on the current (compute) stream, so the
   collective reads inputs that are fully written;
2. the collective is issued on the comm stream (NCCL then orders its own internal stream after
   it and the comm stream after that);
3. an event is recorded on the comm stream;
4. :meth:`CommHandle.wait` makes the *current* stream wait for that event.

The handle holds references to the tensors until :meth:`CommHandle.wait`. That is what makes
``Tensor.record_stream`` unnecessary: the caching allocator can only recycle the memory once the
last reference is gone, and by then the current stream is already ordered after the collective, so
any reuse on it happens after the communication finished. (``record_stream`` would instead
delay reuse until the allocator polls the event, which keeps memory alive for an unknown time.)
The rule for callers is the usual one for async work: call ``wait()`` before touching the tensors,
and call it on the stream that will use them. A handle dropped unwaited keeps its collective's
work and tensors alive until the collective is done (``CommHandle.__del__``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed import Work

__all__ = ["CommHandle", "Works"]

# What handles dropped before their collective finished leave running: (work, event, tensors),
# kept until done (``CommHandle.__del__``) and let go by the next launch after that.
_UNFINISHED: list[tuple[Work | Works | None, torch.cuda.Event | None, tuple[Tensor, ...]]] = []


class Works:
    """Several backend works that finish as one collective (the point-to-point messages of
    gloo's all-gather exchange): ``wait`` waits them all, ``is_completed`` asks without blocking."""

    __slots__ = ("_works",)

    def __init__(self, works: list[Work]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class CommHandle:
    """Handle of one issued collective; ``wait()`` finishes it and is safe to call twice.

    Every collective in :mod:`raggedfsdp.comm` returns one. With ``async_op=False`` it comes back
    already waited, so callers never branch on the mode.
    """

    __slots__ = ("_device", "_event", "_keep_alive", "_then", "_work")

    def __init__(
        self,
        work: Work | Works | None = None,
        event: torch.cuda.Event | None = None,
        device: torch.device | None = None,
        keep_alive: tuple[Tensor, ...] = (),
        then: Callable[[], None] | None = None,
    ) -> None:
        self._work = work
        self._event = event
        self._device = device
        self._keep_alive = keep_alive
        self._then = then  # local finishing step after the collective (on the waiting stream)

    def wait(self) -> None:
        """Block (CPU) or order the current stream (CUDA) after the collective, then release it.

        With a bare ``Work`` on CUDA, ``Work.wait()`` already makes the current stream wait for
        the backend's stream; with a comm stream we wait on our own event instead.
        """
        if self._work is not None:
            self._work.wait()
        if self._event is not None:
            self._event.wait(torch.cuda.current_stream(self._device))
        then, self._then = self._then, None
        if then is not None:
            then()
        self._work = None
        self._event = None
        self._keep_alive = ()

    def is_completed(self) -> bool:
        """Whether the collective has finished (never blocks): lets callers release buffers
        as soon as possible instead of at a fixed point."""
        return _finished(self._work, self._event)

    def __del__(self) -> None:
        """A handle dropped unwaited (an error between a prefetch and its use, then the module
        deleted) leaves its collective running, so its work and tensors outlive it until the
        collective is done. Freed at once, the tensors' memory could be handed out again while
        a transfer still writes it (on CUDA by the caching allocator), and gloo cancels a
        point-to-point receive whose work dies: the message the peer sends anyway then wedges
        the pair, and the next receive with that tag never completes."""
        if not self.is_completed():
            _UNFINISHED.append((self._work, self._event, self._keep_alive))


def _finished(work: Work | Works | None, event: torch.cuda.Event | None) -> bool:
    if work is not None and not work.is_completed():
        return False
    return event is None or event.query()


def launch(
    issue: Callable[[bool], Work | Works | None],
    tensors: tuple[Tensor, ...],
    async_op: bool,
    comm_stream: torch.cuda.Stream | None,
    then: Callable[[], None] | None = None,
) -> CommHandle:
    """Issue a collective through ``issue(async_op)`` and wrap the result in a handle.

    ``tensors`` are all tensors the collective reads or writes; they stay referenced until the
    handle is waited. ``comm_stream`` applies only to CUDA tensors (see the module docstring).
    ``then`` runs when the handle is waited, after the collective.
    """
    if _UNFINISHED:
        _UNFINISHED[:] = [entry for entry in _UNFINISHED if not _finished(*entry[:2])]
    if comm_stream is None or not tensors[0].is_cuda:
        handle = CommHandle(work=issue(async_op), keep_alive=tensors, then=then)
    else:
        device = tensors[0].device
        if comm_stream.device != device:
            raise ValueError(f"comm_stream: is on {comm_stream.device} but the tensors on {device}")
        comm_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(comm_stream):
            # Synchronous issue: for NCCL this only orders the comm stream after NCCL's stream;
            # the host does not block.
            issue(False)
            done = comm_stream.record_event()
        handle = CommHandle(event=done, device=device, keep_alive=tensors, then=then)
    if not async_op:
        handle.wait()
    return handle
