"""Drop-in ZeRO-2: replicated plain parameters whose gradients and updates are sharded.

A user who keeps ``torch.optim.AdamW``'s code but runs it under a process group gets this mode:
the optimizer plans one flat buffer per parameter group, dtype and device with its own unit rule,
moves the parameters into it (``p.data`` becomes a view, so the module still sees full tensors),
and makes every ``p.grad`` a view of a flat gradient buffer so that autograd accumulates there.
``step()`` then reduce-scatters the gradient buffer in place (averaging, like DDP), updates this
rank's segment only (1/W of the state) and all-gathers the parameter buffer in place. Nothing is
copied around a collective.

Because ``p.grad`` must stay a view of the buffer, ``zero_grad`` zeroes the buffer instead of
dropping the gradients; whether a parameter *received* a gradient since the last
``zero_grad(set_to_none=True)`` is tracked with post-accumulate-grad hooks, so a parameter no rank
computed a gradient for is skipped exactly as torch skips ``p.grad is None``. A hook needs
``requires_grad``: a frozen parameter keeps ``p.grad = None`` until it has a gradient, so one
unfrozen later gets a fresh gradient from autograd (copied in at the next step, which hooks it)
instead of one accumulated silently into its view. After ``step()``
the buffer holds averaged values only in this rank's segment, so using those gradients again
(stepping again, or accumulating a backward onto them) is an error rather than a silently wrong
update. Zeroing them is not: ``optimizer.zero_grad()``, or torch's ``model.zero_grad(set_to_none=
False)``, which zeroes each ``p.grad`` in place. To tell that apart from reuse without reading
the values, each ``p.grad`` is an alias of its buffer region with a version counter of its own (a
view would share the buffer's counter with every other parameter's view): an in-place write
between ``step()`` and the first gradient to arrive means the user reset it. Any in-place write
counts (``p.grad.mul_(0)`` as much as ``zero_()``); accumulating without one does not.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from raggedfsdp.comm import (
    CommHandle,
    ShardMesh,
    all_gather_flat,
    all_reduce_flat,
    reduce_scatter_flat,
)
from raggedfsdp.optim.pieces import is_view_of
from raggedfsdp.sharding import FlatBuffer, Layout, TensorSpec, plan_layout

__all__ = ["DropInBucket"]


def _arrived(bucket: weakref.ref[DropInBucket], index: int, param: Tensor) -> None:
    alive = bucket()
    if alive is not None:
        alive.arrived(index, param)


def _alias(view: Tensor) -> Tensor:
    """A tensor on ``view``'s memory with a version counter of its own, so that an in-place
    write to one parameter's gradient shows on that gradient only."""
    with torch.no_grad():
        empty = torch.empty(0, dtype=view.dtype, device=view.device)
        return empty.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


