"""``fully_shard``: FSDP2's API, with each call's parameters planned into ragged flat buffers.

Call it on each block, then on the root, as with ``torch.distributed.fsdp.fully_shard``::

    for block in model.layers:
        fully_shard(block, shard_policy=row_units(32))
    fully_shard(model)

Each call forms one communication group from the parameters of its module that no earlier call
took. Afterwards ``module.parameters()`` are ``RaggedTensor`` parameters: the true global shape
and dtype, ``.local`` (this rank's piece, a view of the group's flat buffer), ``.ragged_shard``
and ``.full_tensor()``. ``torch.optim`` optimizers update them in place (element-wise ops run on
the local pieces), and DCP checkpoints them without gathering.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import register_optimizer_step_pre_hook

from raggedfsdp.comm import ShardMesh, resolve_mesh
from raggedfsdp.fsdp.mixed_precision import MixedPrecisionPolicy
from raggedfsdp.fsdp.param_group import ManagedParam, ParamGroup
from raggedfsdp.fsdp.state import FSDPState, backward_in_progress, in_backward
from raggedfsdp.sharding import RaggedTensor, ShardPolicy, element_units

__all__ = ["FSDPModule", "fully_shard"]

_STATE = "_raggedfsdp_state"


class FSDPModule:
    """Methods added to every ``fully_shard``-ed module (its class becomes a subclass)."""

    def _fsdp_state(self) -> FSDPState:
        return getattr(self, _STATE)

    def unshard(self, async_op: bool = False) -> None:
        """All-gather this module's group now (e.g. to inspect or time it); ``async_op=True``
        only starts it, the next forward (or ``unshard()``) waits."""
        group = self._fsdp_state().group
        if group is not None:
            group.unshard(async_op=async_op)
            if not async_op:
                group.use_unsharded_params()

    def reshard(self) -> None:
        """Free this module's unsharded parameters and point it back at the sharded ones."""
        group = self._fsdp_state().group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, recurse: bool = True
    ) -> None:
        """``False``: backward accumulates unsharded gradients locally (no communication) until a
        backward with ``True`` reduces the sum, as FSDP2's method of the same name."""
        for state in self._states(recurse):
            if state.group is not None:
                state.group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def _states(self, recurse: bool) -> list[FSDPState]:
        modules = self.modules() if recurse else [self]
        return list(dict.fromkeys(getattr(m, _STATE) for m in modules if hasattr(m, _STATE)))


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"RaggedFSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | ShardMesh | torch.distributed.ProcessGroup | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_policy: ShardPolicy | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters (those not taken by an earlier call) as one group.

    Args:
        module: the module to wrap; its class gains ``FSDPModule``'s methods. A list of modules
            (e.g. torchtitan's ``[model.norm, model.output]``) forms one group: gathered before
            the first of them runs its forward, resharded after the last; its parameters are
            named ``"<index in the list>.<name>"`` in the plan.
        mesh: 1-D ``DeviceMesh`` or process group (FSDP), 2-D ``DeviceMesh`` (HSDP: dim 0
            replicates, dim 1 shards), or ``None`` for the default group (a single process when
            torch.distributed is not initialised).
        reshard_after_forward: free the unsharded parameters after forward and gather them
            again for backward (ZeRO-3); ``False`` keeps them until backward ends (ZeRO-2-like
            memory for the parameters of this group, one all-gather fewer). The root ignores it:
            its backward runs first.
        mp_policy: mixed precision (see ``MixedPrecisionPolicy``).
        shard_policy: ``(fqn, param) -> unit in elements``; default element units, which pad
            least (larger units that cover whole segments force the segment size to a multiple
            of their LCM). Pass an optimizer's policy, e.g. ``AdamW8bit.shard_policy()``, so
            its blocks are never cut.

    Parameters must be initialised identically on every rank (same seed) or loaded afterwards
    from a checkpoint: each rank keeps its pieces of its own copy.
    """
    modules = _as_module_list(module)
    shard_mesh = resolve_mesh(mesh)
    mp_policy = mp_policy or MixedPrecisionPolicy()
    params = _collect_params(modules)
    owner = " + ".join(type(m).__name__ for m in modules)
    group = None
    if params:
        _check_mesh_device(shard_mesh, params[0].original, params[0].fqn)
        originals = [mp.original for mp in params]
        group = ParamGroup(
            params,
            shard_mesh,
            mp_policy,
            shard_policy or element_units(),
            comm_streams=lambda: state.ctx.comm_streams() if state.ctx else (None, None),
            name=owner,
        )
        for tensor in originals + [mp.sharded for mp in params]:
            tensor._raggedfsdp_owner = owner
    state = FSDPState(modules, group, reshard_after_forward, mp_policy)
    for m in modules:
        setattr(m, _STATE, state)
        m.__class__ = _fsdp_class(type(m))
    return module


def _as_module_list(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    modules = [module] if isinstance(module, nn.Module) else list(module)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(
            f"fully_shard(module=...) takes an nn.Module or a non-empty list of them, got "
            f"{type(module).__name__}"
        )
    for m in modules:
        if hasattr(m, _STATE):
            raise ValueError(
                f"{type(m).__name__} is already wrapped by fully_shard; wrap each module once "
                "(blocks first, then the root)"
            )
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard got the same module twice in its list; pass it once")
    return modules


def _collect_params(modules: list[nn.Module]) -> list[ManagedParam]:
    """The parameters of ``modules`` outside already-wrapped submodules, each once, with every
    place that refers to it (names get the module's list index when there are several)."""
    found: dict[int, ManagedParam] = {}

    def visit(mod: nn.Module, prefix: str) -> None:
        for name, param in mod._parameters.items():
            if param is None:
                continue
            fqn = f"{prefix}{name}"
            owner = getattr(param, "_raggedfsdp_owner", None)
            if owner is not None:  # set on both the original and the sharded parameter
                raise ValueError(
                    f"parameter {fqn!r} is already sharded by the fully_shard call on {owner}: "
                    "a parameter can be in one group only. "
                    "Tied/shared weights must be wrapped by one call (e.g. the common parent)."
                )
            if id(param) not in found:
                found[id(param)] = ManagedParam(fqn, param, [(mod, name)])
            elif (mod, name) not in found[id(param)].locations:  # a module reached twice
                found[id(param)].locations.append((mod, name))
        for child_name, child in mod._modules.items():
            if child is not None and not hasattr(child, _STATE):
                visit(child, f"{prefix}{child_name}.")

    for i, module in enumerate(modules):
        visit(module, f"{i}." if len(modules) > 1 else "")
    return list(found.values())


def _check_mesh_device(mesh: ShardMesh, param: torch.Tensor, fqn: str) -> None:
    device_mesh = mesh.device_mesh
    if device_mesh is not None and device_mesh.device_type != param.device.type:
        raise ValueError(
            f"mesh is a {device_mesh.device_type!r} DeviceMesh but parameter {fqn!r} is on "
            f"{param.device}; build the mesh for the parameters' device type"
        )


def _refuse_step_during_backward(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    sharded = any(isinstance(p, RaggedTensor) for g in optimizer.param_groups for p in g["params"])
    if sharded and (backward_in_progress() or in_backward()):
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() was called before backward finished reducing "
            "gradients; call it after loss.backward() returns"
        )


register_optimizer_step_pre_hook(_refuse_step_during_backward)
