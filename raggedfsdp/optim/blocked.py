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
from raggedfsdp.optim.slabs import SlabRunner, Slabs
from raggedfsdp.sharding import ShardPolicy
from raggedfsdp.sharding.blocks import ShampooBlocks
from raggedfsdp.sharding.tp_shard import TPRaggedShard, TPShard, tp_split_of
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

    handles_tensor_parallel = True

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

    def _blocks_of_shape(self, shape: tuple[int, ...]) -> Slabs | None:
        """The blocks of a tensor of ``shape``, or None where it is not preconditioned."""
        dim = self.max_preconditioner_dim
        if not shampoo_blocked(shape, dim, self.merge_dims, self.precondition_1d):
            return None
        return ShampooBlocks.of(shape, dim, self.merge_dims, self.precondition_1d)

    def _preconditioned(self, piece: Piece) -> bool:
        """Decided on the global shape, as on one process."""
        return self._blocks_of_shape(tuple(piece.param.shape)) is not None

    def _blocks(self, piece: Piece) -> Slabs:
        """The blocks the math runs on: the parameter's, or for a TP-split one its TP block's
        (``_check_tp_blocks`` made sure those are the global tensor's blocks)."""
        tp = tp_split_of(piece.spec)
        blocks = self._blocks_of_shape(_math_shape(piece, tp))
        if blocks is None:
            raise ValueError(f"parameter {piece.name!r} is not preconditioned with blocks")
        return blocks

    def _check_tp_blocks(self, piece: Piece, tp: TPShard) -> None:
        """A TP-split parameter is preconditioned in the blocks of its global tensor (as on
        one process) by blocking each TP block's tensor: that needs the TP split to run along
        of the blocked view's first two dims, through block boundaries, and (on the first)
        to hold a contiguous run of its rows. Refused otherwise, naming the fix."""
        name = type(self).__name__
        where = self._split_by_tp(piece, tp)
        if self.merge_dims:
            raise ValueError(
                f"{where}: {name}(merge_dims=True) would merge dims across the TP split; use "
                "merge_dims=False, or AdamW for it"
            )
        whole, local = self._blocks_of_shape(tp.global_shape), self._blocks_of_shape(tp.local_shape)
        dims = [] if local is None else _split_dims(whole, local, tp.size)
        # the view's rows (a contiguous run of them), or its second dim, whose blocks and
        # columns are outermost in the state's flat order (so the TP blocks' state is a Shard)
        i = dims[0] if len(dims) == 1 else -1
        if i in (0, 1) and (i or tp.contiguous_run) and local.dims[i] % local.sides[i] == 0:
            return
        sides = None if whole is None else whole.sides
        raise ValueError(
            f"{where}: its TP block {tp.local_shape} does not hold whole blocks {sides} of the "
            f"global {tp.global_shape} tensor (max_preconditioner_dim="
            f"{self.max_preconditioner_dim}); choose a max_preconditioner_dim that divides the "
            "TP block along the split dim, split on the first or last dim, or use AdamW for it"
        )

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
        tp = tp_split_of(piece.spec)
        if tp is not None and self._preconditioned(piece):
            self._check_tp_blocks(piece, tp)
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
        tp = tp_split_of(piece.spec)
        shapes = self._slab_shapes(geo.blocks, group)
        whole = shapes
        if tp is not None:  # the TP blocks' state is a Shard of the global tensor's
            whole = self._slab_shapes(self._blocks_of_shape(tp.global_shape), group)
        specs = {}
        for key, shape in shapes.items():
            per_slab = math.prod(shape[1:])
            shard = geo.slab_shard(piece, key, shape, per_slab)
            if tp is not None:
                (dim,) = [
                    i for i, (a, b) in enumerate(zip(whole[key], shape, strict=True)) if a != b
                ]
                shard = TPRaggedShard.of(shard, tp.derived(whole[key], dim))
            specs[key] = StateSpec(geo.num_owned * per_slab, dtype, whole[key], shard)
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


def _math_shape(piece: Piece, tp: TPShard | None) -> tuple[int, ...]:
    """The shape a piece's blocks are cut from: its TP block's under a TP split."""
    return tuple(piece.param.shape) if tp is None else tp.local_shape


def _split_dims(whole: Slabs | None, local: Slabs, degree: int) -> list[int]:
    """The dims of the blocked view the TP split runs along (``degree`` times smaller in the
    TP block), or ``[-1]`` when the two views differ otherwise (other sides or dims)."""
    if whole is None or whole.sides != local.sides or len(whole.dims) != len(local.dims):
        return [-1]
    dims = [i for i, (a, b) in enumerate(zip(whole.dims, local.dims, strict=True)) if a != b]
    return dims if all(whole.dims[i] == degree * local.dims[i] for i in dims) else [-1]
