"""``ShardedOptimizer``: the base of every optimizer in ``raggedfsdp.optim``.

One class, three modes, the same user code:

* **single** (no process group, or a world of one): plain parameters, state shaped like them,
  created lazily at the first step; an optimizer here behaves exactly like its torch peer.
* **drop-in** (plain parameters under an initialized process group of more than one rank): ZeRO-2
  through :class:`~raggedfsdp.optim.dropin.DropInBucket`; each rank keeps 1/W of the state.
* **fsdp** (``RaggedTensor`` parameters, e.g. from ``fully_shard``): each rank updates the local
  pieces where they lie, with no communication.

In the sharded modes every state tensor is a ``RaggedTensor`` with the parameter's global shape
(or, for per-block state, the block grid's), so ``state_dict()`` can be saved with
``torch.distributed.checkpoint`` and loaded at any other world size. State is allocated eagerly
there, packed per group in the order of the parameters' memory, so that neighbouring parameters'
state is neighbouring too and element-wise updates run on whole runs (see ``pieces.merge_runs``).

Every optimizer declares the unit its math needs with the classmethod ``shard_policy``; the drop-in
mode plans its buffers with it and users pass it to ``fully_shard``, so both agree.

Step counters follow torch (``state[p]["step"]``) but parameters that step together share one
counter object, so the update of a group needs one bias correction, not one per parameter; a
parameter that misses a step gets its own counter from then on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from raggedfsdp.comm import ShardMesh, resolve_mesh
from raggedfsdp.comm.fingerprint import check_fingerprint, collective_device
from raggedfsdp.comm.mesh import MeshLike
from raggedfsdp.optim.checks import check_grad
from raggedfsdp.optim.dropin import DropInBucket
from raggedfsdp.optim.pieces import Mode, Piece, storage_bytes, unwrap
from raggedfsdp.sharding import RaggedShard, RaggedTensor, ShardPolicy

__all__ = ["ShardedOptimizer", "StateBytes", "StateSpec"]


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of one parameter, as a subclass declares it.

    Args:
        numel: elements on this rank (the whole tensor in single mode).
        dtype: of the state.
        shape: global shape; None means the parameter's (and ``zeros_like`` in single mode).
        shard: its global split in the sharded modes; None means the parameter's.
    """

    numel: int
    dtype: torch.dtype
    shape: tuple[int, ...] | None = None
    shard: RaggedShard | None = None


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


def _param_list(params: Any) -> list[Any]:
    if isinstance(params, Tensor):
        return [params]
    if isinstance(params, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the order of "
            "a set changes between runs; pass a list"
        )
    return list(params)


