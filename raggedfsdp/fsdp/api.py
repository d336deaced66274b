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

import functools
import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, DataParallelMeshDims, OffloadPolicy
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from raggedfsdp.comm import ShardMesh, resolve_mesh
from raggedfsdp.comm.mesh import dp_submesh
from raggedfsdp.fsdp.dtype_groups import DtypeGroups, build_by_dtype
from raggedfsdp.fsdp.managed_param import ManagedParam
from raggedfsdp.fsdp.mixed_precision import MixedPrecisionPolicy
from raggedfsdp.fsdp.param_group import ParamGroup, is_plain_embedding_weight
from raggedfsdp.fsdp.placement import placement_policy
from raggedfsdp.fsdp.state import STATE_ATTR, FSDPState, state_of
from raggedfsdp.fsdp.step_guard import install_step_guard, mark_replaced
from raggedfsdp.fsdp.tensor_parallel import SPMDMesh, tp_shard_of
from raggedfsdp.sharding import DEFAULT_POLICY, RaggedTensor, ShardPolicy

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]


class FSDPModule:
    """Methods added to every ``fully_shard``-ed module (its class becomes a subclass)."""

    def _fsdp_state(self) -> FSDPState:
        return getattr(self, STATE_ATTR)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's group now (e.g. to inspect or time it). ``async_op=True``
        only starts it and returns a handle whose ``wait()`` finishes it; otherwise the next
        forward does."""
        groups = self._fsdp_state().groups
        for group in groups:
            group.unshard(async_op=True)
        handle = UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and point it back at the sharded ones."""
        for group in self._fsdp_state().groups:
            group.reshard()

    def reset_iter_state(self) -> None:
        """Recover from an error that aborted backward (e.g. a caught out-of-memory error): wait
        for its collectives, discard its unreduced gradients and reshard every group, so the
        next step starts clean. The next forward of the root does this by itself (with a
        warning); call it on the root module to step an optimizer before that."""
        ctx = self._fsdp_state().ctx
        if ctx is not None:
            ctx.reset()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, recurse: bool = True
    ) -> None:
        """``False``: backward accumulates unsharded gradients locally (no communication) until a
        backward with ``True`` reduces the sum, as FSDP2's method of the same name."""
        for group in self._groups(recurse):
            group.requires_gradient_sync = requires_gradient_sync

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False``: the next backward is not the step's last (a pipeline schedule's
        microbatches), so its end leaves reduce-scatters still in flight running (they are
        waited on by the next backward's, or by the last one's end), as FSDP2's method. Each
        backward's gradients are reduced as ``set_requires_gradient_sync`` says either way."""
        for state in self._states(recurse=True):
            state.is_last_backward = is_last_backward

    def reduce_accumulated_gradients(self) -> None:
        """Reduce the gradients that backwards without sync accumulated (outside backward):
        what a pipeline schedule runs once after all microbatches (FSDP2's ``post_backward``
        there; ``raggedfsdp.fsdp.pipelining.PipelineStage`` calls it). Sets the sharded ``.grad``; a
        no-op if nothing is accumulated."""
        ctx = self._fsdp_state().ctx
        if ctx is None:
            return
        if ctx.backward_active:
            raise RuntimeError(
                "reduce_accumulated_gradients() inside backward: call it after the backward "
                "passes of the step (a pipeline schedule's microbatches) have finished"
            )
        ctx.finish_backward(reduce_accumulated=True)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``fully_shard``'s ``reshard_after_forward`` at run time (e.g. ``False`` for
        gradient accumulation, or on the root for FSDP2's schedule, which keeps its parameters
        from forward to its backward)."""
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(
                f"set_reshard_after_forward(reshard_after_forward={reshard_after_forward!r}): "
                "expected True or False (as FSDP2); resharding to a subgroup is chosen once, "
                "with fully_shard(..., reshard_after_forward=<int>)"
            )
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """``False``: keep the unsharded parameters after backward, so the next forward needs no
        all-gather (gradient accumulation: more memory, less communication). Outside forward and
        backward the module still shows its sharded parameters, and kept ones are gathered again
        if the sharded parameters changed (an optimizer step), so they are never stale."""
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters each backward's gradients but keeps the partial sums
        instead of all-reducing them over the replicas; the next backward with ``True`` adds
        them in and all-reduces once (accumulation with less inter-node traffic). The sharded
        ``.grad`` is set only then. No effect on a 1-D mesh."""
        for group in self._groups(recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide gradients by ``factor`` instead of averaging over the data-parallel ranks
        (e.g. ``1.0`` when the loss is already normalised by the global token count). Each
        gradient is scaled by ``1 / factor`` in the reduce dtype as it lands in the flat buffer
        and the ranks' buffers are summed, as FSDP2 does with NCCL's PreMulSum. Not recursive,
        as FSDP2's."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(
                f"set_gradient_divide_factor(factor={factor!r}): expected a positive number "
                "(e.g. 1.0 to sum the ranks' gradients)"
            )
        for group in self._fsdp_state().groups:
            group.gradient_divide_factor = float(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: backward does not all-gather this module's parameters, for modules whose
        backward needs none of them (an embedding: its weight gradient needs only the token ids
        and the output gradient). Saves one all-gather of the group per step. If a backward
        does need them, autograd fails reading freed storage; it never reads stale values.
        Already ``False`` for a group holding only weights of plain ``nn.Embedding`` modules
        (FSDP2 gathers those unless told); ``True`` restores FSDP2's behaviour."""
        self._fsdp_state().unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """All-gathers to start (asynchronously) when this module's forward begins, replacing
        the default of the next module in the last forward's order. Two or more overlap more
        and hold more unsharded memory."""
        self._fsdp_state().forward_prefetch = _states_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """All-gathers to start when this module's backward begins, replacing the default of
        the module before it in the last forward's order."""
        self._fsdp_state().backward_prefetch = _states_of(
            modules, "set_modules_to_backward_prefetch"
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        """``to_empty()``, ``to()``, ``cuda()``...: each group's local segment is converted as
        a whole and its parameters stay views of the new flat buffers (and the same objects).
        This is FSDP2's meta-device initialisation: build the model under
        ``torch.device("meta")``, ``fully_shard`` it, then ``to_empty(device=...)`` and
        initialise (random fills draw what one process would draw, so the parameters do not
        depend on the world size). Every group below is checked first, so a refused
        conversion (a dtype change, a gathered group) changes nothing."""
        for group in self._groups(recurse):
            group.check_conversion(fn)
        state = self._fsdp_state()
        params = [mp for group in state.groups for mp in group.params]
        for module, name in (loc for mp in params for loc in mp.locations):
            module._parameters[name] = None  # converted by state.convert, as one buffer
        try:
            result = super()._apply(fn, recurse)
        finally:
            for group in state.groups:
                group.use_sharded_params()
        state.convert(fn)
        return result

    def _states(self, recurse: bool) -> list[FSDPState]:
        modules = self.modules() if recurse else [self]
        return list(dict.fromkeys(s for s in map(state_of, modules) if s is not None))

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        return [group for state in self._states(recurse) for group in state.groups]


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` finishes the all-gather and points the
    module at the unsharded parameters (the module's next forward would do it otherwise)."""

    def __init__(self, groups: list[ParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            group.unshard()
            group.use_unsharded_params()
        self._groups = []


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) gather and reshard like ``forward``:
    FSDP's hooks only see ``forward``, so another entry point would find sharded parameters.
    A module that is not ``fully_shard``-ed is left alone, so the same code runs without FSDP
    (as FSDP2's function of the same name)."""
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} has no method "
            f"{method_name!r}; pass the name of one of its methods"
        )
    state = module._fsdp_state()

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(module, args, kwargs)
        return state.post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def _states_of(modules: list[nn.Module], method: str) -> list[FSDPState]:
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"{method}(modules=...): {type(m).__name__} is not fully_shard-ed; pass modules "
                "that fully_shard wrapped (e.g. the other transformer blocks)"
            )
    return [m._fsdp_state() for m in modules]


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"RaggedFSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | ShardMesh | torch.distributed.ProcessGroup | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_policy: ShardPolicy | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    offload_policy: OffloadPolicy | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters (those not taken by an earlier call) as one group.

    Args:
        module: the module to wrap; its class gains ``FSDPModule``'s methods. A list (e.g.
            ``[model.norm, model.output]``) forms one group, gathered before the first runs.
        mesh: 1-D ``DeviceMesh`` or process group (FSDP), 2-D ``DeviceMesh`` (HSDP: dim 0
            replicates), ``None`` for the default group. Under tensor parallelism the
            data-parallel dims only (``mesh["dp_shard"]``; docs/tensor_parallel.md).
        reshard_after_forward: ``True`` frees the unsharded parameters after forward and gathers
            them again for backward (ZeRO-3); ``False`` keeps them until backward ends;
            ``None`` (default): ``True``, except on the root, which keeps its parameters from
            forward to its backward (the first to come) as FSDP2's does, its embedding weights
            freed all the same. An int ``k`` dividing the shard size keeps this rank's ``1/k``
            of the gathered buffer, so backward gathers over ``k`` consecutive ranks only
            (FSDP2's meaning; docs/fsdp.md).
        mp_policy: mixed precision (see ``MixedPrecisionPolicy``).
        shard_policy: ``(fqn, param) -> unit in elements``; default ``DEFAULT_POLICY``:
            element units, which pad least, but fused experts whole within a 0.1 % padding
            budget (the group's ``notes`` say which). Pass an optimizer's policy, e.g.
            ``combine(DEFAULT_POLICY, AdamW8bit.shard_policy())``, so its blocks are never cut;
            ``strict(policy)`` refuses blocks another split would cut.
        dp_mesh_dims: torch 2.13's SPMD form (``torch.distributed.fsdp.DataParallelMeshDims``):
            ``mesh`` is the full mesh, the parameters DTensors on it, ``Replicate()`` on the
            named data-parallel dims and ``Shard(d)`` / ``Replicate()`` on the TP dim
            (docs/tensor_parallel.md).
        offload_policy: FSDP2's ``CPUOffloadPolicy(pin_memory=...)``: sharded parameters,
            gradients and optimizer state in CPU memory, copied to the device for each gather
            (docs/fsdp.md); ``None`` or ``OffloadPolicy()``: no offload.
        shard_placement_fn: FSDP2's ``param -> Shard(d) | ShardPlacementResult | None``, as
            units combined (LCM) with ``shard_policy``: ``Shard(0)`` or ``None`` keeps each
            dim-0 slice whole on a rank, ``Shard(d)`` each index of dim ``d`` (FSDP2's strided
            dim-``d`` blocks do not fit a contiguous run; the group's ``notes`` say so). Another
            mesh, and placements that are not ``Shard``, are refused (raggedfsdp.fsdp.placement).

    Parameters must be initialised identically on every rank (same seed), or afterwards
    (meta device, ``to_empty``, ``nn.init``), or loaded from a checkpoint.
    """
    modules = _as_module_list(module)
    shard_mesh, spmd = _resolve_dp_mesh(mesh, dp_mesh_dims, reshard_after_forward)
    reshard_after_forward = _check_reshard_after_forward(reshard_after_forward, shard_mesh)
    _check_policies(mp_policy, shard_policy)
    offload = _check_offload(offload_policy, modules)
    mp_policy = mp_policy or MixedPrecisionPolicy()
    params = _collect_params(modules, shard_mesh, spmd)
    shard_policy = placement_policy(shard_placement_fn, params, shard_policy, shard_mesh)
    owner = " + ".join(type(m).__name__ for m in modules)
    if params:
        _check_mesh_device(shard_mesh, params[0].original, params[0].fqn)
    _check_tp_policies(params, mp_policy)

    def build(members: list[ManagedParam]) -> ParamGroup:
        return ParamGroup(
            members,
            shard_mesh,
            mp_policy,
            shard_policy or DEFAULT_POLICY,
            comm_streams=lambda: state.ctx.comm_streams() if state.ctx else (None, None),
            name=owner,
            offload=offload,
        )

    group, forward_only = _form_groups(params, owner, build)
    install_step_guard()
    state = FSDPState(modules, group, reshard_after_forward, mp_policy, forward_only)
    for m in modules:
        setattr(m, STATE_ATTR, state)
        m.__class__ = _fsdp_class(type(m))
    return module


def _form_groups(
    params: list[ManagedParam], owner: str, build: Callable[[list[ManagedParam]], ParamGroup]
) -> tuple[ParamGroup | DtypeGroups | None, ParamGroup | DtypeGroups | None]:
    """Shard ``params`` as the call's main group and, when there are other parameters too, a
    group of their own for the weights of embedding lookups: backward reads none of them, so
    they need not stay gathered with (or be gathered again like) the rest. Either is planned
    as one group per dtype when its parameters have several (``DtypeGroups``).

    If a group fails to build, the modules get their original parameters back (the first group
    may already have put its sharded ones in place). Both the original and the sharded tensors
    are marked with ``owner``, so a later call that meets them again says which call took them;
    the originals are also marked as replaced, so an optimizer still holding them (built before
    wrapping) is refused at its first step instead of updating tensors no module uses.
    """
    originals = [mp.original for mp in params]
    lookups = [mp for mp in params if is_plain_embedding_weight(mp)]
    others = [mp for mp in params if not is_plain_embedding_weight(mp)]
    if not others:
        lookups, others = [], lookups
    try:
        main = build_by_dtype(others, build) if others else None
        forward_only = build_by_dtype(lookups, build) if lookups else None
    except Exception:
        for mp, original in zip(params, originals, strict=True):
            for module, name in mp.locations:
                module._parameters[name] = original
        raise
    for tensor in originals + [mp.sharded for mp in params]:
        tensor._raggedfsdp_owner = owner
    for mp, original in zip(params, originals, strict=True):
        mark_replaced(original, mp.fqn, owner)
    return main, forward_only


def _check_policies(mp_policy: Any, shard_policy: Any) -> None:
    """Wrong types fail here, in one line naming the argument, not later as an attribute
    error deep in planning (e.g. ``mp_policy=torch.bfloat16``)."""
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fully_shard(mp_policy={mp_policy!r}): expected a MixedPrecisionPolicy or None, "
            "e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
        )
    if shard_policy is not None and not callable(shard_policy):
        raise TypeError(
            f"fully_shard(shard_policy={shard_policy!r}): expected a callable (fqn, param) -> "
            "unit in elements or None, e.g. raggedfsdp.sharding.row_units(32) or an "
            "optimizer's shard_policy()"
        )


def _check_offload(offload_policy: Any, modules: list[nn.Module]) -> CPUOffloadPolicy | None:
    """FSDP2's policy types only, and one policy for a whole model: a module wrapped before
    (a block) must have been wrapped with the same offload as the call above it, else its
    sharded parameters and gradients would live on another device than its parent's."""
    if offload_policy is not None and type(offload_policy) not in (
        OffloadPolicy,
        CPUOffloadPolicy,
    ):
        raise TypeError(
            f"fully_shard(offload_policy={offload_policy!r}): expected "
            "torch.distributed.fsdp.CPUOffloadPolicy(pin_memory=...) or OffloadPolicy()"
        )
    offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
    for root in modules:
        for path, sub in root.named_modules():
            state = getattr(sub, STATE_ATTR, None)
            if state is None or state.group is None:
                continue
            if (state.group.offload is None) != (offload is None):
                had = "with" if state.group.offload is not None else "without"
                raise ValueError(
                    f"fully_shard(offload_policy={offload_policy!r}): submodule {path!r} was "
                    f"wrapped {had} CPU offload; wrap every module of one model with the "
                    "same offload_policy"
                )
    return offload


def _as_module_list(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    if isinstance(module, nn.Module):
        modules = [module]
    else:
        modules = list(module) if isinstance(module, (list, tuple)) else []
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(
            f"fully_shard(module=...) takes an nn.Module or a non-empty list of them, got "
            f"{type(module).__name__}"
        )
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            # its forward never runs, so neither would the hooks that gather its parameters
            raise ValueError(
                f"fully_shard(module=...) got a {type(m).__name__}, a container without forward "
                "whose hooks would never run (FSDP2 refuses it too); wrap each of its modules, "
                "or pass list(container) to make them one group"
            )
        if state_of(m) is not None:
            raise ValueError(
                f"{type(m).__name__} is already wrapped by fully_shard; wrap each module once "
                "(blocks first, then the root)"
            )
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard got the same module twice in its list; pass it once")
    return modules


def _check_reshard_after_forward(value: Any, mesh: ShardMesh) -> bool | int | None:
    """FSDP2's rules for ``reshard_after_forward``: a bool, ``None``, or an int dividing the
    shard size, where ``1`` means ``False`` and the shard size ``True``."""
    if value is None or isinstance(value, bool):
        return value
    try:
        size = operator.index(value)
    except TypeError:
        raise TypeError(
            f"fully_shard(reshard_after_forward={value!r}): expected True, False, None or an "
            "int (the number of ranks to stay sharded over after forward)"
        ) from None
    divisors = [d for d in range(1, mesh.shard_size + 1) if mesh.shard_size % d == 0]
    if size not in divisors:
        raise ValueError(
            f"fully_shard(reshard_after_forward={size}): an int is the number of ranks the "
            f"parameters stay sharded over after forward (e.g. the GPUs of one node) and must "
            f"divide the {mesh.shard_size} ranks of the shard dimension: one of {divisors}"
        )
    if size == 1:
        warnings.warn(
            "fully_shard(reshard_after_forward=1): the int 1 keeps the whole parameters after "
            "forward (as False); pass True to reshard them",
            stacklevel=3,
        )
        return False
    return True if size == mesh.shard_size else size


def _collect_params(
    modules: list[nn.Module], mesh: ShardMesh, spmd: SPMDMesh | None = None
) -> list[ManagedParam]:
    """The parameters of ``modules`` outside already-wrapped submodules, each once, with every
    place that refers to it (names get the module's list index when there are several).
    Tensor-parallel DTensors are checked against ``mesh`` (``tp_shard_of``); in the SPMD form
    (``spmd``) every parameter must be a DTensor on its full mesh."""
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
                    "a parameter can be in one group only. Wrap submodules before their parent "
                    "(blocks first, then the root); tied/shared weights must be wrapped by one "
                    "call (e.g. the common parent)."
                )
            is_dtensor = isinstance(param, DTensor)
            if (is_traceable_wrapper_subclass(param) and not is_dtensor) or isinstance(
                param, RaggedTensor
            ):
                raise ValueError(
                    f"parameter {fqn!r} is a {type(param).__name__}: fully_shard shards plain "
                    "tensors and tensor-parallel DTensors; other tensor-subclass parameters "
                    "cannot join a group yet. Shard this module's parameters one way only"
                )
            if id(param) not in found:
                tp = tp_shard_of(fqn, param, mesh, spmd) if is_dtensor or spmd else None
                found[id(param)] = ManagedParam(fqn, param, [(mod, name)], tp)
            elif (mod, name) not in found[id(param)].locations:  # a module reached twice
                found[id(param)].locations.append((mod, name))
        for child_name, child in mod._modules.items():
            if child is not None and state_of(child) is None:
                visit(child, f"{prefix}{child_name}.")

    for i, module in enumerate(modules):
        visit(module, f"{i}." if len(modules) > 1 else "")
    return list(found.values())


def _resolve_dp_mesh(
    mesh: Any, dims: Any, reshard_after_forward: Any
) -> tuple[ShardMesh, SPMDMesh | None]:
    """The data-parallel mesh, and for torch 2.13's SPMD form (``dp_mesh_dims``) the full mesh
    with its dp and TP dims. Checked as FSDP2's ``_validate_mesh`` does (a DeviceMesh with
    dim names, the names among them, at least one of shard and replicate set), and what this
    form does not cover yet is refused: replicate-only (DDP), an int
    ``reshard_after_forward`` (FSDP2 refuses it too), and a mesh whose non-dp dims are not
    exactly one TP dim."""
    if dims is None:
        return resolve_mesh(mesh), None
    where = f"fully_shard(dp_mesh_dims={dims!r})"
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(
            f"{where}: expected a torch.distributed.fsdp.DataParallelMeshDims, e.g. "
            "DataParallelMeshDims(shard='dp_shard')"
        )
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names is None:
        raise ValueError(
            f"{where}: mesh must be the full DeviceMesh with mesh_dim_names that the "
            f"parameters are DTensors on, got {mesh!r}; pass mesh=init_device_mesh(..., "
            "mesh_dim_names=('dp_shard', 'tp'))"
        )
    names = tuple(mesh.mesh_dim_names)
    shard, replicate = dims.shard_names, dims.replicate_names
    if not shard and not replicate:
        raise ValueError(f"{where}: set at least one of shard and replicate (as FSDP2 requires)")
    for name in shard + replicate:
        if name not in names:
            raise ValueError(
                f"{where}: mesh dim name {name!r} is not one of the mesh's dims {names}; name "
                "the data-parallel dims of the mesh passed as mesh="
            )
    if len(set(shard + replicate)) != len(shard + replicate):
        raise ValueError(f"{where}: a mesh dim is named twice; name each data-parallel dim once")
    if not shard:
        raise NotImplementedError(
            f"{where}: replicate-only (DDP) is not supported by raggedfsdp's fully_shard; name "
            f"the dim to shard over, e.g. DataParallelMeshDims(shard={replicate[0]!r})"
        )
    others = tuple(n for n in names if n not in shard + replicate)
    if len(others) != 1:
        raise NotImplementedError(
            f"{where}: the mesh {names} has {len(others)} dims besides the data-parallel ones "
            f"{others}; raggedfsdp composes with exactly one (the TP dim). "
            + (
                "Without a TP dim, pass plain parameters and fully_shard(..., mesh=mesh) "
                "without dp_mesh_dims"
                if not others
                else "Flatten the model-parallel dims into one, or name the extra ones as "
                "data-parallel"
            )
        )
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"fully_shard(reshard_after_forward={reshard_after_forward}) with dp_mesh_dims: an "
            "int is not supported in the SPMD form (as in FSDP2); pass True or False"
        )
    spmd = SPMDMesh(mesh, tuple(names.index(n) for n in shard + replicate), names.index(others[0]))
    return resolve_mesh(dp_submesh(mesh, shard, replicate)), spmd


def _check_tp_policies(params: list[ManagedParam], mp_policy: MixedPrecisionPolicy | None) -> None:
    """The FP8 gathers quantize tiles of the unsharded tensor, which a TP parameter does not
    have on one rank: refused, naming the parameter."""
    first = next((mp for mp in params if mp.tp is not None), None)
    if first is not None and mp_policy is not None and mp_policy.all_gather is not None:
        raise ValueError(
            f"parameter {first.fqn!r} is tensor-parallel ({first.tp.placement!r}): "
            "MixedPrecisionPolicy(all_gather=...) (FP8 gathers) does not compose with tensor "
            "parallelism yet; wrap the TP modules without all_gather"
        )


def _check_mesh_device(mesh: ShardMesh, param: torch.Tensor, fqn: str) -> None:
    device_mesh = mesh.device_mesh
    if device_mesh is not None and param.device.type not in (device_mesh.device_type, "meta"):
        raise ValueError(
            f"mesh is a {device_mesh.device_type!r} DeviceMesh but parameter {fqn!r} is on "
            f"{param.device}. Unlike FSDP2, fully_shard does not move modules: call "
            f"module.to({device_mesh.device_type!r}) first (or build the model under "
            'torch.device("meta") and to_empty() after wrapping), or build the mesh for '
            f"{param.device.type}"
        )
