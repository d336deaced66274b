"""The block contract between a sharded optimizer's math and the runtime that runs it.

An optimizer in ``raggedfsdp.optim`` writes only math; ``ShardedOptimizer`` decides where it
runs. This file is everything the two sides agree on.

**What an optimizer declares** (the hooks of :class:`OptimizerHooks`):

* ``shard_policy(**config)`` (classmethod): the unit, in elements, that each parameter must be cut
  into so that the math sees whole blocks (one element for AdamW, a quantisation block or tile for
  AdamW8bit, whole matrices for Muon, preconditioner rows for Shampoo). Users pass it to
  ``fully_shard``; the drop-in mode plans its own buffers with ``_policy()``, the same rule with
  the instance's settings. Both are resolved by ``raggedfsdp.sharding.units.resolve_units``.
* ``_check_piece(piece, group)``: refuse, once per parameter at construction, a parameter the math
  cannot handle (wrong rank of tensor, blocks cut by someone else's policy:
  :func:`check_unit_alignment`).
* ``_state_specs(piece, group)``: the state tensors of one parameter (``step`` excluded) as
  :class:`StateSpec`, in state-dict order.
* ``_new_step(group, device)``: a zero step counter of the dtype and device the math expects.
* ``_update(group, pieces, step)``: the math of one step.
* ``handles_tensor_parallel``: True once the math is right for pieces of TP-split parameters
  (their spec's ``TPShard`` says which TP block of the global tensor the piece is cut from).

**What the runtime guarantees** in return:

* *Which pieces.* ``_update`` gets the :class:`Piece` of every parameter of one group that has a
  gradient this step and shares one step counter: in single mode the whole parameter, in the
  sharded modes this rank's contiguous 1-D piece. The drop-in mode cuts only at multiples of the
  declared unit; ``fully_shard`` cuts where the policy it was given says, which is why
  ``_check_piece`` verifies fsdp pieces (:func:`check_unit_alignment`) when the math needs whole
  blocks. ``piece.local()`` and ``piece.local_grad()`` are the values to update and the
  (reduced, averaged) gradient; the drop-in reduce-scatter has finished before and the
  all-gather runs after.
* *Which state.* ``self.state[piece.param]`` holds exactly the declared specs, zero at first:
  created eagerly in the sharded modes (packed per group in parameter-address order, so that
  neighbouring parameters' state is neighbouring too), lazily at the first step in single mode.
  Sharded state tensors are ``RaggedTensor``s with the parameter's global shape (or the spec's).
* *When the step counter moves.* ``step`` is the value *before* this update; the runtime adds one
  after ``_update`` returns, once per shared counter (do not modify it). A parameter that misses a
  step gets a counter of its own from then on, so it stays behind; a step skipped for non-finite
  gradients moves nothing.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from raggedfsdp.sharding import RaggedShard, RaggedTensor, ShardPolicy

if TYPE_CHECKING:
    import torch.distributed as dist

    from raggedfsdp.optim.dropin import DropInBucket

__all__ = [
    "Mode",
    "OptimizerHooks",
    "Piece",
    "StateBytes",
    "StateSpec",
    "check_unit_alignment",
]

#: ``single``: plain parameters, one process (torch's behaviour); ``drop-in``: plain replicated
#: parameters kept in the optimizer's ZeRO-2 flat buffers; ``fsdp``: ``RaggedTensor`` parameters
#: from ``fully_shard`` (or built by hand), updated where they lie.
Mode = Literal["single", "drop-in", "fsdp"]


@dataclass(eq=False)
class Piece:
    """This rank's part of one parameter.

    ``spec`` is the parameter's split over ``pgroup`` (None in single mode, where the piece is the
    whole parameter in its own shape); ``bucket`` holds the flat buffers in drop-in mode.
    """

    param: Tensor
    name: str
    group_index: int
    mode: Mode
    spec: RaggedShard | None = None
    rank: int = 0
    pgroup: dist.ProcessGroup | None = None
    bucket: DropInBucket | None = None

    @property
    def sharded(self) -> bool:
        return self.mode != "single"

    @property
    def numel(self) -> int:
        """Elements this rank holds."""
        return self.param.numel() if self.spec is None else self.spec.length(self.rank)

    def local(self) -> Tensor:
        """The values to update in place: the parameter itself (single mode) or a 1-D view."""
        if self.mode == "fsdp":
            return self.param.local
        if self.mode == "drop-in":
            return self.bucket.params.shard_view(self.name)
        return self.param

    def local_grad(self) -> Tensor | None:
        """The (reduced) gradient of the local piece, or None when there is none."""
        if self.mode == "drop-in":
            return self.bucket.grads.shard_view(self.name)
        grad = self.param.grad
        if grad is None or self.mode == "single":
            return grad
        return grad.local

    def wrap(
        self,
        local: Tensor,
        spec: RaggedShard | None = None,
        over: tuple[int, dist.ProcessGroup | None] | None = None,
    ) -> Tensor:
        """A state tensor as users and checkpoints see it: a ``RaggedTensor`` with the global shape
        in sharded modes (``spec`` defaults to the parameter's, split over ``over`` = ``(rank,
        group)``, by default the parameter's), the tensor itself otherwise."""
        if not self.sharded:
            return local
        rank, group = over or (self.rank, self.pgroup)
        return RaggedTensor(local, spec or self.spec, rank, group)


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of one parameter, as a subclass declares it.

    Args:
        numel: elements on this rank (the whole tensor in single mode).
        dtype: of the state.
        shape: global shape; None means the parameter's (and ``zeros_like`` in single mode).
        shard: its global split in the sharded modes; None means the parameter's.
        over: ``(rank, group)`` that ``shard`` splits it over, where that is not the
            parameter's data-parallel group (a blocked optimizer's blocks owned over
            TP × data parallel); None means the parameter's.
    """

    numel: int
    dtype: torch.dtype
    shape: tuple[int, ...] | None = None
    shard: RaggedShard | None = None
    over: tuple[int, dist.ProcessGroup | None] | None = None


@dataclass(frozen=True)
class StateBytes:
    """Optimizer-state memory of this rank.

    ``state_bytes`` counts every state tensor this rank holds (step counters included, shared
    ones once); ``local_elements`` are the parameter elements it updates and ``global_elements``
    those of the whole parameters, so ``state_bytes / global_elements`` is the per-rank cost of
    one model element (8 / W bytes for fp32 AdamW sharded over W ranks).
    """

    state_bytes: int
    local_elements: int
    global_elements: int


class OptimizerHooks(ABC):
    """The hooks a sharded optimizer implements (see the module docstring for what the runtime
    promises around each). ``ShardedOptimizer`` inherits them; a subclass that leaves one out
    cannot be instantiated."""

    #: Group hyper-parameters that decide which state tensors exist; a checkpoint must agree.
    _state_keys_depend_on: tuple[str, ...] = ()
    #: Whether the math knows tensor-parallel pieces (``tp_split_of(piece.spec)``: a piece cut
    #: from one TP block of the global tensor). ``fully_shard`` refuses TP parameters at the
    #: first ``step()`` of an optimizer that does not, which would treat a TP block as the
    #: whole tensor; element-wise math needs nothing to set it.
    handles_tensor_parallel: bool = False
    #: Whether it also knows pieces of a tensor split on several mesh dims (EP x TP experts:
    #: ``Shard(0)`` over ``ep``, ``Shard(1)`` over ``tp``; ``len(tp.dims) > 1``). Refused at
    #: construction otherwise (``_check_split_dims``), before any state is laid out.
    handles_multi_dim_tp: bool = False

    @classmethod
    @abstractmethod
    def shard_policy(cls, **config: Any) -> ShardPolicy:
        """The unit each parameter must be cut into for this optimizer's math."""

    @abstractmethod
    def _policy(self) -> ShardPolicy:
        """``shard_policy`` with this instance's configuration."""

    @abstractmethod
    def _state_specs(self, piece: Piece, group: dict[str, Any]) -> dict[str, StateSpec]:
        """The state tensors of one parameter (``step`` excluded), in state-dict order."""

    @abstractmethod
    def _new_step(self, group: dict[str, Any], device: torch.device) -> Tensor:
        """A zero step counter of the dtype and device the update expects."""

    @abstractmethod
    def _update(self, group: dict[str, Any], pieces: Sequence[Piece], step: Tensor) -> None:
        """Update ``pieces`` (all with gradients, all at step ``step`` before this one). The
        runtime increments ``step`` afterwards; do not modify it."""

    def _check_piece(self, piece: Piece, group: dict[str, Any]) -> None:  # noqa: B027
        """Reject parameters the subclass cannot handle (called once per parameter); accepts
        every parameter unless overridden."""


def check_unit_alignment(piece: Piece, unit: int, why: str) -> None:
    """Raise unless every cut of a sharded parameter falls on a multiple of ``unit`` elements
    from its start (so each ``unit``-aligned block is whole on one rank)."""
    spec = piece.spec
    if spec is None or unit <= 1 or spec.unit % unit == 0:
        return  # every cut is a multiple of the spec's unit: O(1) whatever the world size
    for r, start in enumerate(spec.bounds[:-1]):
        if start % unit and start != spec.numel:
            raise ValueError(
                f"parameter {piece.name!r} (shape {tuple(spec.shape)}) is sharded with rank {r}'s "
                f"piece starting at element {start}, which cuts {why} of {unit} elements. Shard "
                f"it with this optimizer's policy (fully_shard(..., shard_policy="
                f"<Optimizer>.shard_policy(...))) so units are multiples of {unit} elements "
                f"(gcd now {math.gcd(start, unit)})"
            )
