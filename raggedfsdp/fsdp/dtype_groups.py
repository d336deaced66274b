"""``DtypeGroups``: one ``fully_shard`` group whose parameters have several dtypes.

A flat buffer holds one dtype (the planner refuses more), so a call whose parameters mix dtypes
(fp32 beside bf16, a frozen int64 table or bool mask beside float weights) becomes one
``ParamGroup`` per dtype, each planned on its own with every guarantee of the planner (units
whole, segments balanced, the padding notes) and with its own all-gather and, if it has
trainable parameters, its own reduce-scatter in its own dtype. The state sees one group: this
class runs the same calls on each part, so the hooks, the schedule and every ``set_*`` control
treat the call as one unit, gathered before its modules' forward and released once all of its
gradients are in.

Why not one byte buffer with every dtype in it (FSDP2's ``uint8`` all-gather)? It would save
``dtypes - 1`` all-gathers per gather, but only those: the reduce-scatter needs one dtype per
buffer anyway (the sum is typed), mixed precision casts the float parts and not the others (so
the byte layout of the all-gather differs from the sharded one's, and every unit and offset
would have to be planned in bytes, aligned to each dtype's size), and the sharded parameters
and gradients would be typed views of byte storage. The per-dtype parts reuse the one-dtype
path unchanged: a call with one dtype builds a plain ``ParamGroup`` and pays nothing for this.
docs/fsdp.md ("Mixed dtypes in one group") has the measured cost of the extra collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

from raggedfsdp.comm import ShardMesh
from raggedfsdp.fsdp.managed_param import ManagedParam
from raggedfsdp.fsdp.param_group import ParamGroup

__all__ = ["DtypeGroups", "build_by_dtype"]


def build_by_dtype(
    members: list[ManagedParam], build: Callable[[list[ManagedParam]], ParamGroup]
) -> ParamGroup | DtypeGroups:
    """``build(members)`` if they share one dtype, else a ``DtypeGroups`` of one ``build`` per
    dtype (in order of first appearance, each keeping its parameters' model order)."""
    by_dtype: dict[torch.dtype, list[ManagedParam]] = {}
    device = members[0].local_original.device
    for mp in members:
        tensor = mp.local_original
        if tensor.device != device:  # (each part would be on one device, the group not)
            raise ValueError(
                f"parameter {mp.fqn!r} is on {tensor.device} but {members[0].fqn!r} is on "
                f"{device}: one fully_shard group holds one device. Move the module first, or "
                "wrap the differing submodule in its own fully_shard call."
            )
        by_dtype.setdefault(tensor.dtype, []).append(mp)
    if len(by_dtype) == 1:
        return build(members)
    return DtypeGroups([build(part) for part in by_dtype.values()])


def _shared_setting(name: str) -> property:
    """A per-group setting (the state's, ``FSDPModule.set_*``'s) that every part holds."""

    def get(self: DtypeGroups) -> object:
        return getattr(self.parts[0], name)

    def set_(self: DtypeGroups, value: object) -> None:
        for part in self.parts:
            setattr(part, name, value)

    return property(get, set_, doc=f"``ParamGroup.{name}``, the same on every part.")


class DtypeGroups:
    """The parts (one ``ParamGroup`` per dtype) of one ``fully_shard`` group, behind the
    interface through which the state and ``FSDPModule`` drive a ``ParamGroup``. ``params``
    are the parts' parameters, part after part; the state's index ``i`` into it (the gradient
    hooks', ``read_in_backward``'s) is mapped to the part's own."""

    awaits_inputs = _shared_setting("awaits_inputs")
    inputs_done = _shared_setting("inputs_done")
    requires_gradient_sync = _shared_setting("requires_gradient_sync")
    requires_all_reduce = _shared_setting("requires_all_reduce")
    reshard_after_backward = _shared_setting("reshard_after_backward")
    gradient_divide_factor = _shared_setting("gradient_divide_factor")

    def __init__(self, parts: list[ParamGroup]) -> None:
        self.parts = tuple(parts)
        self.params = [mp for part in parts for mp in part.params]
        self._where = [(part, j) for part in parts for j in range(len(part.params))]
        self._offsets = [self._where.index((part, 0)) for part in parts]
        self.name = parts[0].name

    # --------------------------------------------------------------------------- attributes
    @property
    def name(self) -> str:
        return self._name

    @name.setter
    def name(self, name: str) -> None:
        """Each part is named after the group and its dtype, so errors say which one."""
        self._name = name
        for part in self.parts:
            part.name = f"{name} [{str(part.orig_dtype).removeprefix('torch.')}]"

    @property
    def mesh(self) -> ShardMesh:
        return self.parts[0].mesh

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def offload(self) -> CPUOffloadPolicy | None:
        return self.parts[0].offload

    @property
    def notes(self) -> tuple[str, ...]:
        """Each part's planner notes, prefixed with the part's name."""
        return tuple(f"{part.name}: {note}" for part in self.parts for note in part.notes)

    @property
    def all_gather_bytes(self) -> int:
        return sum(part.all_gather_bytes for part in self.parts)

    @property
    def gathered_bytes(self) -> int:
        return sum(part.gathered_bytes for part in self.parts)

    @property
    def gradient_bytes(self) -> int:
        return sum(part.gradient_bytes for part in self.parts)

    @property
    def finish_is_local(self) -> bool:
        return all(part.finish_is_local for part in self.parts)

    @property
    def num_trainable(self) -> int:
        return sum(part.num_trainable for part in self.parts)

    @property
    def is_unsharded(self) -> bool:
        return all(part.is_unsharded for part in self.parts)

    @property
    def done_reading(self) -> bool:
        return all(part.done_reading for part in self.parts)

    @property
    def grads_complete(self) -> bool:
        return all(part.grads_complete for part in self.parts)

    @property
    def reduce_started(self) -> bool:
        return any(part.reduce_started for part in self.parts)

    @property
    def reduce_pending(self) -> bool:
        return any(part.reduce_pending for part in self.parts)

    @property
    def has_unreduced_grads(self) -> bool:
        return any(part.has_unreduced_grads for part in self.parts)

    @property
    def read_in_backward(self) -> frozenset[int]:
        return frozenset(
            offset + j
            for part, offset in zip(self.parts, self._offsets, strict=True)
            for j in part.read_in_backward
        )

    @read_in_backward.setter
    def read_in_backward(self, indices: frozenset[int]) -> None:
        mine: dict[int, set[int]] = {id(part): set() for part in self.parts}
        for i in indices:
            part, j = self._where[i]
            mine[id(part)].add(j)
        for part in self.parts:
            part.read_in_backward = frozenset(mine[id(part)])

    # --------------------------------------------------------------------------- parameters
    def use_sharded_params(self) -> None:
        for part in self.parts:
            part.use_sharded_params()

    def use_unsharded_params(self) -> None:
        for part in self.parts:
            part.use_unsharded_params()

    def check_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Every part checked before any converts: a refused conversion changes nothing."""
        for part in self.parts:
            part.check_conversion(fn)

    def convert(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """Each part converted (``Module.to(dtype)`` casts the float parts only)."""
        return any([part.convert(fn) for part in self.parts])  # a list: convert every part

    # ----------------------------------------------------------------------------- gathers
    def unshard(self, async_op: bool = False) -> None:
        """Start every part's all-gather, then (unless ``async_op``) wait for them: the parts'
        collectives overlap each other."""
        for part in self.parts:
            part.unshard(async_op=True)
        if not async_op:
            for part in self.parts:
                part.unshard()

    def reshard(self, free: bool = True, keep_for: ShardMesh | None = None) -> None:
        for part in self.parts:
            part.reshard(free=free, keep_for=keep_for)

    # ----------------------------------------------------------------------------- gradients
    def accumulate_grad(self, index: int, param: nn.Parameter) -> None:
        part, j = self._where[index]
        part.accumulate_grad(j, param)

    def forget_backward(self) -> None:
        for part in self.parts:
            part.forget_backward()

    def flush_held_grads(self) -> None:
        for part in self.parts:
            part.flush_held_grads()

    def discard_grads(self) -> None:
        for part in self.parts:
            part.discard_grads()

    def reduce_grads(self) -> None:
        """Start the reduce-scatter of each part holding gradients, in its own reduce dtype:
        a part of frozen (integer, bool) parameters never reduces, and a part none of whose
        parameters got a gradient keeps ``.grad`` unset, as a ``fully_shard`` call of its own
        would."""
        for part in self.parts:
            if part.has_unreduced_grads and not part.reduce_pending:
                part.reduce_grads()

    def reduce_completed(self) -> bool:
        return all(part.reduce_completed() for part in self.parts)

    def finish_reduce(self) -> list[nn.Parameter]:
        return [param for part in self.parts for param in part.finish_reduce()]