class DropInBucket:
    """One parameter group's plain parameters of one dtype and device, in ZeRO-2 flat buffers.

    Args:
        names: unique names of the parameters (used as tensor names in the layout and errors).
        params: the parameters; their values are broadcast from rank 0 (as DDP does), then
            ``p.data`` and ``p.grad`` become views of the buffers.
        units: elements per unit for each parameter (the optimizer's shard policy).
        mesh: the shard (and, for HSDP, replicate) groups.
        check_grad: validates a gradient the user assigned (sparse, complex, shape...).
    """

    def __init__(
        self,
        names: Sequence[str],
        params: Sequence[Tensor],
        units: Sequence[int],
        mesh: ShardMesh,
        check_grad: Callable[[str, Tensor, Tensor], None],
    ) -> None:
        self.names = list(names)
        self.plist = list(params)
        self.mesh = mesh
        self._check_grad = check_grad
        specs = [
            TensorSpec(n, tuple(p.shape), p.dtype, u)
            for n, p, u in zip(self.names, self.plist, units, strict=True)
        ]
        self.layout: Layout = plan_layout(specs, mesh.shard_size)
        dtype, device = self.plist[0].dtype, self.plist[0].device
        rank = mesh.shard_rank
        self.params = FlatBuffer(self.layout, rank, dtype, device, persistent_full=True)
        self.grads = FlatBuffer(self.layout, rank, dtype, device, persistent_full=True)
        with torch.no_grad():
            for name, p in zip(self.names, self.plist, strict=True):
                self.params.full_view(name).copy_(p)
            self._broadcast()
        self.has_grad = [p.grad is not None for p in self.plist]
        #: What ``p.grad`` is while it is the buffer's (see ``_alias``).
        self._aliases = [_alias(self.grads.full_view(n)) for n in self.names]
        for i, (name, p) in enumerate(zip(self.names, self.plist, strict=True)):
            grad = p.grad
            if grad is not None:
                check_grad(name, p, grad)
                self.grads.full_view(name).copy_(grad)
            p.data = self.params.full_view(name)
            if grad is not None or p.requires_grad:  # see _point_at_buffer
                p.grad = self._aliases[i]
        self._hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._hook_trainable()
        #: The gradient buffer was reduce-scattered in place: only this rank's segment holds
        #: averaged values, so each gradient must be reset (or replaced) before reuse.
        self.reduced = False
        #: Since the reduce: each alias's version then, and per parameter whether the first
        #: gradient to arrive was accumulated onto the reduced one (None: none arrived yet).
        self._versions = [0] * len(self.plist)
        self._stale: list[bool | None] = [None] * len(self.plist)

    def _broadcast(self) -> None:
        """Make every rank start from rank 0's values (replicate dim first, then shard dim)."""
        for group, size in (
            (self.mesh.replicate_group, self.mesh.replicate_size),
            (self.mesh.shard_group, self.mesh.shard_size),
        ):
            if group is not None and size > 1:
                dist.broadcast(self.params.full, group=group, group_src=0)

    def _hook_trainable(self) -> None:
        """Hook the parameters that take gradients now and were not hooked yet (frozen at
        construction, unfrozen since): from here on a gradient accumulated into the view
        marks them."""
        for i, p in enumerate(self.plist):
            if p.requires_grad and i not in self._hooks:
                # weakly: a hook holding the bucket would keep it (and, through it, the
                # optimizer's buffers) alive in a reference cycle after the optimizer is gone
                arrived = functools.partial(_arrived, weakref.ref(self), i)
                self._hooks[i] = p.register_post_accumulate_grad_hook(arrived)

    def arrived(self, i: int, p: Tensor) -> None:
        """A gradient was accumulated into parameter ``i``. The first one after a reduce was
        added onto the reduced gradient if autograd's in-place add (one version) is the only
        write to the alias since then; a reset (``zero_()``) before it is another."""
        self.has_grad[i] = True
        if self.reduced and self._stale[i] is None:
            alias = self._aliases[i]
            self._stale[i] = p.grad is alias and alias._version == self._versions[i] + 1

    def _reuses_reduced(self, i: int, grad: Tensor | None) -> bool:
        """Whether ``grad`` (``p.grad`` at the step after a reduce) builds on the reduced
        gradient: accumulated onto it, or untouched since."""
        if self._stale[i] is not None:
            return self._stale[i] and grad is not None
        alias = self._aliases[i]
        return grad is alias and alias._version == self._versions[i]

    def _point_at_buffer(self, i: int, p: Tensor) -> None:
        """``p.grad`` becomes its zeroed alias, except for an unhooked (frozen) parameter with
        no gradient: it keeps ``None``, so a gradient after unfreezing arrives as a fresh
        tensor that ``collect`` sees."""
        if p.grad is not None or i in self._hooks:
            p.grad = self._aliases[i]

    # ----------------------------------------------------------------------------- per step
    def collect(self) -> list[bool]:
        """Make sure every ``p.grad`` is its view of the gradient buffer and return which
        parameters hold a gradient on this rank.

        A gradient the user assigned (``p.grad = g``, or one autograd allocated after
        ``model.zero_grad()`` set it to None) is copied into the buffer; a None gradient
        becomes a zeroed view again, and counts as no gradient.
        """
        for i, (name, p) in enumerate(zip(self.names, self.plist, strict=True)):
            view = self.params.full_view(name)
            if view.numel() and p.data_ptr() != view.data_ptr():
                raise RuntimeError(
                    f"parameter {name!r} was re-bound (p.data = ..., module.to(...), .half()) "
                    "after the optimizer moved it into its flat buffer, so updates would no "
                    "longer reach it; change parameters in place (p.data.copy_(...)) or build "
                    "the optimizer after moving or casting the model"
                )
            gview = self.grads.full_view(name)
            grad = p.grad
            if self.reduced and self._reuses_reduced(i, grad):
                raise RuntimeError(
                    f"the gradient of {name!r} is still the one the last step() reduced in place "
                    "(in drop-in mode only this rank's segment of the gradient buffer holds "
                    "averaged values afterwards), or a backward added onto it; call "
                    "optimizer.zero_grad() (or model.zero_grad()) between steps"
                )
            if grad is None:
                gview.zero_()
                self._point_at_buffer(i, p)
                self.has_grad[i] = False
            elif not is_view_of(gview, grad):
                self._check_grad(name, p, grad)
                gview.copy_(grad)
                p.grad = self._aliases[i]
                self.has_grad[i] = True
        self.reduced = False  # every region was zeroed or overwritten
        self._hook_trainable()
        return list(self.has_grad)

    def reduce_scatter(self) -> CommHandle:
        """Average the gradient buffer into this rank's segment, in place (async). The rest
        of the buffer is scratch until ``zero_grad``, which lets gloo use an in-place all-reduce
        instead of its copying reduce-scatter."""
        self.reduced = True
        self._versions = [alias._version for alias in self._aliases]
        self._stale = [None] * len(self.plist)
        return reduce_scatter_flat(
            self.grads.shard,
            self.grads.full,
            self.mesh.shard_group,
            "avg",
            async_op=True,
            scratch_input=True,
        )

    def all_reduce_replicas(self) -> CommHandle:
        """HSDP: average this rank's reduced segment over the replicate dimension (async)."""
        return all_reduce_flat(self.grads.shard, self.mesh.replicate_group, "avg", async_op=True)

    def all_gather(self) -> CommHandle:
        """Gather the updated parameter segments into the full buffer, in place (async)."""
        return all_gather_flat(
            self.params.full, self.params.shard, self.mesh.shard_group, async_op=True
        )

    def zero_grad(self, set_to_none: bool) -> None:
        """Zero the gradient buffer (one memset); ``set_to_none`` forgets which parameters had
        gradients, as setting them to None would in torch."""
        self.grads.full.zero_()
        self.reduced = False
        self._hook_trainable()
        for i, (name, p) in enumerate(zip(self.names, self.plist, strict=True)):
            view = self.grads.full_view(name)
            if not is_view_of(view, p.grad):
                self.has_grad[i] = p.grad is not None
                self._point_at_buffer(i, p)
            if set_to_none:
                self.has_grad[i] = False
                if i not in self._hooks:  # frozen: a gradient after unfreezing must be fresh
                    p.grad = None
