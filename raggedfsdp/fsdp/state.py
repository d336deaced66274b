"""Per-module FSDP state: forward/backward hooks, the root's lazy set-up, prefetching.

Like FSDP2, each ``fully_shard`` call attaches a state to its module; the first wrapped module
whose forward runs becomes the *root*, collects every state below it into a ``RootContext`` and
from then on:

* pre-forward: finish (or start) the group's all-gather, point the module at the unsharded
  parameters, and start prefetching the next group in the recorded forward order (or the
  modules ``set_modules_to_forward_prefetch`` named);
* post-forward: reshard (keeping a chunk for a subgroup's all-gather if
  ``reshard_after_forward`` is an int; not at all if asked not to, and then under
  ``torch.no_grad`` keeping only the memory, showing the sharded parameters again; by default
  not the root's main group either, as FSDP2: its backward comes first, and freeing it would
  cost a second all-gather of it per step) and hook the
  outputs so the group is gathered again (unless ``set_unshard_in_backward(False)``, the
  default for groups of ``nn.Embedding`` weights, whose backward reads none), and the
  one before it (or those ``set_modules_to_backward_prefetch`` named) prefetched, when their
  gradients arrive;
* backward: each unsharded parameter's post-accumulate hook takes its gradient; when a group
  has them all, its parameters are freed, the gradients go into the flat gradient buffer and
  its reduce-scatter starts asynchronously (the root's norm and head right after the head's
  backward: its embedding is in a group of its own, freed after forward; see ``FSDPState``).
  A group whose modules' inputs take gradients also waits for those (FSDP2's post-backward
  signal): frozen weights, and weights reused in several reentrant checkpoints, are read after
  their gradients are in;
* at the end of backward (an autograd callback queued by the root): reduce what is left (unused
  parameters get zeros), wait for every reduce-scatter, set the sharded ``.grad`` views and
  reshard everything.

Recomputation under activation checkpointing runs forward hooks inside backward; they then only
make sure the parameters are unsharded and never reshard. A backward aborted by an error never
reaches its end-of-backward callback; the root's next forward (or ``reset_iter_state()``)
discards what it left behind.

The hooks are kept out of ``torch.compile`` (``torch._dynamo.disable``, as FSDP2's are): traced,
they cut a compiled block into three graphs around their collectives; skipped, a compiled block
is one graph, shared by every block of the same shape.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from raggedfsdp.comm import ShardMesh, shard_subgroup
from raggedfsdp.comm.fingerprint import check_fingerprint
from raggedfsdp.fsdp.mixed_precision import MixedPrecisionPolicy
from raggedfsdp.fsdp.outputs import output_tensors
from raggedfsdp.fsdp.param_group import ParamGroup
from raggedfsdp.sharding.schedule import prefetch_ends, reduces_in_flight

__all__ = [
    "STATE_ATTR",
    "FSDPState",
    "RootContext",
    "in_backward",
    "reduced_in_this_backward",
    "state_of",
    "unfinished_backward",
]

#: The attribute under which ``fully_shard`` keeps a module's ``FSDPState`` (on the module).
STATE_ATTR = "_raggedfsdp_state"

_LIVE_CONTEXTS: weakref.WeakSet[RootContext] = weakref.WeakSet()


def state_of(module: nn.Module) -> FSDPState | None:
    """The ``FSDPState`` of a ``fully_shard``-ed module, or None for any other module."""
    return getattr(module, STATE_ATTR, None)


def in_backward() -> bool:
    """Whether the caller runs inside an autograd backward pass (a hook or a recomputation)."""
    return torch._C._current_graph_task_id() != -1


def unfinished_backward(params: list[torch.Tensor]) -> RootContext | None:
    """The context, among those owning one of ``params``, whose backward started and has not
    finished reducing gradients (still running, or aborted by an error)."""
    active = [ctx for ctx in _LIVE_CONTEXTS if ctx.backward_active]
    if not active:  # the usual case, checked before every optimizer step: no set to build
        return None
    ids = {id(p) for p in params}
    for ctx in active:
        if any(id(mp.sharded) in ids for s in ctx.states for g in s.groups for mp in g.params):
            return ctx
    return None


def reduced_in_this_backward(params: list[torch.Tensor]) -> bool:
    """Whether a running backward has already set the final ``.grad`` of every trainable one of
    ``params`` (an optimizer over them may step inside backward: optimizer-in-backward)."""
    return any(ctx.grads_final(params) for ctx in _LIVE_CONTEXTS if ctx.backward_active)


class RootContext:
    """Shared by all states under one root: forward order, streams, end-of-backward work."""

    def __init__(self, states: list[FSDPState]) -> None:
        self.states = states
        self.forward_order: list[FSDPState] = []
        self.order_recorded = False
        self._plans: tuple[_PrefetchPlan, _PrefetchPlan] | None = None  # once recorded
        self._frontier = {False: -1, True: -1}  # furthest position prefetched, per pass
        self.backward_active = False
        self.reducing: list[ParamGroup] = []  # reduce-scatters in flight, oldest first
        self.final: set[int] = set()  # ids of sharded params whose .grad this backward set
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        _LIVE_CONTEXTS.add(self)

    def comm_streams(self) -> tuple[torch.cuda.Stream | None, torch.cuda.Stream | None]:
        """(all-gather stream, reduce-scatter stream) on CUDA, so communication overlaps
        compute; ``(None, None)`` elsewhere. Per device: ``to()`` may move the model."""
        device = next((s.group.device for s in self.states if s.group), None)
        if device is None or device.type != "cuda":
            return (None, None)
        if device not in self._streams:
            with torch.cuda.device(device):
                self._streams[device] = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._streams[device]

    def prefetch_targets(self, state: FSDPState, backward: bool) -> list[FSDPState]:
        """The states whose all-gathers ``state``'s hook starts in this pass (forward, or
        backward: the root's layers first, then the others in reverse forward order): those of
        its prefetch window (``_PrefetchPlan``: the next group, more while they are small,
        ``raggedfsdp.sharding.schedule``) that no earlier hook of the pass started."""
        if not self.order_recorded:
            return []
        if self._plans is None:
            order = self.forward_order
            self._plans = (_PrefetchPlan.forward(order), _PrefetchPlan.backward(order))
        plan = self._plans[backward]
        i = plan.position.get(state)
        if i is None:
            return []
        start, end = max(i + 1, self._frontier[backward] + 1), plan.ends[i]
        self._frontier[backward] = max(self._frontier[backward], end)
        return plan.sequence[start : end + 1]

    def start_forward(self) -> None:
        """A new forward pass: its prefetches start again from the first group."""
        self._frontier[False] = -1

    def start_backward(self) -> None:
        if not self.backward_active:
            self.backward_active = True
            self._frontier[True] = -1
            self.final.clear()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_reduce(self, group: ParamGroup) -> None:
        """Finish ``group``'s reduction, then run the post-accumulate-grad hooks of the sharded
        parameters whose ``.grad`` it set, as autograd would for a leaf (FSDP2 does the same):
        optimizer-in-backward steps each parameter there, while backward goes on."""
        params = group.finish_reduce()
        self.final.update(map(id, params))
        for param in params:
            for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(param)

    def grads_final(self, params: list[torch.Tensor]) -> bool:
        """Whether this backward has already set the final ``.grad`` of every trainable one of
        ``params`` (an optimizer over them may step inside backward)."""
        return all(id(p) in self.final for p in params if p.requires_grad)

    def reduce(self, group: ParamGroup) -> None:
        """Start ``group``'s reduce-scatter. The newest ones whose full gradient buffers total
        at most ``LATENCY_BOUND_BYTES`` stay in flight (``raggedfsdp.sharding.schedule``),
        overlapping the next groups' backward (on CUDA at least one, on its stream); older
        ones are finished, so large buffers never pile up. On CPU a large group's is finished
        right away, which frees the buffer (and gloo's internal copy of the input) at once."""
        # every gradient is in: free the parameters before the flat buffer is filled
        group.reshard(free=group.reshard_after_backward)
        group.reduce_grads()
        self.reducing.append(group)
        sizes = [g.gradient_bytes for g in self.reducing]
        keep = reduces_in_flight(sizes, at_least_one=group.device.type == "cuda")
        while len(self.reducing) > keep:
            self.finish_reduce(self.reducing.pop(0))
        self.release_finished_reduces()

    def release_finished_reduces(self) -> None:
        """Finish the oldest reduce-scatters while they are done, freeing their full gradient
        buffers. Oldest first and only those whose finish is local: when a reduction is done
        differs between ranks, so one whose finish starts a collective (HSDP's replicate
        all-reduce) waits for its turn in ``reduce``, where every rank finishes it at the same
        point of the step, in the same order."""
        while (
            self.reducing
            and self.reducing[0].finish_is_local
            and self.reducing[0].reduce_completed()
        ):
            self.finish_reduce(self.reducing.pop(0))

    def reset(self) -> None:
        """Forget a backward that an error aborted (its end-of-backward callback never ran):
        wait for its collectives, drop its partial gradients and reshard every group."""
        for group in (g for s in self.states for g in s.groups):
            group.discard_grads()
            group.reshard()
        self.reducing.clear()
        self.final.clear()
        self.backward_active = False

    def finish_backward(self, reduce_accumulated: bool = False) -> None:
        """The end of a backward (autograd's final callback), or with ``reduce_accumulated``
        a flush of what backwards without sync accumulated, every group's gradients reduced.
        After a backward that is not the step's last (``set_is_last_backward(False)``) the
        reduce-scatters still in flight stay so."""
        groups = [g for s in self.states for g in s.groups]
        for group in groups:  # groups with unused parameters never completed: zeros for those
            if (
                (group.requires_gradient_sync or reduce_accumulated)
                and group.has_unreduced_grads
                and not group.reduce_pending
            ):
                self.reduce(group)
        last = reduce_accumulated or all(s.is_last_backward for s in self.states)
        for group in [*self.reducing, *groups] if last else groups:
            # parameters first, as in reduce(): then the flat buffer
            group.reshard(free=group.reshard_after_backward)
            group.flush_held_grads()  # no-sync accumulation continues in the flat buffer
            if last and group.reduce_pending:  # (not last: those in flight stay so)
                self.finish_reduce(group)
            group.forget_backward()
        if last:
            self.reducing.clear()
        self.final.clear()
        self.backward_active = False


class FSDPState:
    """Hooks and settings of one ``fully_shard`` call: one module, or several sharing a group
    (e.g. ``[model.norm, model.output]``), which then gathers before the first of them runs its
    forward and reshards after the last.

    A call whose parameters mix weights of plain ``nn.Embedding`` modules with others plans
    the embeddings into a second group, ``forward_only``: gathered with the first before
    forward, freed after it (backward of a lookup reads no weight) and never gathered for
    backward. The usual root (embedding, final norm, head) then holds only its norm and head
    during backward, where FSDP2 holds the embedding too. If the forward's autograd graph
    shows another use of an embedding weight (a head tied by reading ``embed.weight``), the
    group is kept for backward, as before."""

    def __init__(
        self,
        modules: list[nn.Module],
        group: ParamGroup | None,
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy,
        forward_only: ParamGroup | None = None,
    ) -> None:
        self.module_refs = [weakref.ref(m) for m in modules]
        self.class_names = [type(m).__name__ for m in modules]  # before fully_shard swaps them
        self.group = group
        self.forward_only = forward_only
        # the main group, then ``forward_only`` if its parameters have one (read by every hook)
        self.groups: tuple[ParamGroup, ...] = tuple(
            g for g in (group, forward_only) if g is not None
        )
        self.reshard_after_forward = reshard_after_forward
        # the subgroup an int reshards to: made at the root's set-up, once the ranks are known
        # to agree (a rank asking for another one would otherwise hang in its creation)
        self.post_forward_mesh: ShardMesh | None = None
        self.mp_policy = mp_policy
        self.ctx: RootContext | None = None
        self.is_root = False
        # FSDP2's explicit prefetch lists (None: the next group in the recorded order) and
        # ``set_unshard_in_backward``
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        # FSDP2 gathers every group for backward; one of embedding weights is never read there
        self.unshard_in_backward = group is not None and bool(group.read_in_backward)
        self._yet_to_run: set[int] = set()  # ids of this forward's modules that have not run
        self.is_last_backward = True  # set_is_last_backward(False): a microbatch's backward
        # with a forward_only group: this forward's outputs, and its inputs' autograd nodes
        # (where the search for other uses of the embedding weights stops)
        self._outputs: list[torch.Tensor] = []
        # a module of this forward returned no tensor taking a gradient that could be found:
        # nothing would gather the group for backward, so it stays gathered until then
        self._outputs_unseen = False
        self._input_nodes: set[Any] = set()
        # this forward's number, and how many of its modules' input gradients are still to
        # come (None: some module had no input that takes a gradient)
        self._forward_id = 0
        self._inputs_pending: int | None = 0
        for module in modules:
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self.post_forward, prepend=False)
        self._hooked: set[int] = set()  # ids of the unsharded params whose gradients are hooked
        self._hook_gradients()
        self._hook_state_dicts()

    def _hook_gradients(self) -> None:
        """Take each unsharded parameter's gradient as autograd accumulates it (a hook needs
        ``requires_grad``: one unfrozen after wrapping is hooked at its next forward)."""
        for group in self.groups:
            for i, mp in enumerate(group.params):
                if mp.unsharded.requires_grad and id(mp.unsharded) not in self._hooked:
                    mp.unsharded.register_post_accumulate_grad_hook(self._grad_hook(group, i))
                    self._hooked.add(id(mp.unsharded))

    def _hook_state_dicts(self) -> None:
        """A state dict saved or loaded while a group is gathered (between forward and
        backward with ``reshard_after_forward=False``, or mid-step) sees the sharded
        parameters, as FSDP2's does: the modules holding them show them again first. The
        gathered memory stays, and the next forward or backward points the modules at it
        again (``use_unsharded_params``)."""
        for group in self.groups:
            modules = {id(m): m for mp in group.params for m, _ in mp.locations}
            show_sharded = _showing_sharded(weakref.ref(group))
            for module in modules.values():
                module.register_state_dict_pre_hook(show_sharded)
                module._register_load_state_dict_pre_hook(show_sharded)

    def convert(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``Module._apply``'s conversion of the groups (see ``ParamGroup.convert``)."""
        if any([group.convert(fn) for group in self.groups]):  # a list: convert every group
            self._hooked.clear()  # the unsharded parameters are new objects
            self._hook_gradients()

    # ----------------------------------------------------------------------------- set-up
    @property
    def modules(self) -> list[nn.Module]:
        return [ref() for ref in self.module_refs]

    def _lazy_init(self) -> None:
        if self.ctx is not None:
            return
        paths: dict[FSDPState, list[str]] = {}  # every state below the root, in module order
        for root, class_name in zip(self.modules, self.class_names, strict=True):
            for path, module in root.named_modules():
                below = state_of(module)
                if below is not None:
                    name = path or f"root ({class_name})"
                    paths.setdefault(below, []).append(name)
        states = list(paths)
        for state, names in paths.items():
            name = names[0] if len(names) == 1 else f"[{', '.join(names)}]"
            if state.group is not None:
                state.group.name = name
            if state.forward_only is not None:
                state.forward_only.name = f"{name}: embeddings"
        _check_ranks_agree(states)
        for state in states:
            size = state.reshard_after_forward
            if type(size) is int and state.group is not None and state.post_forward_mesh is None:
                state.post_forward_mesh = shard_subgroup(state.group.mesh, size)
        ctx = RootContext(states)
        for state in states:
            if state.ctx is None:
                state.ctx = ctx
        self.is_root = True

    # ----------------------------------------------------------------------------- forward
    @torch._dynamo.disable
    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """The forward pre-hook of each of the call's modules (and of methods registered with
        ``register_fsdp_forward_method``): gather, prefetch, point at unsharded parameters."""
        self._lazy_init()
        ctx = self.ctx
        recompute = in_backward()
        if self.is_root and not recompute:  # a new forward: forget modules that never ran
            for state in ctx.states:
                state._yet_to_run.clear()
            if ctx.backward_active:
                warnings.warn(
                    "the previous backward through this model raised before it finished "
                    "reducing gradients; its partial gradients are discarded",
                    stacklevel=3,
                )
                ctx.reset()
        first_to_run = not recompute and not self._yet_to_run
        if first_to_run:
            self._yet_to_run = {id(m) for m in self.modules}
            self._outputs, self._input_nodes = [], set()
            self._outputs_unseen = False
            self._forward_id += 1
            self._inputs_pending = 0
            if self.group is not None:
                self.group.awaits_inputs = False
            if not ctx.order_recorded and self not in ctx.forward_order:
                ctx.forward_order.append(self)
        for group in self.groups:  # start all, then wait: a second group's gather overlaps
            group.unshard(async_op=True)
        for group in self.groups:
            group.unshard()
            group.use_unsharded_params()  # with the sharded parameters' requires_grad
        self._hook_gradients()
        if not recompute and torch.is_grad_enabled():
            if self.group is not None:
                args, kwargs = self._watch_inputs((args, kwargs))
            if self.forward_only is not None:
                self._input_nodes.update(_autograd_nodes((args, kwargs)))
        if first_to_run:
            if self.is_root:
                ctx.start_forward()
            targets = self.forward_prefetch
            if targets is None:
                targets = ctx.prefetch_targets(self, backward=False)
            _prefetch([g for s in targets for g in s.groups])
        mp = self.mp_policy
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
        return args, kwargs

    @torch._dynamo.disable
    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        """The forward hook of each of the call's modules: reshard after the last of them and
        hook the outputs for backward."""
        if in_backward():  # recomputation for activation checkpointing: backward needs them
            return output
        tensors = output_tensors(output)
        if not tensors and torch.is_grad_enabled() and self.group is not None:
            self._outputs_unseen = any(mp.unsharded.requires_grad for mp in self.group.params)
        if self.forward_only is not None:
            self._outputs += tensors
        self._yet_to_run.discard(id(module))
        if not self._yet_to_run:  # the last of the group's modules has run its forward
            if self.is_root:
                self.ctx.order_recorded = True
            self._reshard_after_forward()
        if tensors:
            register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        return output

    def _reshard_after_forward(self) -> None:
        backward_comes = torch.is_grad_enabled()
        keep = self.reshard_after_forward is False
        if self.reshard_after_forward is None and self.is_root and backward_comes:
            # FSDP2's root: its backward (the head's) comes first, so gathering it again there
            # would add an all-gather per step and leave it exposed (its embedding group,
            # ``forward_only``, is still freed: backward reads none of it)
            keep = True
        # Outputs hidden where no search finds them (a closure, an opaque object): backward
        # may read the parameters with no gradient of ours to gather them first, so they stay
        # gathered until their gradients are in (correct; memory held as for the root's group).
        keep = keep or (self._outputs_unseen and backward_comes)
        outputs, stop = self._outputs, self._input_nodes
        self._outputs, self._input_nodes = [], set()  # holding the outputs would keep the graph
        for group in self.groups:
            if group is self.forward_only and backward_comes:
                # Kept where the user keeps parameters (no all-gather next forward), or where
                # backward may read a weight beyond its lookups: then, like any group's, until
                # every one of its gradients is in. A frozen weight's reads leave no trace in
                # the graph (no gradient node): kept to the end of backward, as FSDP2 does.
                frozen = not all(mp.requires_grad for mp in group.params)
                read = frozen or _read_beyond_lookups(group, outputs, stop)
                group.read_in_backward = frozenset(range(len(group.params)) if read else ())
                free = self.reshard_after_forward is not False and group.reshard_after_backward
                if free and not read:
                    group.reshard()
            elif not keep:
                # an int (not a bool) keeps a chunk for backward; no backward: none needed
                partial = type(self.reshard_after_forward) is int and backward_comes
                group.reshard(keep_for=self.post_forward_mesh if partial else None)
            elif not backward_comes:
                # No backward will come: the module shows its sharded parameters again (state
                # dicts, optimizers); the memory stays only where the user asked to keep it
                # (``reshard_after_forward=False``, e.g. for evaluation loops), so the next
                # forward needs no all-gather.
                group.reshard(free=False)

    # ----------------------------------------------------------------------------- backward
    @torch._dynamo.disable
    def _pre_backward(self, grad: torch.Tensor) -> None:
        ctx = self.ctx
        ctx.start_backward()
        # The root's backward (the head's) comes right after the loss's, usually the step's
        # memory summit: a root gathered only now does not prefetch the next group beside it.
        gathers = self.group is not None and self.unshard_in_backward
        regathered_root = self.is_root and gathers and not self.group.is_unsharded
        if gathers:
            self.group.unshard()
            # recomputation (activation checkpointing) may run forward code that does not
            # pass through this module's hooks (e.g. a checkpointed inner forward)
            self.group.use_unsharded_params()
        targets = self.backward_prefetch
        if targets is None:
            targets = [] if regathered_root else ctx.prefetch_targets(self, backward=True)
        _prefetch([s.group for s in targets if s.needs_backward_gather])

    @property
    def needs_backward_gather(self) -> bool:
        """Whether backward still reads this state's main group: not once the gradients of
        all it may read are in (the first block does not prefetch back a root whose norm and
        head are done)."""
        group = self.group
        return group is not None and self.unshard_in_backward and not group.done_reading

    def _grad_hook(self, group: ParamGroup, index: int) -> Callable[[nn.Parameter], None]:
        """The hook holds the state and the group weakly: held strongly, the cycle tensor ->
        hook -> group -> tensor runs through a tensor's hooks, which Python's garbage collector
        does not see, and a deleted model would never be freed."""
        state_ref, group_ref = weakref.ref(self), weakref.ref(group)

        def hook(param: nn.Parameter) -> None:
            state, group = state_ref(), group_ref()
            if state is None or group is None:  # the model was deleted during its backward
                return
            ctx = state.ctx
            if not ctx.backward_active:  # (checked here: this runs for every parameter)
                ctx.start_backward()
            if ctx.reducing:
                ctx.release_finished_reduces()
            group.accumulate_grad(index, param)
            state._release(group)

        return hook

    def _release(self, group: ParamGroup) -> None:
        """Once backward reads ``group``'s parameters no more: reduce its gradients if they
        are all in (this frees the parameters first), else free the parameters alone (only
        embedding gradients to come, which need no weights; or accumulating without sync)."""
        if not group.done_reading:
            return
        if group.requires_gradient_sync and group.num_trainable and group.grads_complete:
            if not group.reduce_started:
                self.ctx.reduce(group)
        elif group.is_unsharded and group.reshard_after_backward:
            group.reshard()

    def _watch_inputs(self, tree: Any) -> Any:
        """Pass this module's inputs that take a gradient through ``_InputsBackward``, whose
        backward runs once their gradients are computed: no node of the module's backward is
        left to run then (FSDP2's post-backward signal), even one reading a frozen parameter
        or recomputing a reentrant checkpoint. It runs before the gradient reaches the module
        that made the inputs, so the group is freed before that one prefetches the next. A
        group whose modules take no such input goes by its gradients (``done_reading``)."""
        flat, rebuild = _leaves(tree)
        where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:
            self._inputs_pending = None
        elif self._inputs_pending is not None:
            self._inputs_pending += 1
            watched = _InputsBackward.apply(self, self._forward_id, *(flat[i] for i in where))
            for i, tensor in zip(where, watched, strict=True):
                flat[i] = tensor
        self.group.awaits_inputs = self._inputs_pending is not None
        return rebuild(flat)

    @torch._dynamo.disable
    def _input_grads_done(self, forward_id: int) -> None:
        if forward_id != self._forward_id or self._inputs_pending is None:
            return  # an older forward's backward: the group waits for the end of backward
        self._inputs_pending -= 1
        if self._inputs_pending == 0:
            self.ctx.start_backward()
            self.group.inputs_done = True
            self._release(self.group)


class _InputsBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward tells the state that their gradients are
    computed (FSDP2's ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, forward_id: int, *inputs: torch.Tensor) -> Any:
        ctx.state, ctx.forward_id = state, forward_id
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.state._input_grads_done(ctx.forward_id)
        return (None, None, *grads)


def _leaves(tree: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[list[Any], Callable]:
    """A forward's ``(args, kwargs)`` as a list of leaves and the function that rebuilds it from
    them. The usual call, positional tensors only, needs no pytree walk (a dozen Python calls
    per module per step)."""
    args, kwargs = tree
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        return list(args), lambda flat: (tuple(flat), kwargs)
    flat, spec = tree_flatten(tree)
    return flat, lambda flat: tree_unflatten(flat, spec)


class _PrefetchPlan:
    """One pass's order of hooks, planned once the forward order is recorded: ``sequence`` the
    states in the order their groups are needed, ``position`` each hook's place in it, and
    ``ends[i]`` the last place the hook at ``i`` prefetches up to (``prefetch_ends``)."""

    def __init__(self, sequence: list[FSDPState], hooks: int, sizes: list[int]) -> None:
        self.sequence = sequence
        self.position = {state: i for i, state in enumerate(sequence[:hooks])}
        self.ends = prefetch_ends(sizes, hooks)

    @classmethod
    def forward(cls, order: list[FSDPState]) -> _PrefetchPlan:
        sizes = [sum(g.gathered_bytes for g in s.groups) for s in order]
        return cls(order, len(order), sizes)

    @classmethod
    def backward(cls, order: list[FSDPState]) -> _PrefetchPlan:
        """The root's layers (the head) first, the others in reverse forward order, and last
        the root again: the first block may prefetch a root that backward still reads."""
        if len(order) < 2:
            return cls(order, len(order), [0] * len(order))
        sequence = [order[0], *order[:0:-1], order[0]]
        sizes = [s.group.gathered_bytes if s.group is not None else 0 for s in sequence]
        return cls(sequence, len(order), sizes)


def _prefetch(groups: list[ParamGroup]) -> None:
    """Start the all-gathers of ``groups`` (already gathered ones are skipped)."""
    for group in groups:
        group.unshard(async_op=True)


def _autograd_nodes(tree: Any) -> set[Any]:
    return {
        t.grad_fn
        for t in tree_flatten(tree)[0]
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    }


def _read_beyond_lookups(group: ParamGroup, outputs: list[torch.Tensor], stop: set[Any]) -> bool:
    """Whether a node of the autograd graph from ``outputs`` back to ``stop`` (the nodes of
    the forward's inputs) other than an embedding lookup takes one of ``group``'s unsharded
    parameters: its backward may read the weight (e.g. a head tied by ``h @ embed.weight.T``).
    A lookup's backward needs only the indices and the weight's size. One pass over the
    forward's graph (about 1 ms for a 32-layer transformer)."""
    ids = {id(mp.unsharded) for mp in group.params}
    seen = set(stop)
    pending = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is None or child in seen:
                continue
            if type(child).__name__ != "AccumulateGrad":
                pending.append(child)
            elif id(child.variable) in ids and type(node).__name__ != "EmbeddingBackward0":
                return True
    return False


def _check_ranks_agree(states: list[FSDPState]) -> None:
    """Before the first collective: every rank must have wrapped the same model the same way
    (a different model, shard policy or mixed-precision setting would plan other layouts and
    exchange the wrong bytes). One fingerprint all-reduce over the first group's mesh."""
    groups = [g for s in states for g in s.groups]
    if not groups or groups[0].mesh.shard_size * groups[0].mesh.replicate_size == 1:
        return
    signatures = [
        (
            f"{g.name}: {mp.fqn}",
            f"group {g.name!r} parameter {mp.fqn!r}: shape {g.layout.by_name[mp.fqn].shape}, "
            f"{g.orig_dtype}, unit {g.layout.by_name[mp.fqn].unit}, offset "
            f"{g.layout.offsets[mp.fqn]} of a {g.layout.segment_size}-element segment, "
            f"requires_grad {mp.requires_grad}, TP {None if mp.tp is None else mp.tp.placement!r} "
            f"over {1 if mp.tp is None else mp.tp.size}, {state.mp_policy}, reshard_after_forward "
            f"{state.reshard_after_forward}",
        )
        for state in states
        for g in (part for group in state.groups for part in group.parts)  # one per dtype
        for mp in g.params
    ]
    check_fingerprint(groups[0].mesh, signatures, what="fully_shard parameter")


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t, tree
    )


def _showing_sharded(group_ref: weakref.ref[ParamGroup]) -> Callable[..., None]:
    """A state-dict pre-hook pointing a group's modules at its sharded parameters; holds the
    group weakly (the module holds the hook, the group holds the module)."""

    def hook(*args: Any, **kwargs: Any) -> None:
        group = group_ref()
        if group is not None:
            group.use_sharded_params()

    return hook
