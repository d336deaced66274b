"""Optimizer state of a sharded optimizer: allocation, accounting and checkpoints.

The step runtime (:mod:`raggedfsdp.optim.base`) only reads state; everything that creates,
measures, saves or replaces it lives here, as the mixin ``ShardedState`` that
``ShardedOptimizer`` inherits. It fulfils the state half of the contract in
:mod:`raggedfsdp.optim.contract`: each parameter gets exactly the tensors its optimizer declares
with ``_state_specs``, zero at first, and parameters that step together share one step counter.

In the sharded modes state is allocated eagerly, packed per group in the order of the parameters'
memory, so that neighbouring parameters' state is neighbouring too and element-wise updates run
on whole runs (see ``pieces.merge_runs``). Every sharded state tensor is a ``RaggedTensor`` with
the parameter's global shape (or, for per-block state, the block grid's), so ``state_dict()`` can
be saved with ``torch.distributed.checkpoint`` and loaded at any other world size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from copy import deepcopy
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from raggedfsdp.optim.contract import Mode, OptimizerHooks, Piece, StateBytes, StateSpec
from raggedfsdp.optim.pieces import storage_bytes, unwrap
from raggedfsdp.sharding import RaggedTensor
from raggedfsdp.sharding.tp_shard import TPShard, tp_of

__all__ = ["ShardedState", "names_from"]


class ShardedState(OptimizerHooks):
    """The state methods of ``ShardedOptimizer`` (mixed in before ``torch.optim.Optimizer``,
    whose ``state``, ``param_groups`` and ``state_dict`` it builds on)."""

    state: Any
    param_groups: list[dict[str, Any]]
    _pieces: dict[Tensor, Piece]
    #: What the step plans once and reuses while the state stays (the runtime's per-group
    #: lists, an optimizer's merged runs); dropped whenever state tensors are created or
    #: replaced (``_forget_plans``).
    _group_plans: dict[int, Any]
    _step_plans: dict[Any, Any]
    #: Parameter names from the model being loaded into (see ``names_from``).
    _model_names: Mapping[Tensor, str] = MappingProxyType({})

    def _allocate(self, pieces: Sequence[Piece]) -> None:
        """Create zero state for ``pieces`` (one group): per-parameter tensors in single mode,
        packed flat buffers in address order in the sharded modes. Pieces allocated together
        share a step counter per device."""
        if not pieces:
            return
        self._forget_plans()
        group = self.param_groups[pieces[0].group_index]
        specs = {pc: self._state_specs(pc, group) for pc in pieces}
        packed = _packed_state([pc for pc in pieces if pc.sharded], specs)
        steps: dict[torch.device, Tensor] = {}
        for pc in pieces:
            device = pc.param.device
            if device not in steps:
                steps[device] = self._new_step(group, device)
            state: dict[str, Tensor] = {"step": steps[device]}
            for key, spec in specs[pc].items():
                if pc.sharded:
                    state[key] = packed[pc][key]
                elif spec.shape is None and spec.dtype == pc.param.dtype:
                    state[key] = torch.zeros_like(pc.param, memory_format=torch.preserve_format)
                else:
                    shape = spec.shape if spec.shape is not None else pc.param.shape
                    state[key] = torch.zeros(shape, dtype=spec.dtype, device=device)
            self.state[pc.param] = state

    def _forget_plans(self) -> None:
        """State tensors are about to be created or replaced: plans that hold them go."""
        self._group_plans.clear()
        self._step_plans.clear()

    def init_state(self) -> None:
        """Create the (zero) state of every parameter that has none yet.

        The sharded modes do this at construction; in single mode state appears at the first
        step, as in torch. Call it before loading a checkpoint into a fresh optimizer with
        ``torch.distributed.checkpoint.load``, which loads into existing tensors.
        """
        for group in self.param_groups:
            self._allocate([self._pieces[p] for p in group["params"] if p not in self.state])

    def state_bytes(self, mode: Mode | None = None) -> StateBytes:
        """Optimizer-state memory on this rank, over all parameters or those of one mode."""
        pieces = [pc for pc in self._pieces.values() if mode in (None, pc.mode)]
        tensors = [t for pc in pieces for t in self.state.get(pc.param, {}).values()]
        return StateBytes(
            storage_bytes(tensors),
            sum(pc.numel for pc in pieces),
            sum(pc.param.numel() for pc in pieces),
        )

    # ----------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's format (``state`` by parameter index, ``param_groups``); values are the live
        state tensors (``RaggedTensor`` in sharded modes, for DCP), except ``step`` which is a
        copy per parameter since counters are shared internally."""
        sd = super().state_dict()  # type: ignore[misc]  # torch.optim.Optimizer's
        sd["state"] = {
            k: {key: (v.clone() if key == "step" else v) for key, v in s.items()}
            for k, s in sd["state"].items()
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from ``state_dict()`` (the same world size and layout), from torch's
        optimizer of the same kind, or one whose tensors are full (unsharded): each rank keeps
        its piece. Checkpoints at another world size go through DCP (see ``init_state``).

        Values are copied into this optimizer's tensors, which stay where they are, so DCP's
        in-place loading and this call compose.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        groups, saved_groups = self.param_groups, deepcopy(state_dict["param_groups"])
        self._check_loadable(saved_groups)
        index = {
            old: p
            for g, sg in zip(groups, saved_groups, strict=True)
            for old, p in zip(sg["params"], g["params"], strict=True)
        }
        saved_state = state_dict["state"]
        for old, p in index.items():  # every check first: a refused load changes nothing
            if saved_state.get(old) is not None:
                self._check_state(self._pieces[p], saved_state[old])
        values: dict[Tensor, float] = {}
        for old, p in index.items():
            saved = saved_state.get(old)
            if saved is None:
                self._reset_state(p)
                continue
            if p not in self.state:
                self._allocate([self._pieces[p]])
            self._copy_state(self._pieces[p], saved)
            values[p] = float(saved["step"])
        for gi, (g, sg) in enumerate(zip(groups, saved_groups, strict=True)):
            for key, value in g.items():  # options newer than the checkpoint keep this group's
                sg.setdefault(key, value)
            sg["params"] = g["params"]
            if "param_names" in g:
                sg["param_names"] = g["param_names"]
            self.param_groups[gi] = sg
            self._share_steps(sg, [p for p in g["params"] if p in values], values)
        self._forget_plans()  # (the loaded values went into the same tensors; counters are new)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _check_loadable(self, saved_groups: Sequence[dict[str, Any]]) -> None:
        """Refuse saved groups that do not match this optimizer's, before anything changes."""
        groups = self.param_groups
        if len(groups) != len(saved_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer "
                f"{len(groups)}"
            )
        for gi, (g, sg) in enumerate(zip(groups, saved_groups, strict=True)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"parameter group {gi} has {len(g['params'])} parameters but the loaded "
                    f"state dict's has {len(sg['params'])}"
                )
            for key in self._state_keys_depend_on:
                if key in sg and sg[key] != g[key]:
                    raise ValueError(
                        f"parameter group {gi} was saved with {key}={sg[key]!r} but this optimizer "
                        f"has {key}={g[key]!r}; build it with the same setting to load its state"
                    )

    def _reset_state(self, p: Tensor) -> None:
        """No saved state for ``p``: as if it had never stepped."""
        self._forget_plans()
        piece = self._pieces[p]
        if not piece.sharded:
            self.state.pop(p, None)
            return
        state = self.state[p]
        for key, t in state.items():
            if key != "step":
                unwrap(t).zero_()
        state["step"] = self._new_step(self.param_groups[piece.group_index], p.device)

    def _check_state(self, piece: Piece, saved: dict[str, Any]) -> None:
        """Refuse a saved entry that ``_copy_state`` could not load into ``piece``'s state
        (allocated, or as it would be: shape-only tensors on the meta device)."""
        state = self.state.get(piece.param)
        if state is None:
            group = self.param_groups[piece.group_index]
            state = {"step": torch.empty(())}
            for key, spec in self._state_specs(piece, group).items():
                shape = spec.shape if spec.shape is not None else piece.param.shape
                state[key] = torch.empty(shape, dtype=spec.dtype, device="meta")
        if set(saved) != set(state):
            raise ValueError(
                f"parameter {self._label(piece)}: the loaded state has keys {sorted(saved)} but "
                f"{type(self).__name__} keeps {sorted(state)} for it (a checkpoint of another "
                "optimizer, or other settings such as amsgrad / block size?)"
            )
        for key, dst in state.items():
            if key != "step":
                what = f"{self._label(piece)} state {key!r}"
                _copy_into(what, dst, saved[key], check_only=True)

    def _label(self, piece: Piece) -> str:
        """How load errors name ``piece``: a parameter given without a name (known only by
        its position) also by its name in the model, when the model being loaded into, or
        fully_shard (which names each shard after its parameter), knows it."""
        if not piece.name.startswith("param_groups["):
            return repr(piece.name)
        fqn = self._model_names.get(piece.param)
        if fqn is None and piece.mode == "fsdp" and piece.spec is not None:
            fqn = piece.spec.name or None
        return f"{fqn!r} ({piece.name})" if fqn else repr(piece.name)

    def _split_by_tp(self, piece: Piece, tp: TPShard) -> str:
        """How refusals of a TP-split parameter begin: the parameter, and the mesh dim that
        splits it (``tp``, or ``ep`` for experts, which take the same path)."""
        names = tp.mesh.mesh_dim_names
        if not names:
            dim = "a tensor-parallel mesh dim"
        elif len(names) == 1:
            dim = f"the {names[0]!r} mesh dim"
        else:
            dim = f"the {' x '.join(map(repr, names))} mesh dims"
        split = f"{tp.placement!r} over {' x '.join(map(str, tp.mesh.shape))} ranks"
        return f"parameter {self._label(piece)} is split over {dim} ({split})"

    def _check_split_dims(self, piece: Piece) -> None:
        """Refuse, at construction, a parameter split on several mesh dims (EP x TP experts)
        for an optimizer whose math knows one TP split only (``handles_multi_dim_tp`` unset:
        a subclass written for 1-D TP), naming the fix."""
        tp = tp_of(piece.spec)
        if tp is None or len(tp.dims) < 2 or self.handles_multi_dim_tp:
            return
        kind = type(self).__name__
        raise ValueError(
            f"{self._split_by_tp(piece, tp)}: {kind} knows pieces split on one mesh dim, not "
            f"{len(tp.dims)} (handles_multi_dim_tp unset); give it to AdamW, Muon, Shampoo or "
            f"SOAP (a param group of their own), or split it on one of {tp.mesh.mesh_dim_names} "
            "only"
        )

    def _copy_state(self, piece: Piece, saved: dict[str, Any]) -> None:
        """Copy a saved entry that ``_check_state`` accepted into ``piece``'s state."""
        for key, dst in self.state[piece.param].items():
            if key != "step":
                _copy_into(f"{self._label(piece)} state {key!r}", dst, saved[key])

    def _share_steps(
        self, group: dict[str, Any], params: Sequence[Tensor], values: dict[Tensor, float]
    ) -> None:
        """Give parameters with equal loaded step counts one shared counter again."""
        shared: dict[tuple[float, torch.device], Tensor] = {}
        for p in params:
            key = (values[p], p.device)
            if key not in shared:
                shared[key] = self._new_step(group, p.device).fill_(values[p])
            self.state[p]["step"] = shared[key]


@contextmanager
def names_from(model: nn.Module, optimizers: Iterable[Any]) -> Iterator[None]:
    """Within the block, load errors of the sharded ``optimizers`` name parameters they were
    given without names by their names in ``model`` (``set_optimizer_state_dict`` has both)."""
    names: dict[Tensor, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, name)  # a tied parameter by its first name, as state dicts do
    ours = [o for o in optimizers if isinstance(o, ShardedState)]
    for o in ours:
        o._model_names = names
    try:
        yield
    finally:
        for o in ours:
            del o._model_names  # back to the class's empty mapping


def _packed_state(
    pieces: Sequence[Piece], specs: dict[Piece, dict[str, StateSpec]]
) -> dict[Piece, dict[str, Tensor]]:
    """Zero state of sharded ``pieces`` as views of one flat buffer per (key, dtype, device),
    each filled in the order of the parameters' memory."""
    order = sorted(pieces, key=lambda pc: (str(pc.param.device), unwrap(pc.local()).data_ptr()))
    packed: dict[Piece, dict[str, Tensor]] = {pc: {} for pc in order}
    by_kind: dict[tuple[str, torch.dtype, torch.device], list[Piece]] = {}
    for pc in order:
        for key, spec in specs[pc].items():
            by_kind.setdefault((key, spec.dtype, pc.param.device), []).append(pc)
    for (key, dtype, device), members in by_kind.items():
        total = sum(specs[pc][key].numel for pc in members)
        buf = torch.zeros(total, dtype=dtype, device=device)
        offset = 0
        for pc in members:
            n = specs[pc][key].numel
            spec = specs[pc][key]
            packed[pc][key] = pc.wrap(buf[offset : offset + n], spec.shard, spec.over)
            offset += n
    return packed


def _copy_into(what: str, dst: Tensor, src: Any, check_only: bool = False) -> None:
    """Copy a loaded value into a state tensor: same split, or a full tensor to slice.
    ``check_only``: raise what the copy would, copy nothing."""
    if not isinstance(src, Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(src).__name__}")
    if not dst.is_floating_point() and src.dtype != dst.dtype:
        raise TypeError(f"{what}: dtype {src.dtype} where {dst.dtype} is kept")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{what}: shape {tuple(src.shape)} where {tuple(dst.shape)} is kept")
    if isinstance(src, RaggedTensor):
        if not isinstance(dst, RaggedTensor) and src.ragged_shard.world_size == 1:
            if not check_only:
                dst.copy_(src.local.view(dst.shape))
            return
        if not isinstance(dst, RaggedTensor) or src.ragged_shard != dst.ragged_shard:
            raise ValueError(
                f"{what} was saved with another sharding ({getattr(src, 'ragged_shard', None)}); "
                "load resharded checkpoints with torch.distributed.checkpoint (DCP), or pass "
                "full tensors"
            )
        if check_only:
            return
        if src.local.data_ptr() != dst.local.data_ptr() or not src.local.numel():
            dst.local.copy_(src.local)
        return
    if check_only:
        return
    if isinstance(dst, RaggedTensor):  # a full tensor: this rank's piece (its TP block first)
        dst.local.copy_(dst.piece_of(src).view_as(dst.local))
        return
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)
