"""``BlockedOptimizer``: what Shampoo and SOAP share besides their math.

Both precondition ``B × B`` blocks of a parameter's matrix view (``ShampooBlocks``; the block
structure is set by ``max_preconditioner_dim``, ``merge_dims`` and ``precondition_1d``, one
value per optimizer because it decides the shard layout). This base class owns that structure:
the shard policy (one slab per unit, so blocks are whole on ranks), the parameter checks, the
per-slab state (declared by each optimizer as global shapes, slabs first, split by whole slabs
on their owners) and the ``SlabRunner`` that computes each slab where it lies or on its owner.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from raggedfsdp.comm.mesh import MeshLike
from raggedfsdp.optim.base import ShardedOptimizer
from raggedfsdp.optim.contract import Piece, StateSpec, check_unit_alignment
from raggedfsdp.optim.pieces import unwrap
from raggedfsdp.optim.slabs import SlabRunner
from raggedfsdp.sharding import ShardPolicy
from raggedfsdp.sharding.blocks import ShampooBlocks
from raggedfsdp.sharding.units import shampoo_blocked, shampoo_policy

__all__ = ["BlockedOptimizer"]


#: ``last_step_stats`` keys every blocked optimizer reports (each adds its own).
BLOCK_STATS = (
    "eigendecompositions",
    "eigh_cost",
    "eigh_batched",
    "fp64_retries",
    "root_failures",
    "blocks",
    "owner_slabs",
    "bytes_sent",
    "bytes_received",
)


class BlockedOptimizer(ShardedOptimizer):
    """A sharded optimizer whose math runs on whole ``B × B`` blocks (Shampoo, SOAP).

    Subclasses declare their per-slab state with ``_slab_shapes`` and read it with
    ``_slab_state``; they run their per-block math through ``self._runner``.
    """

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        max_preconditioner_dim: int,
        merge_dims: bool,
        precondition_1d: bool,
        factor_dtype: torch.dtype | None,
        mesh: MeshLike,
    ) -> None:
        if factor_dtype is not None and not factor_dtype.is_floating_point:
            raise ValueError(f"factor_dtype={factor_dtype} must be a floating-point dtype")
        self.max_preconditioner_dim = max_preconditioner_dim
        self.merge_dims = bool(merge_dims)
        self.precondition_1d = bool(precondition_1d)
        self.factor_dtype = factor_dtype
        self._runner = SlabRunner(self._blocks)
        self.last_step_stats: dict[str, int] = {}
        self._step_stats: dict[str, int] | None = None
        super().__init__(params, defaults, mesh=mesh)

    # ----------------------------------------------------------------------------- stats
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``ShardedOptimizer.step``; then ``last_step_stats`` sums this rank's counts over
        every param group of the step (``bytes_communicated`` = sent + received)."""
        self._step_stats = None
        loss = super().step(closure)
        stats = self._step_stats
        if stats is not None:
            stats["bytes_communicated"] = stats["bytes_sent"] + stats["bytes_received"]
            self.last_step_stats = stats
        return loss

    def _stats(self, keys: Sequence[str]) -> dict[str, int]:
        """The counts of the current step, shared by its param groups' updates."""
        if self._step_stats is None:
            self._step_stats = dict.fromkeys(keys, 0)
        return self._step_stats

    # ----------------------------------------------------------------------------- layout
    @classmethod
    def shard_policy(
        cls,
        max_preconditioner_dim: int = 1024,
        merge_dims: bool = False,
        precondition_1d: bool = False,
    ) -> ShardPolicy:
        """One slab (``min(B, rows)`` whole rows of the matrix view) per unit for preconditioned
        tensors, so every ``B × B`` block is whole on one rank; elements for the rest."""
        return shampoo_policy(max_preconditioner_dim, merge_dims, precondition_1d)

    def _policy(self) -> ShardPolicy:
        return self.shard_policy(self.max_preconditioner_dim, self.merge_dims, self.precondition_1d)

    def _preconditioned(self, piece: Piece) -> bool:
        shape = tuple(piece.param.shape)
        dim = self.max_preconditioner_dim
        return shampoo_blocked(shape, dim, self.merge_dims, self.precondition_1d)

    def _blocks(self, piece: Piece) -> ShampooBlocks:
        shape = tuple(piece.param.shape)
        dim = self.max_preconditioner_dim
        return ShampooBlocks.of(shape, dim, self.merge_dims, self.precondition_1d)

    def _check_piece(self, piece: Piece, group: dict[str, Any]) -> None:
        """Floating point, the optimizer's block size in every group, contiguous in single
        mode; with ``merge_dims``, a layout that keeps every merged block whole (merged blocks
        are shapes DistributedShampoo invented, so a layout cutting one is refused, not
        shipped)."""
        name = type(self).__name__
        if not piece.param.is_floating_point():
            raise ValueError(
                f"parameter {piece.name!r} has dtype {piece.param.dtype}; {name} needs floating "
                "point parameters"
            )
        if group["max_preconditioner_dim"] != self.max_preconditioner_dim:
            raise ValueError(
                f"param group of {piece.name!r} sets max_preconditioner_dim="
                f"{group['max_preconditioner_dim']!r}, but it decides the shard layout and must "
                f"be the optimizer's ({self.max_preconditioner_dim})"
            )
        if piece.mode == "single" and not piece.param.is_contiguous():
            raise ValueError(
                f"parameter {piece.name!r} is not contiguous; {name} views it as a matrix "
                "(p.data = p.data.contiguous())"
            )
        if self.merge_dims and self._preconditioned(piece):
            unit = self._policy()(piece.name, piece.param)
            check_unit_alignment(piece, unit, f"{name}'s merged blocks (merge_dims=True)")

    # ----------------------------------------------------------------------------- state
    def _factor_dtype(self, piece: Piece) -> torch.dtype:
        """Per-slab state dtype: ``factor_dtype``, else fp32 (fp64 for fp64 parameters)."""
        if self.factor_dtype is not None:
            return self.factor_dtype
        return torch.promote_types(piece.param.dtype, torch.float32)

    def _slab_shapes(self, blocks: ShampooBlocks, group: dict[str, Any]) -> dict[str, tuple]:
        """The per-slab state of a preconditioned parameter: key -> global shape, slabs first."""
        raise NotImplementedError

    def _slab_specs(self, piece: Piece, group: dict[str, Any]) -> dict[str, StateSpec]:
        """``StateSpec`` s of the per-slab state: this rank keeps the slabs it owns."""
        geo = self._runner.geometry(piece)
        dtype = self._factor_dtype(piece)
        specs = {}
        for key, shape in self._slab_shapes(geo.blocks, group).items():
            per_slab = math.prod(shape[1:])
            shard = geo.slab_shard(piece, key, shape, per_slab)
            specs[key] = StateSpec(geo.num_owned * per_slab, dtype, shape, shard)
        return specs

    def _slab_state(self, piece: Piece) -> dict[str, Tensor]:
        """This rank's per-slab state tensors, viewed ``(owned slabs, *shape[1:])``."""
        geo = self._runner.geometry(piece)
        state = self.state[piece.param]
        group = self.param_groups[piece.group_index]
        return {
            key: unwrap(state[key]).view(geo.num_owned, *shape[1:])
            for key, shape in self._slab_shapes(geo.blocks, group).items()
        }

    def _new_step(self, group: dict[str, Any], device: torch.device) -> Tensor:
        return torch.tensor(0.0, dtype=torch.float32)
