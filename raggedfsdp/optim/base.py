"""``ShardedOptimizer``: the runtime under every optimizer in ``raggedfsdp.optim``.

One class, three modes, the same user code:

* **single** (no process group, or a world of one): plain parameters, state shaped like them,
  created lazily at the first step; an optimizer here behaves exactly like its torch peer.
* **drop-in** (plain parameters under an initialized process group of more than one rank): ZeRO-2
  through :class:`~raggedfsdp.optim.dropin.DropInBucket`; each rank keeps 1/W of the state.
* **fsdp** (``RaggedTensor`` parameters, e.g. from ``fully_shard``): each rank updates the local
  pieces where they lie, with no communication.

This file classifies parameters into those modes, builds the drop-in buckets and runs ``step``
and ``zero_grad``. What a subclass declares and what it may rely on is the contract in
:mod:`raggedfsdp.optim.contract`; state allocation, accounting and checkpoints are in
:mod:`raggedfsdp.optim.state`.

Every optimizer declares the unit its math needs with the classmethod ``shard_policy``; the drop-in
mode plans its buffers with it (through ``resolve_units``, so a group policy decides for the whole
bucket) and users pass it to ``fully_shard``, so both agree.

Step counters follow torch (``state[p]["step"]``) but parameters that step together share one
counter object, so the update of a group needs one bias correction, not one per parameter; a
parameter that misses a step gets its own counter from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
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
from raggedfsdp.optim.contract import Mode, Piece
from raggedfsdp.optim.dropin import DropInBucket
from raggedfsdp.optim.pieces import unwrap
from raggedfsdp.optim.state import ShardedState
from raggedfsdp.sharding import RaggedTensor, ShardPolicy, resolve_units

__all__ = ["ShardedOptimizer"]


def _param_list(params: Any) -> list[Any]:
    if isinstance(params, Tensor):
        return [params]
    if isinstance(params, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the order of "
            "a set changes between runs; pass a list"
        )
    return list(params)


@dataclass(eq=False)
class _GroupPlan:
    """One param group as the step walks it, taken once: its pieces, its fsdp parameters (whose
    versions the step bumps) and, once every piece has state, the state dicts, where the step
    reads the shared counters. Dropped with the other plans when state is created or replaced."""

    params: list[Any]  # the group's "params" list it was made from
    pieces: list[Piece]
    fsdp: list[Tensor]
    states: list[dict[str, Tensor]] | None

    def lockstep(self, stepping: list[Piece]) -> list[tuple[Tensor, list[Piece]]] | None:
        """``_lockstep``'s answer where it is one class without a pass over the state: every
        piece steps, every one has state and all share one counter; else None."""
        if self.states is None or len(stepping) != len(self.pieces):
            return None
        steps = [s["step"] for s in self.states]
        ids = list(map(id, steps))
        return [(steps[0], self.pieces)] if ids.count(ids[0]) == len(ids) else None


class ShardedOptimizer(ShardedState, Optimizer):
    """Base class: modes, drop-in buckets, checks and the step; subclasses write the math.

    Subclasses implement the hooks of :class:`~raggedfsdp.optim.contract.OptimizerHooks`:
    ``shard_policy`` (classmethod), ``_policy`` (the instance's rule), ``_state_specs``,
    ``_new_step`` and ``_update`` (``_check_piece`` optionally). State handling and checkpoints
    come from :class:`~raggedfsdp.optim.state.ShardedState`.

    Args:
        params, defaults: as for ``torch.optim.Optimizer`` (named parameters welcome: errors
            then use the names).
        mesh: the ranks the drop-in mode shards over: a ``DeviceMesh`` (2-D: HSDP), a process
            group, or None for the default group. Ignored by single and fsdp pieces.
    """

    #: Skip a step on every rank when any reduced gradient holds inf/NaN (one flag all-reduce
    #: per step when on). Off by default, as in torch, where such a step poisons the state;
    #: turn it on for long runs (``opt.skip_nonfinite_steps = True``). ``skipped_steps`` counts.
    skip_nonfinite_steps: bool = False

    def __init__(self, params: Any, defaults: dict[str, Any], *, mesh: MeshLike = None) -> None:
        self._mesh: ShardMesh = resolve_mesh(mesh)
        self.skipped_steps = 0
        self._pieces: dict[Tensor, Piece] = {}
        self._buckets: list[DropInBucket] = []
        self._group_plans: dict[int, _GroupPlan] = {}
        self._step_plans: dict[Any, Any] = {}
        self._own_grads: list[Tensor] = []  # single and fsdp parameters: zero_grad's
        self._built = False
        super().__init__(params, defaults)
        self._build(range(len(self.param_groups)))
        self._built = True

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
                # torch's words first (it warns within a group; a sharded step would update
                # the parameter twice, so here both are errors)
                kind = (
                    "some parameters appear in more than one parameter group"
                    if gi < index
                    else "a parameter group with duplicate parameters"
                )
                where = repr(self._name(gi, j)) if gi < index else f"position {j}"
                raise ValueError(
                    f"{kind}: parameter {label} (shape {tuple(p.shape)}) is already in param "
                    f"group {gi} (as {where}); a parameter may appear in only one group, once. "
                    "Remove it from one of them (e.g. split decay / no-decay by name)"
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
                self._check_split_dims(piece)
                self._check_piece(piece, group)
                new.append(piece)
        if self._mesh.shard_size > 1 or self._mesh.replicate_size > 1:
            check_fingerprint(self._mesh, [(pc.name, self._signature(pc)) for pc in new])
        policy = self._policy()
        for gi in group_indices:
            plain = [pc for pc in new if pc.group_index == gi and pc.mode == "drop-in"]
            self._bucket(plain, policy)
        for pc in new:
            self._pieces[pc.param] = pc
        self._own_grads += [pc.param for pc in new if pc.mode != "drop-in"]
        for gi in group_indices:
            self._allocate([pc for pc in new if pc.group_index == gi and pc.sharded])

    def _bucket(self, plain: Sequence[Piece], policy: ShardPolicy) -> None:
        """Move one group's drop-in parameters into flat buffers, one bucket per dtype and
        device, with units from this optimizer's policy: a group policy (e.g. Muon keeping
        matrices whole where the padding stays within budget) decides for the whole bucket."""
        kinds: dict[tuple[torch.dtype, torch.device], list[Piece]] = {}
        for pc in plain:
            kinds.setdefault((pc.param.dtype, pc.param.device), []).append(pc)
        for members in kinds.values():
            tensors = [(pc.name, tuple(pc.param.shape), pc.param.dtype) for pc in members]
            units = resolve_units(
                policy, tensors, self._mesh.shard_size, {pc.name: pc.param for pc in members}
            )
            bucket = DropInBucket(
                [pc.name for pc in members],
                [pc.param for pc in members],
                [units[pc.name] for pc in members],
                self._mesh,
                check_grad,
            )
            self._buckets.append(bucket)
            for pc in members:
                pc.bucket = bucket
                pc.spec = bucket.layout.shards[pc.name]
                pc.rank = self._mesh.shard_rank
                pc.pgroup = self._mesh.shard_group

    def _make_piece(self, p: Tensor, name: str, gi: int) -> Piece:
        mode = self._mode_of(p)
        if p.is_complex():
            # RuntimeError, as torch's optimizers that refuse complex parameters raise (Muon)
            raise RuntimeError(
                f"parameter {name!r} is complex; {type(self).__name__} does not support complex "
                "parameters (raggedfsdp.optim works on real tensors): store it as "
                "torch.view_as_real(...) and view it as complex in forward"
            )
        if mode != "single" and p.device.type == "meta":
            raise ValueError(
                f"parameter {name!r} is on the meta device, and the sharded modes allocate "
                "state when the optimizer is built: build it after model.to_empty(device=...)"
            )
        if mode == "fsdp":
            local = p.local
            if local.dim() != 1 or not local.is_contiguous():
                raise ValueError(
                    f"parameter {name!r}: a RaggedTensor's local piece must be a contiguous 1-D "
                    f"view (got shape {tuple(local.shape)}, stride {local.stride()})"
                )
            return Piece(p, name, gi, mode, p.ragged_shard, p.rank, p.group)
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
        updated: list[Tensor] = []
        for gi, group in enumerate(self.param_groups):
            plan = self._group_plan(gi, group)
            stepping = [pc for pc in plan.pieces if has_grad[pc]]
            if not stepping:
                continue
            classes = plan.lockstep(stepping)
            if classes is None:  # some state missing, or counters apart: the general path
                self._allocate([pc for pc in stepping if pc.param not in self.state])
                classes = self._lockstep(plan.pieces, stepping)
            for step, members in classes:
                self._update(group, members, step)
                step += 1
            updated += (
                plan.fsdp
                if len(stepping) == len(plan.pieces)
                else [pc.param for pc in stepping if pc.mode == "fsdp"]
            )
        # The updates wrote local pieces below autograd (or through pointers): bump the
        # parameters' versions as torch's in-place updates do, so that fully_shard's kept
        # unsharded copies are seen stale
        torch.autograd.graph.increment_version(updated)
        for handle in [b.all_gather() for b in active]:
            handle.wait()
        return loss

    def _group_plan(self, gi: int, group: dict[str, Any]) -> _GroupPlan:
        plan = self._group_plans.get(gi)
        if plan is None or plan.params is not group["params"]:
            pieces = [self._pieces[p] for p in group["params"]]
            fsdp = [pc.param for pc in pieces if pc.mode == "fsdp"]
            have = all(pc.param in self.state for pc in pieces)
            states = [self.state[pc.param] for pc in pieces] if have else None
            plan = self._group_plans[gi] = _GroupPlan(group["params"], pieces, fsdp, states)
        return plan

    def _gradient_flags(self) -> dict[Piece, bool]:
        """Which parameters have a gradient: ``p.grad`` for single/fsdp pieces; for drop-in ones,
        whether *any* rank has one (one small all-reduce), since all ranks must agree."""
        flags: dict[Piece, bool] = {}
        for pc in self._pieces.values():
            if pc.mode == "drop-in":
                continue
            grad = pc.param.grad
            flags[pc] = grad is not None
            if grad is None or (  # fully_shard's gradients: split by the parameter's own spec
                type(grad) is RaggedTensor
                and grad.ragged_shard is pc.spec
                and grad.dtype == pc.param.dtype
            ):
                continue
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
        for p in self._own_grads:
            grad = p.grad
            if grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
                grad.zero_()