class ShardedOptimizer(Optimizer):
    """Base class: modes, sharded state, checks and checkpoints; subclasses write the math.

    Subclasses implement ``shard_policy`` (classmethod), ``_policy`` (the instance's rule),
    ``_state_specs``, ``_new_step`` and ``_update``.

    Args:
        params, defaults: as for ``torch.optim.Optimizer`` (named parameters welcome: errors
            then use the names).
        mesh: the ranks the drop-in mode shards over: a ``DeviceMesh`` (2-D: HSDP), a process
            group, or None for the default group. Ignored by single and fsdp pieces.
    """

    #: Group hyper-parameters that decide which state tensors exist; a checkpoint must agree.
    _state_keys_depend_on: tuple[str, ...] = ()

    #: Skip a step on every rank when any reduced gradient holds inf/NaN (one flag all-reduce
    #: per step when on). Off by default, as in torch, where such a step poisons the state;
    #: turn it on for long runs (``opt.skip_nonfinite_steps = True``). ``skipped_steps`` counts.
    skip_nonfinite_steps: bool = False

    def __init__(self, params: Any, defaults: dict[str, Any], *, mesh: MeshLike = None) -> None:
        self._mesh: ShardMesh = resolve_mesh(mesh)
        self.skipped_steps = 0
        self._pieces: dict[Tensor, Piece] = {}
        self._buckets: list[DropInBucket] = []
        self._built = False
        super().__init__(params, defaults)
        self._build(range(len(self.param_groups)))
        self._built = True

    # ----------------------------------------------------------------------------- subclass API
    @classmethod
    def shard_policy(cls, **config: Any) -> ShardPolicy:
        """The unit each parameter must be cut into for this optimizer's math."""
        raise NotImplementedError

    def _policy(self) -> ShardPolicy:
        """``shard_policy`` with this instance's configuration."""
        raise NotImplementedError

    def _state_specs(self, piece: Piece, group: dict[str, Any]) -> dict[str, StateSpec]:
        """The state tensors of one parameter (``step`` excluded), in state-dict order."""
        raise NotImplementedError

    def _new_step(self, group: dict[str, Any], device: torch.device) -> Tensor:
        """A zero step counter of the dtype and device the update expects."""
        raise NotImplementedError

    def _update(self, group: dict[str, Any], pieces: Sequence[Piece], step: Tensor) -> None:
        """Update ``pieces`` (all with gradients, all at step ``step`` before this one). The
        base class increments ``step`` afterwards; do not modify it."""
        raise NotImplementedError

    def _check_piece(self, piece: Piece, group: dict[str, Any]) -> None:
        """Reject parameters the subclass cannot handle (called once per parameter)."""

    # ----------------------------------------------------------------------------- construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, plus: a parameter in two groups (or twice in one) is an error that names
        it, and groups added after construction are set up (a collective in sharded modes, so
        every rank must add the same group)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        entries = _param_list(param_group["params"])
        param_group["params"] = entries
        index = len(self.param_groups)
        seen = {
            p: (gi, i) for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])
        }
        for i, entry in enumerate(entries):
            p = entry[1] if isinstance(entry, tuple) else entry
            label = repr(entry[0]) if isinstance(entry, tuple) else f"param_groups[{index}][{i}]"
            if isinstance(p, Tensor) and p in seen:
                gi, j = seen[p]
                where = repr(self._name(gi, j)) if gi < index else f"position {j}"
                raise ValueError(
                    f"parameter {label} (shape {tuple(p.shape)}) is already in param group {gi} "
                    f"(as {where}); a parameter may appear in only one group, once. Remove it "
                    "from one of them (e.g. split decay / no-decay by name)"
                )
            if isinstance(p, Tensor):
                seen[p] = (index, i)
        super().add_param_group(param_group)
        if self._built:
            try:
                self._build([index])
            except Exception:
                self.param_groups.pop()  # leave the optimizer as it was
                raise

    def _name(self, group_index: int, i: int) -> str:
        names = self.param_groups[group_index].get("param_names")
        return str(names[i]) if names else f"param_groups[{group_index}][{i}]"

    def _mode_of(self, p: Tensor) -> Mode:
        if isinstance(p, RaggedTensor):
            return "fsdp"
        if self._mesh.shard_size > 1 or self._mesh.replicate_size > 1:
            return "drop-in"
        return "single"

    def _build(self, group_indices: Iterable[int]) -> None:
        """Classify and check the parameters of new groups, check that ranks agree, plan the
        drop-in buffers and allocate the sharded state."""
        new: list[Piece] = []
        for gi in group_indices:
            group = self.param_groups[gi]
            for i, p in enumerate(group["params"]):
                piece = self._make_piece(p, self._name(gi, i), gi)
                self._check_piece(piece, group)
                new.append(piece)
        if self._mesh.shard_size > 1 or self._mesh.replicate_size > 1:
            check_fingerprint(self._mesh, [(pc.name, self._signature(pc)) for pc in new])
        policy = self._policy()
        for gi in group_indices:
            plain = [pc for pc in new if pc.group_index == gi and pc.mode == "drop-in"]
            kinds: dict[tuple[torch.dtype, torch.device], list[Piece]] = {}
            for pc in plain:
                kinds.setdefault((pc.param.dtype, pc.param.device), []).append(pc)
            for members in kinds.values():
                bucket = DropInBucket(
                    [pc.name for pc in members],
                    [pc.param for pc in members],
                    [max(1, policy(pc.name, pc.param)) for pc in members],
                    self._mesh,
                    check_grad,
                )
                self._buckets.append(bucket)
                for pc in members:
                    pc.bucket = bucket
                    pc.spec = bucket.layout.shards[pc.name]
                    pc.rank = self._mesh.shard_rank
                    pc.pgroup = self._mesh.shard_group
        for pc in new:
            self._pieces[pc.param] = pc
        for gi in group_indices:
            self._allocate([pc for pc in new if pc.group_index == gi and pc.sharded])

    def _make_piece(self, p: Tensor, name: str, gi: int) -> Piece:
        mode = self._mode_of(p)
        if p.is_complex():
            raise ValueError(
                f"parameter {name!r} is complex; raggedfsdp.optim works on real tensors: store it "
                "as torch.view_as_real(...) and view it as complex in forward"
            )
        if mode == "fsdp":
            local = p.local
            if local.dim() != 1 or not local.is_contiguous():
                raise ValueError(
                    f"parameter {name!r}: a RaggedTensor's local piece must be a contiguous 1-D "
                    f"view (got shape {tuple(local.shape)}, stride {local.stride()})"
                )
            return Piece(p, name, gi, mode, p.ragged_shard, p._rank, p._group)
        if mode == "drop-in" and not p.is_contiguous():
            raise ValueError(
                f"parameter {name!r} is not contiguous (shape {tuple(p.shape)}, stride "
                f"{p.stride()}); the drop-in sharded mode stores parameters row-major in a flat "
                "buffer. Make it contiguous before building the optimizer "
                "(p.data = p.data.contiguous())"
            )
        return Piece(p, name, gi, mode)

    def _signature(self, piece: Piece) -> str:
        group = self.param_groups[piece.group_index]
        hyper = sorted((k, repr(v)) for k, v in group.items() if k not in ("params", "param_names"))
        spec = piece.spec
        # hash(tuple of ints) is the same in every process (unlike str hashes) and stays short
        split = "" if spec is None else f" unit {spec.unit} split {hash(spec.units_per_rank)}"
        return (
            f"group {piece.group_index}, name {piece.name!r}, shape {tuple(piece.param.shape)}, "
            f"{piece.param.dtype}, {piece.mode}{split}, hyper-parameters {hyper}"
        )

    # ----------------------------------------------------------------------------- state
    def _allocate(self, pieces: Sequence[Piece]) -> None:
        """Create zero state for ``pieces`` (one group): per-parameter tensors in single mode,
        packed flat buffers in address order in the sharded modes. Pieces allocated together
        share a step counter per device."""
        if not pieces:
            return
        group = self.param_groups[pieces[0].group_index]
        steps: dict[torch.device, Tensor] = {}
        specs = {pc: self._state_specs(pc, group) for pc in pieces}
        order = sorted(
            (pc for pc in pieces if pc.sharded),
            key=lambda pc: (str(pc.param.device), unwrap(pc.local()).data_ptr()),
        )
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
                packed[pc][key] = pc.wrap(buf[offset : offset + n], specs[pc][key].shard)
                offset += n
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

    # ----------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce gradients (drop-in), update every parameter that has a gradient, gather the
        parameters (drop-in). With no gradient anywhere it changes nothing (no step counted)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        has_grad = self._gradient_flags()
        active = [b for b in self._buckets if any(has_grad[self._pieces[p]] for p in b.plist)]
        for handle in [b.reduce_scatter() for b in active]:
            handle.wait()
        if self._mesh.replicate_size > 1:
            for handle in [b.all_reduce_replicas() for b in active]:
                handle.wait()
        if self.skip_nonfinite_steps and not self._gradients_finite(has_grad):
            self.skipped_steps += 1  # nothing was updated: parameters and state stay as they were
            return loss
        for group in self.param_groups:
            pieces = [self._pieces[p] for p in group["params"]]
            stepping = [pc for pc in pieces if has_grad[pc]]
            if not stepping:
                continue
            self._allocate([pc for pc in stepping if pc.param not in self.state])
            for step, members in self._lockstep(pieces, stepping):
                self._update(group, members, step)
                step += 1
        for handle in [b.all_gather() for b in active]:
            handle.wait()
        return loss

    def _gradient_flags(self) -> dict[Piece, bool]:
        """Which parameters have a gradient: ``p.grad`` for single/fsdp pieces; for drop-in ones,
        whether *any* rank has one (one small all-reduce), since all ranks must agree."""
        flags: dict[Piece, bool] = {}
        for pc in self._pieces.values():
            if pc.mode == "drop-in":
                continue
            grad = pc.param.grad
            flags[pc] = grad is not None
            if grad is not None:
                check_grad(pc.name, pc.param, grad)
                if pc.mode == "fsdp" and (
                    not isinstance(grad, RaggedTensor) or grad.ragged_shard != pc.spec
                ):
                    raise RuntimeError(
                        f"parameter {pc.name!r}: in FSDP mode the gradient must be a RaggedTensor "
                        f"split like the parameter, got {type(grad).__name__} "
                        f"{getattr(grad, 'ragged_shard', '')}"
                    )
        if self._buckets:
            local = [f for b in self._buckets for f in b.collect()]
            device = collective_device(self._mesh.shard_group)
            both = torch.tensor(local, dtype=torch.int32, device=device)
            for group, size in (
                (self._mesh.shard_group, self._mesh.shard_size),
                (self._mesh.replicate_group, self._mesh.replicate_size),
            ):
                if group is not None and size > 1:
                    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            merged = iter(both.tolist())
            for b in self._buckets:
                for p in b.plist:
                    flags[self._pieces[p]] = bool(next(merged))
        return flags

    def _gradients_finite(self, has_grad: dict[Piece, bool]) -> bool:
        """Whether every rank's reduced gradient pieces are finite (one MAX all-reduce over the
        default group, so all ranks of the job skip together)."""
        bad = any(
            not bool(torch.isfinite(unwrap(pc.local_grad())).all())
            for pc, flag in has_grad.items()
            if flag and pc.numel
        )
        if not dist.is_initialized():
            return not bad
        flag = torch.tensor([int(bad)], device=collective_device(None))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return not bool(flag.item())

    def _lockstep(
        self, pieces: Sequence[Piece], stepping: Sequence[Piece]
    ) -> list[tuple[Tensor, list[Piece]]]:
        """Group the stepping pieces by their (shared) step counter; pieces that do not step
        this time get a counter of their own so they stay behind."""
        classes: dict[int, tuple[Tensor, list[Piece]]] = {}
        moving = set(stepping)
        for pc in stepping:
            step = self.state[pc.param]["step"]
            classes.setdefault(id(step), (step, []))[1].append(pc)
        for pc in pieces:
            state = self.state.get(pc.param)
            if state and pc not in moving and id(state["step"]) in classes:
                state["step"] = state["step"].clone()
        return list(classes.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; drop-in gradients stay views of the (zeroed) flat buffer, and
        ``set_to_none`` then means "no gradient yet" for the next step."""
        for b in self._buckets:
            b.zero_grad(set_to_none)
        for pc in self._pieces.values():
            grad = pc.param.grad
            if pc.mode == "drop-in" or grad is None:
                continue
            if set_to_none:
                pc.param.grad = None
            else:
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
                grad.zero_()

    # ----------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's format (``state`` by parameter index, ``param_groups``); values are the live
        state tensors (``RaggedTensor`` in sharded modes, for DCP), except ``step`` which is a
        copy per parameter since counters are shared internally."""
        sd = super().state_dict()
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
        index = {
            old: p
            for g, sg in zip(groups, saved_groups, strict=True)
            for old, p in zip(sg["params"], g["params"], strict=True)
        }
        saved_state = state_dict["state"]
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
            sg["params"] = g["params"]
            if "param_names" in g:
                sg["param_names"] = g["param_names"]
            self.param_groups[gi] = sg
            self._share_steps(sg, [p for p in g["params"] if p in values], values)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _reset_state(self, p: Tensor) -> None:
        """No saved state for ``p``: as if it had never stepped."""
        piece = self._pieces[p]
        if not piece.sharded:
            self.state.pop(p, None)
            return
        state = self.state[p]
        for key, t in state.items():
            if key != "step":
                unwrap(t).zero_()
        state["step"] = self._new_step(self.param_groups[piece.group_index], p.device)

    def _copy_state(self, piece: Piece, saved: dict[str, Any]) -> None:
        state = self.state[piece.param]
        if set(saved) != set(state):
            raise ValueError(
                f"parameter {piece.name!r}: the loaded state has keys {sorted(saved)} but "
                f"{type(self).__name__} keeps {sorted(state)} for it (a checkpoint of another "
                "optimizer, or other settings such as amsgrad / block size?)"
            )
        for key, dst in state.items():
            if key != "step":
                _copy_into(f"{piece.name!r} state {key!r}", dst, saved[key])

    def _share_steps(self, group: dict[str, Any], params: Sequence[Tensor], values) -> None:
        """Give parameters with equal loaded step counts one shared counter again."""
        shared: dict[tuple[float, torch.device], Tensor] = {}
        for p in params:
            key = (values[p], p.device)
            if key not in shared:
                shared[key] = self._new_step(group, p.device).fill_(values[p])
            self.state[p]["step"] = shared[key]


def _copy_into(what: str, dst: Tensor, src: Any) -> None:
    """Copy a loaded value into a state tensor: same split, or a full tensor to slice."""
    if not isinstance(src, Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(src).__name__}")
    if not dst.is_floating_point() and src.dtype != dst.dtype:
        raise TypeError(f"{what}: dtype {src.dtype} where {dst.dtype} is kept")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{what}: shape {tuple(src.shape)} where {tuple(dst.shape)} is kept")
    if isinstance(src, RaggedTensor):
        if not isinstance(dst, RaggedTensor) and src.ragged_shard.world_size == 1:
            dst.copy_(src.local.view(dst.shape))
            return
        if not isinstance(dst, RaggedTensor) or src.ragged_shard != dst.ragged_shard:
            raise ValueError(
                f"{what} was saved with another sharding ({getattr(src, 'ragged_shard', None)}); "
                "load resharded checkpoints with torch.distributed.checkpoint (DCP), or pass "
                "full tensors"
            )
        if src.local.data_ptr() != dst.local.data_ptr() or not src.local.numel():
            dst.local.copy_(src.local)
        return
    if isinstance(dst, RaggedTensor):
        start, stop = dst.local_range
        dst.local.copy_(src.reshape(-1)[start:stop])
        return
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


def check_unit_alignment(piece: Piece, unit: int, why: str) -> None:
    """Raise unless every cut of a sharded parameter falls on a multiple of ``unit`` elements
    from its start (so each ``unit``-aligned block is whole on one rank)."""
    spec = piece.spec
    if spec is None or unit <= 1:
        return
    for r in range(spec.world_size):
        start = spec.offset(r)
        if start % unit and start != spec.numel:
            raise ValueError(
                f"parameter {piece.name!r} (shape {tuple(spec.shape)}) is sharded with rank {r}'s "
                f"piece starting at element {start}, which cuts {why} of {unit} elements. Shard "
                f"it with this optimizer's policy (fully_shard(..., shard_policy="
                f"<Optimizer>.shard_policy(...))) so units are multiples of {unit} elements "
                f"(gcd now {math.gcd(start, unit)})"
            )
