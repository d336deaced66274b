"""Bytes through each kind of collective: ``CollectiveCounter``, the same for both FSDPs.

Both runtimes reach the process group through the dispatcher's ``c10d`` ops (whatever
Python function they call), so a dispatch mode that looks at those ops counts the traffic of
raggedfsdp and of FSDP2 with one rule, on the fake process group and on gloo or NCCL alike.

A collective's bytes are its whole buffer: the gathered output of an all-gather, the input
of a reduce-scatter, the tensor of an all-reduce, the input of an all-to-all (what this rank
sends); a ring moves ``(W - 1) / W`` of that over the wire. raggedfsdp's gloo all-gather is an
exchange of point-to-point messages tagged ``GATHER_TAG`` (``raggedfsdp.comm.collectives``),
and its two-rank reduce-scatter one tagged ``REDUCE_TAG``: each counts as the collective it is,
once, at its send to the next rank.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from raggedfsdp.comm import GATHER_TAG, REDUCE_TAG

__all__ = ["CollectiveCounter"]

_c10d = torch.ops.c10d
_KINDS = {
    _c10d._allgather_base_.default: ("all_gather", 0),
    _c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 0),
    _c10d.allgather_.default: ("all_gather", 0),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 1),
    _c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 1),
    _c10d.reduce_scatter_.default: ("reduce_scatter", 1),
    _c10d.allreduce_.default: ("all_reduce", 0),
    _c10d.allreduce_coalesced_.default: ("all_reduce", 0),
    _c10d.alltoall_base_.default: ("all_to_all", 1),
    _c10d.alltoall_.default: ("all_to_all", 1),
    _c10d.broadcast_.default: ("broadcast", 0),
}

_EXCHANGES = {GATHER_TAG: "all_gather", REDUCE_TAG: "reduce_scatter"}  # by their messages' tag


def _nbytes(value: object) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor)
    )


class CollectiveCounter(TorchDispatchMode):
    """``bytes[kind]`` and ``calls[kind]`` for kind in all_gather, reduce_scatter, all_reduce,
    all_to_all, broadcast, summed while active, and ``largest[kind]``, the biggest single
    buffer; ``reset()`` starts a new count."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.largest: Counter[str] = Counter()

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.largest.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _KINDS.get(func)
        if kind is not None:
            name, index = kind
            self._count(name, _nbytes(args[index]))
        elif func is _c10d.send.default and args[3] in _EXCHANGES:
            group = dist.ProcessGroup.unbox(args[1])
            if args[2] == (group.rank() + 1) % group.size():
                self._count(_EXCHANGES[args[3]], _nbytes(args[0]) * group.size())
        return func(*args, **(kwargs or {}))

    def _count(self, name: str, size: int) -> None:
        self.bytes[name] += size
        self.calls[name] += 1
        self.largest[name] = max(self.largest[name], size)
