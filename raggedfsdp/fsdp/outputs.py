"""Finding the tensors a module's forward returned, wherever the output keeps them.

``fully_shard`` hooks the outputs that take a gradient: their gradients tell it to gather the
group again before backward reads its parameters. FSDP2 looks for them with pytree only, so a
block returning a dataclass (Hugging Face's ``ModelOutput`` when not registered) or any other
object pytree does not know hides them: the group is freed after forward, nothing gathers it
for backward, and autograd fails with "modified by an inplace operation" on the freed weight.
Here, pytree leaves that are not tensors are searched too: a mapping's values, a sequence's or
set's items, a dataclass's fields, an object's attributes (``__dict__`` and ``__slots__``), a
few levels deep. Modules are not searched: their parameters are not outputs.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["MAX_DEPTH", "output_tensors"]

#: How many levels of non-pytree containers are searched below each pytree leaf.
MAX_DEPTH = 4


_NOT_SEARCHED = (nn.Module, type, str, bytes)


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in ``output`` that take a gradient, each once, in the order found."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    pending = deque((leaf, 0) for leaf in tree_flatten(output)[0])
    while pending:
        obj, depth = pending.popleft()
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad:
                found.setdefault(id(obj), obj)
            continue
        if depth >= MAX_DEPTH or id(obj) in seen or isinstance(obj, _NOT_SEARCHED):
            continue
        seen.add(id(obj))
        pending.extend((child, depth + 1) for child in _children(obj))
    return list(found.values())


def _children(obj: Any) -> Iterable[Any]:
    """What a pytree leaf holds, if it is a container or an object with attributes."""
    if isinstance(obj, Mapping):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    children = list(getattr(obj, "__dict__", {}).values())
    slots = getattr(type(obj), "__slots__", ())
    for slot in (slots,) if isinstance(slots, str) else slots:
        children.append(getattr(obj, slot, None))
    return children
