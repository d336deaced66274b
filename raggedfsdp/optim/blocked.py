"""``BlockedOptimizer``: what Shampoo and SOAP share besides their math.

Both precondition ``B × B`` blocks of a parameter's matrix view (``ShampooBlocks``; the block
structure is set by ``max_preconditioner_dim``, ``merge_dims`` and ``precondition_1d``, one
value per optimizer because it decides the shard layout). This base class owns that structure:
the shard policy (one slab per unit, so blocks are whole on ranks), the parameter checks, the
per-slab state (declared by each optimizer as global shapes, slabs first, split by whole slabs
on their owners) and the ``SlabRunner`` that computes each slab where it lies or on its owner;
for TP parameters whose TP split cuts the global tensor's blocks, the ``TPSlabRunner`` that
computes each global slab on an owner over TP × data parallel (``tp_slabs``).
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
from raggedfsdp.optim.slabs import SlabGeometry, SlabRunner, Slabs, SlabTask, SlabWork
from raggedfsdp.optim.tp_slabs import TPSlabGeometry, TPSlabRunner
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
    #: EP x TP experts (split on ``ep`` and ``tp``) take the owner path of ``tp_slabs``.
    handles_multi_dim_tp = True

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
        self._tp_runner = TPSlabRunner(self._global_blocks)
        self._cut: dict[Piece, bool] = {}
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
        """The blocks ``SlabRunner`` runs on: the parameter's, or for a TP-split one whose TP
        blocks hold whole blocks, its TP block's (those are the global tensor's blocks)."""
        tp = tp_split_of(piece.spec)
        blocks = self._blocks_of_shape(_math_shape(piece, tp))
        if blocks is None:
            raise ValueError(f"parameter {piece.name!r} is not preconditioned with blocks")
        return blocks

    def _global_blocks(self, piece: Piece) -> Slabs:
        """The global tensor's blocks (``TPSlabRunner``'s, for TP-cut parameters)."""
        blocks = self._blocks_of_shape(tuple(piece.param.shape))
        if blocks is None:
            raise ValueError(f"parameter {piece.name!r} is not preconditioned with blocks")
        return blocks

    def _cut_by_tp(self, piece: Piece) -> bool:
        """Whether the TP split cuts the global tensor's blocks, so its slabs are computed on
        owners over TP × data parallel (``tp_slabs``) rather than in each TP block. A tensor
        split on several mesh dims (EP x TP experts) always takes the owner path: its TP
        blocks' state is no ``Shard`` of the global state (a row split after the expert dim
        interleaves the ranks' slabs), while slabs held whole by their owner still move
        nothing there."""
        if piece not in self._cut:
            tp = tp_split_of(piece.spec)
            cut = tp is not None and self._preconditioned(piece)
            self._cut[piece] = cut and (len(tp.dims) > 1 or not self._tp_blocks_whole(tp))
        return self._cut[piece]

    def _tp_blocks_whole(self, tp: TPShard) -> bool:
        """Whether blocking each TP block's tensor gives the global tensor's blocks: the TP
        split runs along the blocked view's first two dims, through block boundaries, and (on
        the first) holds a contiguous run of its rows (the view's rows, or its second dim,
        whose blocks and columns are outermost in the state's flat order, so the TP blocks'
        state is a ``Shard`` of the global state)."""
        whole, local = self._blocks_of_shape(tp.global_shape), self._blocks_of_shape(tp.local_shape)
        dims = [] if local is None else _split_dims(whole, local, tp.size)
        i = dims[0] if len(dims) == 1 else -1
        return i in (0, 1) and bool(i or tp.contiguous_run) and local.dims[i] % local.sides[i] == 0

    def _geometry(self, piece: Piece) -> SlabGeometry | TPSlabGeometry:
        runner = self._tp_runner if self._cut_by_tp(piece) else self._runner
        return runner.geometry(piece)

    def _run_slabs(
        self,
        work: Sequence[SlabWork],
        compute: Callable[[list[SlabTask]], list[Tensor]],
        stats: dict[str, int],
    ) -> None:
        """Every slab of ``work`` computed by ``compute``: TP-cut parameters' on owners over
        TP × data parallel, the others where they lie or on an owner over data parallel."""
        cut = [w for w in work if self._cut_by_tp(w.piece)]
        rest = [w for w in work if not self._cut_by_tp(w.piece)]
        if rest:
            self._runner.run(rest, compute, stats)
        if cut:
            self._tp_runner.run(cut, compute, stats)

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
        if tp is not None and self.merge_dims and self._preconditioned(piece):
            raise ValueError(
                f"{self._split_by_tp(piece, tp)}: {name}(merge_dims=True) would merge dims "
                "across the TP split; use merge_dims=False, or AdamW for it"
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
        if self._cut_by_tp(piece):
            return self._tp_slab_specs(piece, group)
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

    def _tp_slab_specs(self, piece: Piece, group: dict[str, Any]) -> dict[str, StateSpec]:
        """The per-slab state of a TP-cut parameter: the global tensor's, whole slabs on their
        owners over TP × data parallel (``TPSlabGeometry``)."""
        geo = self._tp_runner.geometry(piece)
        dtype, specs = self._factor_dtype(piece), {}
        for key, shape in self._slab_shapes(geo.blocks, group).items():
            per_slab = math.prod(shape[1:])
            shard = geo.slab_shard(f"{piece.name}.{key}", shape, per_slab)
            over = (geo.rank, geo.group)
            specs[key] = StateSpec(geo.num_owned * per_slab, dtype, shape, shard, over)
        return specs

    def _slab_state(self, piece: Piece) -> dict[str, Tensor]:
        """This rank's per-slab state tensors, viewed ``(owned slabs, *shape[1:])``."""
        geo = self._geometry(piece)
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
