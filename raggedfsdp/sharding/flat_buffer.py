"""``FlatBuffer``: one group's storage for one dtype, with every tensor a view of its slice.

FSDP2 keeps parameters as separate tensors, so each all-gather copies shards into a staging
buffer and copies the gathered result back out (and the reverse for reduce-scatter). Here the
planned layout *is* the storage: the local segment is the all-gather input and the reduce-scatter
output, the full ``W * S`` buffer is the all-gather output and the reduce-scatter input, and the
tensors users and optimizers see are views of those two. Nothing is copied around a collective.

Freeing the full buffer shrinks its storage to zero bytes instead of dropping the tensor, so the
views handed out earlier (parameters, ``.grad``) stay the same Python objects and become valid
again after the next ``alloc_full()`` - the trick FSDP2 uses for its unsharded parameters.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from raggedfsdp.sharding.planner import Layout

__all__ = ["FlatBuffer"]


class FlatBuffer:
    """Storage of one planned group for one dtype and device.

    Args:
        layout: the group's plan.
        rank: this process's rank in the shard dimension.
        dtype, device: of the storage (may differ from the planned dtype, e.g. a bf16 all-gather
            buffer planned with fp32 master weights; the layout is in elements).
        persistent_full: keep the full buffer allocated and make the local segment a view of it
            (drop-in ZeRO-1/2 mode, where parameters stay replicated); otherwise the segment is
            its own allocation and the full buffer exists only between ``alloc_full`` and
            ``free_full`` (ZeRO-3 / FSDP mode).
        with_shard: allocate the local segment; ``False`` for a buffer used only in full (a
            reduce-scatter input whose outputs are fresh tensors), saving S elements.
    """

    def __init__(
        self,
        layout: Layout,
        rank: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        persistent_full: bool = False,
        with_shard: bool = True,
        pin_memory: bool = False,
    ) -> None:
        _check_world(layout, rank)
        self.layout = layout
        self.rank = rank
        self.persistent_full = persistent_full
        seg, world = layout.segment_size, layout.world_size
        start, stop = layout.segment(rank)
        # Zero-filled: padding must hold zeros so whole-segment math (norms, fused updates)
        # never reads garbage.
        self.full = torch.zeros(world * seg, dtype=dtype, device=device)
        if persistent_full:
            self.shard = self.full[start:stop]
        else:
            size = seg if with_shard else 0  # pinned host memory: CPU offload's fast copies
            self.shard = torch.zeros(size, dtype=dtype, device=device, pin_memory=pin_memory)
        self._full_views = {
            t.name: self.full[off : off + t.numel].view(t.shape)
            for t, off in ((t, layout.offsets[t.name]) for t in layout.tensors)
        }
        self._shard_views = {name: self.shard[0:0] for name in layout.by_name}
        if self.shard.numel():
            for name, seg_off, _, length in layout.local_pieces(rank):
                self._shard_views[name] = self.shard[seg_off : seg_off + length]
        if not persistent_full:
            self.free_full()  # after making the views: a view of freed storage cannot be made

    # ----------------------------------------------------------------------------- views
    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype

    @property
    def device(self) -> torch.device:
        return self.full.device

    def full_view(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (global shape) as a view of the full buffer."""
        return self._full_views[name]

    def shard_view(self, name: str) -> torch.Tensor:
        """This rank's piece of ``name``: a 1-D view of the local segment (maybe empty)."""
        return self._shard_views[name]

    @property
    def full_views(self) -> Mapping[str, torch.Tensor]:
        return self._full_views

    # ----------------------------------------------------------------------------- lifetime
    @property
    def is_full_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def alloc_full(self) -> torch.Tensor:
        """Give the full buffer its memory back (contents undefined) and return it."""
        storage = self.full.untyped_storage()
        nbytes = self.full.numel() * self.full.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return self.full

    def free_full(self) -> None:
        """Release the full buffer's memory; its views stay valid objects for the next alloc."""
        if self.persistent_full:
            raise RuntimeError(
                "free_full() on a persistent_full FlatBuffer would free the local segment too; "
                "create the buffer with persistent_full=False to reshard"
            )
        self.full.untyped_storage().resize_(0)

    # ----------------------------------------------------------------------------- data movement
    @torch.no_grad()
    def load_full_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's pieces of full tensors (e.g. freshly initialised, identical on every
        rank) into the local segment. No communication; parameters that require grad are fine
        (the copy is not recorded by autograd)."""
        missing = set(self.layout.by_name) - set(tensors)
        if missing:
            raise KeyError(f"load_full_tensors: no tensor given for {sorted(missing)}")
        for name, _, tensor_off, length in self.layout.local_pieces(self.rank):
            src = tensors[name]
            spec = self.layout.by_name[name]
            if tuple(src.shape) != spec.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(src.shape)} but the layout planned "
                    f"{spec.shape}; re-plan the group for the new shape"
                )
            self._shard_views[name].copy_(src.reshape(-1)[tensor_off : tensor_off + length])

    @torch.no_grad()
    def load_shard(self, segment: torch.Tensor) -> None:
        """Copy this rank's pieces from a tensor laid out like ``shard`` (e.g. the segment of
        another buffer, moved to this one's device), leaving the padding zero."""
        for name, seg_off, _, length in self.layout.local_pieces(self.rank):
            self._shard_views[name].copy_(segment[seg_off : seg_off + length])

    def zero_full_padding(self) -> None:
        """Zero the padding between tensors in the full buffer (e.g. a freshly allocated
        gradient buffer, whose padding must reduce to zero)."""
        for start, stop in self.layout.gaps():
            self.full[start:stop].zero_()


def _check_world(layout: Layout, rank: int) -> None:
    """Refuse a layout planned for another number of ranks, naming both counts and the fix.

    Only what is certain is checked: a shard group is never larger than the process group,
    so a layout planned for more ranks than are running is wrong; one planned for fewer may be
    an HSDP shard group or a subgroup, and is refused only when ``rank`` falls outside it.
    Without a process group any layout is fine (one process standing in for any rank).
    """
    planned = layout.world_size
    running = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if running is not None and planned > running:
        raise ValueError(
            f"FlatBuffer: layout planned for {planned} ranks, running on {running}: plan with "
            f"world_size={running} (or run on {planned} ranks)"
        )
    if not 0 <= rank < planned:
        where = "" if running is None else f", running on {running}"
        raise ValueError(
            f"FlatBuffer: rank={rank} is outside the layout planned for {planned} ranks{where}: "
            "plan with world_size=<the shard group's size> and pass this process's rank in it"
        )
