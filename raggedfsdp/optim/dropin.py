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
without ``zero_grad()`` (or new ones from ``model.zero_grad()`` + backward) is an error rather
than a silently wrong update.
"""

from __future__ import annotations

import functools
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


def _mark(flags: list[bool], index: int, param: Tensor) -> None:
    flags[index] = True


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
        for name, p in zip(self.names, self.plist, strict=True):
            grad = p.grad
            if grad is not None:
                check_grad(name, p, grad)
                self.grads.full_view(name).copy_(grad)
            p.data = self.params.full_view(name)
            if grad is not None or p.requires_grad:  # see _point_at_buffer
                p.grad = self.grads.full_view(name)
        self._hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._hook_trainable()
        #: The gradient buffer was reduce-scattered in place: only this rank's segment holds
        #: averaged values, so it must be zeroed (or every gradient replaced) before reuse.
        self.reduced = False

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
                mark = functools.partial(_mark, self.has_grad, i)
                self._hooks[i] = p.register_post_accumulate_grad_hook(mark)

    def _point_at_buffer(self, i: int, p: Tensor, view: Tensor) -> None:
        """``p.grad`` becomes its zeroed view, except for an unhooked (frozen) parameter with
        no gradient: it keeps ``None``, so a gradient after unfreezing arrives as a fresh
        tensor that ``collect`` sees."""
        if p.grad is not None or i in self._hooks:
            p.grad = view

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
            if self.reduced and grad is not None and is_view_of(gview, grad):
                raise RuntimeError(
                    f"the gradient of {name!r} is still the one the last step() reduced in place "
                    "(in drop-in mode only this rank's segment of the gradient buffer holds "
                    "averaged values afterwards); call optimizer.zero_grad() between steps"
                )
            if grad is None:
                gview.zero_()
                self._point_at_buffer(i, p, gview)
                self.has_grad[i] = False
            elif not is_view_of(gview, grad):
                self._check_grad(name, p, grad)
                gview.copy_(grad)
                p.grad = gview
                self.has_grad[i] = True
        self.reduced = False  # every region was zeroed or overwritten
        self._hook_trainable()
        return list(self.has_grad)

    def reduce_scatter(self) -> CommHandle:
        """Average the gradient buffer into this rank's segment, in place (async). The rest
        of the buffer is scratch until ``zero_grad``, which lets gloo use an in-place all-reduce
        instead of its copying reduce-scatter."""
        self.reduced = True
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
                self._point_at_buffer(i, p, view)
            if set_to_none:
                self.has_grad[i] = False
                if i not in self._hooks:  # frozen: a gradient after unfreezing must be fresh
                    p.grad = None
