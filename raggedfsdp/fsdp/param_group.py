"""``ParamGroup``: the parameters of one ``fully_shard`` call, planned into flat buffers.

One group owns three flat buffers laid out by one plan:

* ``master``: the sharded parameters in their own dtype. Its local segment is what the sharded
  ``RaggedTensor`` parameters view and what the optimizer updates.
* ``compute``: the all-gather buffer. Its full buffer *is* the unsharded parameters (each one a
  view), so the all-gather writes parameters in place; without mixed precision it is ``master``
  itself and even the all-gather input needs no copy.
* ``grads``: once the group's last fresh gradient has arrived and its parameters are freed,
  each one is copied (cast, if ``reduce_dtype`` asks) into its slice of the full gradient
  buffer and freed; the reduce-scatter runs in place on that buffer, and the sharded ``.grad``
  tensors are views of its output segment. With one shard rank the gradients go straight into
  that segment: there is nothing to scatter.

Nothing is copied into or out of a communication buffer around a collective.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

from raggedfsdp.comm import (
    CommHandle,
    ShardMesh,
    all_gather_flat,
    all_reduce_flat,
    reduce_scatter_flat,
)
from raggedfsdp.comm.errors import failing_as
from raggedfsdp.fsdp.float8_gather import Float8Gather, float8_notes
from raggedfsdp.fsdp.managed_param import ManagedParam
from raggedfsdp.fsdp.mixed_precision import MixedPrecisionPolicy
from raggedfsdp.fsdp.placement import placement_notes
from raggedfsdp.fsdp.tensor_parallel import local_grad, tp_block_notes, tp_spec
from raggedfsdp.sharding import (
    FlatBuffer,
    Layout,
    RaggedTensor,
    ShardPolicy,
    StrictPolicy,
    TensorSpec,
    combine,
    resolve_units,
)
from raggedfsdp.sharding import plan_layout as _plan_layout
from raggedfsdp.sharding.schedule import gathers_a_copy
from raggedfsdp.sharding.units import expert_notes, float8_block_policy

__all__ = ["ParamGroup", "is_plain_embedding_weight"]


class ParamGroup:
    """Flat buffers, collectives and parameter swapping for one ``fully_shard`` call."""

    def __init__(
        self,
        params: list[ManagedParam],
        mesh: ShardMesh,
        mp_policy: MixedPrecisionPolicy,
        shard_policy: ShardPolicy,
        comm_streams: Callable[[], tuple[torch.cuda.Stream | None, torch.cuda.Stream | None]],
        name: str = "",
        offload: CPUOffloadPolicy | None = None,
    ) -> None:
        self.name = name  # for error messages; the root renames groups to module paths
        self.params = params
        self.mesh = mesh
        self.offload = offload
        self._comm_streams = comm_streams
        first = params[0].original
        self.device, self.orig_dtype = first.device, first.dtype
        # FSDP2's rule: param_dtype, reduce_dtype and FP8 gathers apply to float parameters;
        # integer and bool ones (frozen) are gathered as they are
        self.mp_policy = mp_policy if first.dtype.is_floating_point else MixedPrecisionPolicy()
        for mp in params[1:]:  # one dtype per group: fully_shard splits a call by dtype
            p = mp.original
            if p.device != self.device or p.dtype != self.orig_dtype:
                raise ValueError(
                    f"parameter {mp.fqn!r} is {p.dtype} on {p.device} but {params[0].fqn!r} is "
                    f"{self.orig_dtype} on {self.device}: one flat buffer holds one dtype on "
                    "one device (fully_shard plans each dtype into its own). Move the module "
                    "first, or wrap the differing submodule in its own fully_shard call."
                )
        fp8 = self.mp_policy.all_gather
        if fp8 is not None and offload is not None:
            raise ValueError(
                f"fully_shard group {name!r}: MixedPrecisionPolicy(all_gather={fp8!r}) with "
                "offload_policy=CPUOffloadPolicy(...) is not supported yet (the FP8 payload is "
                "packed from the sharded parameters); drop one of them"
            )
        self._plan(shard_policy)
        compute_dtype = self.mp_policy.param_dtype or self.orig_dtype
        self._float8 = None if fp8 is None else Float8Gather(self.layout, fp8, compute_dtype)
        if fp8 is not None:
            self.notes += float8_notes(self.layout, fp8, compute_dtype, name)
        self._build_storage(self.device)
        with torch.no_grad():
            self.master.load_full_tensors({mp.fqn: mp.local_original for mp in params})
        for mp in params:
            mp.original = None
        self.is_unsharded = False
        self._gather: CommHandle | None = None
        self._payload: torch.Tensor | None = None  # the FP8 gather's bytes until unpacked
        self.all_gather_bytes = 0  # bytes of every all-gather output so far (a metric)
        self._compute_version = 0  # the compute buffer's version before the pending gather
        self._reduce: tuple[CommHandle, torch.Tensor] | None = None
        self._received: set[int] = set()  # params whose gradient is in `grads.full` this window
        self.arrived: set[int] = set()  # params whose gradient came in the current backward
        # Whether this forward's modules all had inputs that take a gradient (the state then
        # sets ``inputs_done`` when backward has computed those: no node of the modules'
        # backward is left to run, FSDP2's post-backward signal)
        self.awaits_inputs = False
        self.inputs_done = False
        self.reduce_started = False  # this backward's reduction of the group has begun
        self._read_in_backward = frozenset(
            i for i, mp in enumerate(params) if not is_plain_embedding_weight(mp)
        )
        self._held: dict[int, torch.Tensor] = {}  # fresh gradients not yet in the flat buffer
        self._gathered_version = -1  # _master_version() when the last gather started
        self._partial: torch.Tensor | None = None  # HSDP: reduce-scattered, not yet all-reduced
        self._partial_received: set[int] = set()
        # reshard_after_forward=int: (subgroup, this rank's chunk of the gathered buffer)
        self._post_forward: tuple[ShardMesh, torch.Tensor] | None = None
        # FSDP2's per-group settings (``FSDPModule.set_*``)
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: float | None = None
        self.use_sharded_params()
        self._note_trainable()

    def _plan(self, shard_policy: ShardPolicy) -> None:
        """The layout of the group's TP-local tensors under ``shard_policy`` (every FP8 tile
        whole too, whatever else the policy wants), and the notes a user reads to see why
        blocks do or do not stay whole: the planner's, what the units chose for expert tensors,
        where a TP split cuts the policy's blocks and where a ``shard_placement_fn`` placement
        could not be honoured. Under a ``strict`` policy the last two are errors instead."""
        params, world, fp8 = self.params, self.mesh.shard_size, self.mp_policy.all_gather
        strict = isinstance(shard_policy, StrictPolicy)  # (before FP8 wraps the policy)
        if fp8 is not None:
            shard_policy = combine(shard_policy, float8_block_policy(fp8.tile))
        units = _units(shard_policy, params, self.orig_dtype, world)
        specs = [
            TensorSpec(mp.fqn, tuple(mp.local_original.shape), self.orig_dtype, units[mp.fqn])
            for mp in params
        ]
        self.layout: Layout = _plan_layout(specs, world)
        self.notes: tuple[str, ...] = self.layout.notes + expert_notes(self.layout.tensors)
        cut_by_tp = tp_block_notes(params, shard_policy, units, world)
        unhonoured = placement_notes(shard_policy, self.layout.tensors)  # Shard(d), d > 0
        fixes = (
            (cut_by_tp, "Choose a TP degree or optimizer block that divides the TP block"),
            (unhonoured, "Return Shard(0) from shard_placement_fn for it"),
        )
        for notes, fix in fixes:
            if notes and strict:
                raise ValueError(
                    f"fully_shard group {self.name!r}, strict shard policy: {notes[0]}. {fix}, "
                    "or drop strict(...) to keep this as a note"
                )
        self.notes += cut_by_tp + unhonoured

    def _build_storage(self, device: torch.device) -> None:
        """The flat buffers on ``device`` (zero-filled) and the parameters as views of them."""
        rank = self.mesh.shard_rank
        compute_dtype = self.mp_policy.param_dtype or self.orig_dtype
        reduce_dtype = self.mp_policy.reduce_dtype or compute_dtype
        self.device = device
        host = self.host_device
        pin = self.offload is not None and self.offload.pin_memory and host != device
        # One rank holding the whole group in the dtype it computes in: the sharded and the
        # unsharded parameters are views of one buffer, nothing is ever gathered, copied or
        # freed (FSDP2 copies the shard into a gathered buffer and frees it, twice a step,
        # even for one rank)
        self.shard_is_whole = not gathers_a_copy(
            self.mesh.shard_size,
            casts=compute_dtype != self.orig_dtype,
            offloaded=self.offload is not None,
            float8=self._float8 is not None,
        )
        self.master = FlatBuffer(
            self.layout,
            rank,
            self.orig_dtype,
            host,
            persistent_full=self.shard_is_whole,
            pin_memory=pin,
        )
        self.compute = (
            self.master
            # under CPU offload always a buffer of its own on the device (on a CPU-only
            # machine too: the same code path, the host -> device copy a plain copy)
            if compute_dtype == self.orig_dtype and self.offload is None
            # No persistent compute-dtype segment: each gather casts the master segment into
            # its own place in the gathered buffer (as FSDP2 casts at gather time), and the FP8
            # gather packs its own payload, so a bf16 group keeps 4, not 6, bytes per element
            else FlatBuffer(self.layout, rank, compute_dtype, device, with_shard=False)
        )
        # Only the full gradient buffer persists (as storage that is freed between backwards);
        # sharded gradients are fresh tensors per reduction, freed by zero_grad(set_to_none).
        self.grads = FlatBuffer(self.layout, rank, reduce_dtype, device, with_shard=False)
        # each parameter's views of the gathered and gradient buffers, in order: taken by the
        # hooks every step
        self._compute_views = [self.compute.full_view(mp.fqn) for mp in self.params]
        self._grad_views = [self.grads.full_view(mp.fqn) for mp in self.params]
        for mp, view in zip(self.params, self._compute_views, strict=True):
            spec = tp_spec(self.layout.shards[mp.fqn], mp)
            local = self.master.shard_view(mp.fqn)
            ragged = RaggedTensor(local, spec, rank, self.mesh.shard_group)
            mp.sharded = nn.Parameter(ragged, requires_grad=mp.requires_grad)
            mp.sharded.sharded_use_hint = functools.partial(_use_hint, weakref.ref(self))
            # A TP parameter is handed to the module as the DTensor TP's hooks expect, its
            # local tensor the view of the gathered buffer
            unsharded = view if mp.tp is None else mp.tp.dtensor(view)
            mp.unsharded = nn.Parameter(unsharded, mp.requires_grad)

    @property
    def parts(self) -> tuple[ParamGroup, ...]:
        """The one-dtype groups this group is made of: itself (``DtypeGroups`` has several)."""
        return (self,)

    @property
    def host_device(self) -> torch.device:
        """Where the sharded parameters and gradients live: the CPU under CPU offload (the
        compute device being ``device``), else ``device`` itself."""
        if self.offload is None or self.device.type in ("cpu", "meta"):
            return self.device
        return torch.device("cpu")

    def _comm_stream(self, which: int) -> torch.cuda.Stream | None:
        """The side stream of the all-gathers (0) or reduce-scatters (1) on CUDA; elsewhere
        none, known without asking the root (two collectives per group per step)."""
        return self._comm_streams()[which] if self.device.type == "cuda" else None

    def _failing_as(self, collective: str) -> AbstractContextManager[None]:
        """The context that names this group's ``collective`` if it fails, made once: four
        collectives per step."""
        key = (collective, self.name)  # the root renames its groups at its set-up
        if key not in self._failure_contexts:
            self._failure_contexts[key] = failing_as(
                f"{collective} of fully_shard group {self.name!r} ({len(self.params)} tensors, "
                f"{self.layout.buffer_numel:,} elements) on shard rank {self.mesh.shard_rank} of "
                f"{self.mesh.shard_size}"
            )
        return self._failure_contexts[key]

    @functools.cached_property
    def _failure_contexts(self) -> dict[tuple[str, str], failing_as]:
        return {}

    # ----------------------------------------------------------------------------- parameters
    def _install(self, which: str) -> None:
        for mp in self.params:
            tensor = getattr(mp, which)
            for module, name in mp.locations:
                module._parameters[name] = tensor

    def use_sharded_params(self) -> None:
        self._install("sharded")

    def use_unsharded_params(self) -> None:
        frozen_or_thawed = False  # (then what the bookkeeping checks changes too)
        for mp, view in zip(self.params, self._compute_views, strict=True):
            trainable = mp.sharded.requires_grad
            if mp.unsharded.requires_grad != trainable:
                mp.unsharded.requires_grad_(trainable)
                frozen_or_thawed = True
            if mp.tp is None and not mp.unsharded.is_set_to(view):  # (TP: never rebound)
                # A module moved the parameter onto storage of its own (an RNN's
                # ``flatten_parameters`` on CUDA copies its weights into one cuDNN buffer and
                # ``set_``s them there): it would read that copy's old values from then on.
                # Pointed back (``.data``: no version bump for saved activations to trip on).
                mp.unsharded.data = view
        self._install("unsharded")
        if frozen_or_thawed:
            self._note_trainable()

    @property
    def read_in_backward(self) -> frozenset[int]:
        """Indices of the params whose values backward may read: all but weights of plain
        ``nn.Embedding`` modules, whose backward needs only the token ids and the output
        gradient (fully_shard sets all of them for a forward whose graph reads such a weight
        elsewhere)."""
        return self._read_in_backward

    @read_in_backward.setter
    def read_in_backward(self, indices: frozenset[int]) -> None:
        self._read_in_backward = frozenset(indices)
        self._note_trainable()

    def _note_trainable(self) -> None:
        """What the bookkeeping checks at every gradient's arrival, noted when it can change
        (freezing takes effect at the next forward), so that a check costs no pass over the
        group's parameters: how many gradients come, which of them backward waits for, and
        whether it reads frozen parameters."""
        trainable = frozenset(i for i, mp in enumerate(self.params) if mp.requires_grad)
        self.num_trainable = len(trainable)
        self._reads_to_arrive = self._read_in_backward & trainable
        self.reads_frozen = not self._read_in_backward <= trainable

    # ----------------------------------------------------------------------------- conversion
    def check_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Refuse, before anything changes, a ``Module._apply`` conversion (``to_empty()``,
        ``to()``, ``cuda()``, ``half()``...) that the group cannot follow: one made while it is
        gathered or holds gradients not yet reduced, one to a non-float dtype or under an FP8
        all-gather, or one to a device type the mesh does not communicate on. A float dtype
        change casts the sharded storage, as FSDP2's does (the plan is in elements)."""
        if self.is_unsharded or self._gather is not None or self._post_forward is not None:
            busy = "is gathered"
        elif self._reduce is not None or self.has_unreduced_grads or self._partial is not None:
            busy = "holds gradients not yet reduced"
        else:
            busy = None
        if busy:
            raise RuntimeError(
                f"fully_shard group {self.name!r} {busy}; move or materialize the module between "
                "steps (after a synced backward, or after reshard())"
            )
        with torch.no_grad():
            probe = fn(torch.empty(0, dtype=self.orig_dtype, device=self.device))
        if probe.dtype != self.orig_dtype and (
            self._float8 is not None or not probe.dtype.is_floating_point
        ):
            why = "its FP8 all-gather is set up" if self._float8 is not None else "not a float"
            raise TypeError(
                f"fully_shard group {self.name!r} holds {self.orig_dtype} parameters and cannot "
                f"become {probe.dtype} after wrapping ({why}); cast the module before "
                "fully_shard, or compute in another dtype with "
                "MixedPrecisionPolicy(param_dtype=...)"
            )
        mesh = self.mesh.device_mesh
        if mesh is not None and probe.device.type not in (mesh.device_type, "meta"):
            raise ValueError(
                f"fully_shard group {self.name!r} communicates over a {mesh.device_type!r} "
                f"DeviceMesh and cannot move to {probe.device}; move the module to a "
                f"{mesh.device_type} device, or wrap it with a mesh for {probe.device.type}"
            )

    def convert(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """Apply ``Module._apply``'s ``fn`` to the group (after ``check_conversion``): the local
        segment is converted as one tensor (one transfer, not one per parameter), new flat
        buffers are built where it lands, and the sharded parameters, the same objects as
        before (an optimizer built earlier keeps them; attributes set on them stay), become
        views of them again. Returns whether anything changed; if so, the unsharded parameters
        are new objects."""
        with torch.no_grad():
            segment = fn(self.master.shard)
            if segment is self.master.shard:
                return False
            grads = [None if mp.sharded.grad is None else fn(mp.sharded.grad) for mp in self.params]
        old = [mp.sharded for mp in self.params]
        self.orig_dtype = segment.dtype  # ``.double()`` after wrapping casts the storage (FSDP2)
        self._build_storage(segment.device)
        self.master.load_shard(segment)
        for mp, param, grad in zip(self.params, old, grads, strict=True):
            attributes = dict(param.__dict__)
            param.grad = None
            torch.utils.swap_tensors(param, mp.sharded)
            param.__dict__.update(attributes)
            mp.sharded = param
            param.grad = grad  # a RaggedTensor too: fn ran on it
        self._gathered_version = -1
        self.use_sharded_params()
        return True

    # ----------------------------------------------------------------------------- all-gather
    def unshard(self, async_op: bool = False) -> None:
        """Start (or finish) the all-gather of the parameters into the compute buffer: over the
        subgroup from this rank's post-forward chunk if one was kept (``reshard_after_forward``
        as an int), else over the shard group from the local segment.

        Unsharded parameters (or a chunk) kept from before (``reshard_after_backward=False``, a
        manual ``unshard()``) are gathered again if the sharded ones changed since (an
        optimizer step, a checkpoint load)."""
        if self.device.type == "meta":
            raise RuntimeError(
                f"fully_shard group {self.name!r} is on the meta device: call "
                "module.to_empty(device=...) and initialise its parameters (e.g. "
                "model.init_weights()) before the first forward"
            )
        if self.shard_is_whole:  # the sharded parameters' memory is the unsharded one
            self.is_unsharded = True
            return
        kept = self.is_unsharded or self._post_forward is not None
        if kept and self._master_version() != self._gathered_version:  # (a pass over params)
            self.reshard()
        if self.is_unsharded or self._gather is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        # plain buffers: autograd records none of this, in forward either (no context)
        full = self.compute.alloc_full()
        self._compute_version = full._version
        if self._post_forward is not None:
            mesh, chunk = self._post_forward
        elif self._float8 is not None:  # quantize this rank's tiles into a byte payload
            mesh = self.mesh
            full, chunk = self._float8.pack(self.master, self.mesh.shard_rank)
            self._payload = full
            self._gathered_version = self._master_version()
        else:
            mesh, chunk = self.mesh, self.master.shard
            if self.compute is not self.master:  # cast fp32 -> param_dtype in place (1/W)
                # (or, under CPU offload, copy host -> device; pinned: asynchronous)
                size, rank = chunk.numel(), self.mesh.shard_rank
                pinned = self.master.shard.is_pinned()
                mine = full[rank * size : (rank + 1) * size]
                chunk = mine.copy_(self.master.shard, non_blocking=pinned)
            self._gathered_version = self._master_version()
        self.all_gather_bytes += full.numel() * full.element_size()
        with self._failing_as("all-gather"):
            self._gather = all_gather_flat(
                full,
                chunk,
                mesh.shard_group,
                async_op=async_op,
                comm_stream=self._comm_stream(0),
            )
        if not async_op:
            self.wait_for_unshard()

    @property
    def gathered_bytes(self) -> int:
        """The bytes an all-gather of the group holds: its unsharded parameters (none when
        they are the sharded ones, ``shard_is_whole``)."""
        full = self.compute.full
        return 0 if self.shard_is_whole else full.numel() * full.element_size()

    @property
    def gradient_bytes(self) -> int:
        """The bytes of the full gradient buffer a reduce-scatter holds until it finishes."""
        full = self.grads.full
        return full.numel() * full.element_size()

    def _master_version(self) -> int:
        """Grows with every in-place write to the sharded parameters: through the parameters
        (an optimizer step; RaggedTensor's dispatch writes the local pieces below autograd, so
        only the parameter's own version counter moves) or straight into the master segment,
        which the local pieces and their detached aliases (a state dict's tensors, which DCP
        loads into) view. Writes through ``p.data``, which torch hides from version counters on
        purpose, are not seen."""
        return self.master.shard._version + sum([mp.sharded._version for mp in self.params])

    def wait_for_unshard(self) -> None:
        if self._gather is not None:
            self._wait_gather()
        self.is_unsharded = True

    def _wait_gather(self) -> None:
        gather, self._gather = self._gather, None
        with self._failing_as("all-gather"):
            gather.wait()
        self._post_forward = None  # gathered from it (the handle held it until now)
        if self._payload is not None:
            payload, self._payload = self._payload, None
            with torch.no_grad():
                self._float8.unpack(payload, self.compute)
                if self.mp_policy.all_gather.keep_weights:  # for FP8 matmuls (float8_linear)
                    self._float8.keep(payload, self.params)
        # The collective rewrote the storage that saved activations of the unsharded params
        # point at, with the data they had: undo the version bump (which gloo makes whenever
        # the work completes) so autograd's in-place check stays quiet, as FSDP2 does.
        torch._C._autograd._unsafe_set_version_counter(
            (self.compute.full,), (self._compute_version,)
        )

    def reshard(self, free: bool = True, keep_for: ShardMesh | None = None) -> None:
        """Point the modules back at the sharded parameters and free the unsharded memory
        (``free=False`` keeps it for the next forward: ``reshard_after_backward=False``).

        ``keep_for``, a subgroup of the shard ranks (``reshard_after_forward`` as an int), keeps
        a copy of this rank's chunk of the gathered buffer, ``1/keep_for.shard_size`` of it, so
        that backward gathers over the subgroup only (FSDP2 keeps the same memory)."""
        if not (self.is_unsharded or self._gather is not None or self._post_forward is not None):
            return  # nothing gathered or kept: the modules show the sharded parameters already
        if self._gather is not None:  # a prefetch that was never used: its buffer goes too
            self._wait_gather()
            self.is_unsharded = True
        self.use_sharded_params()
        self._post_forward = None
        if not (self.is_unsharded and free):
            return
        self.is_unsharded = False
        if self.shard_is_whole:
            return  # nothing to free: the memory is the sharded parameters'
        if self._float8 is not None:
            self._float8.drop(self.params)
        if keep_for is not None:
            full = self.compute.full
            size = full.numel() // keep_for.shard_size
            start = keep_for.shard_rank * size
            self._post_forward = (keep_for, full[start : start + size].clone())
        self.compute.free_full()

    # ----------------------------------------------------------------------------- gradients
    def accumulate_grad(self, index: int, param: nn.Parameter) -> None:
        """Post-accumulate hook of unsharded parameter ``index``: take its fresh gradient.

        The group's fresh gradients are held as autograd made them until the last one arrives;
        then the parameters are freed and ``reduce_grads`` copies (casts) each into the flat
        buffer and frees it. Copying each on arrival would put the whole buffer (on CUDA the
        allocator commits it at once; with mixed precision it is fp32, twice the bf16
        gradients) beside the block's activations at the start of its backward; held, the
        gradients cost what FSDP2 holds there, and the copy happens when the block's
        activations are gone and its parameters freed. A group whose gradients arrive spread
        over the whole backward (the root: the head's first, the embedding's last) holds only
        those. Only when accumulating without sync does a gradient go straight into the
        buffer, which then already holds the sum so far.
        """
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        if self.params[index].tp is not None:  # a TP gradient: its local tensor
            grad = local_grad(grad, self.params[index])
        self.arrived.add(index)
        if self.grads.is_full_allocated:
            self._write_grad(index, grad)
        elif index in self._held:  # a second gradient this backward (reentrant checkpointing)
            self._held[index].add_(grad)
        else:  # flushed by reduce_grads after the parameters are freed, or at backward's end
            self._held[index] = grad

    @property
    def done_reading(self) -> bool:
        """Whether backward has no further use for the unsharded parameters. With a signal from
        the modules' inputs, once it came and every trainable parameter backward may read has
        its gradient (a weight reused in several reentrant checkpoints has its gradient before
        the last recomputation reads it). Without one (the root's inputs are token ids), once
        those gradients are in (autograd accumulates a leaf's gradient only after every node
        that takes it as input has run), unless a frozen parameter may be read: no gradient
        says when that is over, so only the end of backward is. Embedding weights are never
        read: a group of them kept gathered after forward is freed at once."""
        if not self._reads_to_arrive <= self.arrived:
            return False
        return self.inputs_done if self.awaits_inputs else not self.reads_frozen

    @property
    def grads_complete(self) -> bool:
        """Whether every trainable parameter's gradient came in the current backward."""
        return len(self.arrived) == self.num_trainable

    def forget_backward(self) -> None:
        """Start the next backward's bookkeeping: no gradient arrived, no input done."""
        self.arrived.clear()
        self.inputs_done = False
        self.reduce_started = False

    def flush_held_grads(self) -> None:
        """Move held gradients into the flat buffer, freeing each one once copied."""
        while self._held:
            index = next(iter(self._held))
            self._write_grad(index, self._held.pop(index))

    def _write_grad(self, index: int, grad: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # (in backward it is not: no context per gradient there)
            with torch.no_grad():
                return self._write_grad(index, grad)
        if not self.grads.is_full_allocated:
            self.grads.alloc_full()
            self.grads.zero_full_padding()
            self._received.clear()
        self._land(self._grad_views[index], index, grad)

    def _land(self, view: torch.Tensor, index: int, grad: torch.Tensor) -> None:
        """Write parameter ``index``'s gradient into ``view`` (its place in the flat buffer or
        the segment), or add it to the one already there (accumulation without sync)."""
        # A custom divide factor scales each gradient before the sum (NCCL's PreMulSum, as
        # FSDP2 does), in the reduce dtype, as it lands in the buffer: no extra pass.
        scale = None if self.gradient_divide_factor is None else 1 / self.gradient_divide_factor
        if index in self._received:  # accumulation without sync across micro-batches
            view.add_(grad, alpha=1 if scale is None else scale)
        else:
            view.copy_(grad)
            if scale is not None:
                view.mul_(scale)
            self._received.add(index)

    def discard_grads(self) -> None:
        """Drop an aborted backward's gradients: held ones, the flat buffer (after its in-flight
        reduce-scatter, which may still read it), HSDP partial sums, and the sharded ``.grad``
        too: groups reduced before the error added this backward into it and the others did
        not, so what was accumulated there is no longer one consistent sum."""
        if self._reduce is not None:
            handle, self._reduce = self._reduce[0], None
            with self._failing_as("reduce-scatter"):
                handle.wait()
        for mp in self.params:
            mp.unsharded.grad = mp.sharded.grad = None
        self._held.clear()
        self._received.clear()
        self._partial = None
        self.forget_backward()
        if self.grads.is_full_allocated:
            self.grads.free_full()

    @property
    def has_unreduced_grads(self) -> bool:
        return self.grads.is_full_allocated or bool(self._held)

    @property
    def _reduce_op(self) -> str:
        """Averaged over the data-parallel ranks, or summed after each gradient was scaled by
        ``1 / gradient_divide_factor``."""
        return "avg" if self.gradient_divide_factor is None else "sum"

    def reduce_grads(self) -> None:
        """Reduce-scatter the flat gradient buffer (in place) into a fresh segment;
        asynchronous, finished by ``finish_reduce``. One shard rank (W=1, HSDP shards of
        one) has nothing to scatter: its held gradients go straight into the segment."""
        self.reduce_started = True
        if self.mesh.shard_size == 1 and not self.grads.is_full_allocated:
            self._reduce = (CommHandle(), self._held_into_segment())
            return
        self.flush_held_grads()
        # plain buffers: nothing here for autograd to record (no context)
        for i, mp in enumerate(self.params):  # parameters that got no gradient this window
            if i not in self._received and mp.requires_grad:
                self._grad_views[i].zero_()
        out = self.grads.full.new_empty(self.layout.segment_size)
        with self._failing_as("reduce-scatter"):
            handle = reduce_scatter_flat(
                out,
                self.grads.full,
                self.mesh.shard_group,
                op=self._reduce_op,
                async_op=True,
                comm_stream=self._comm_stream(1),
                scratch_input=True,  # freed right after: gloo may reduce it in place
            )
        self._reduce = (handle, out)

    def _held_into_segment(self) -> torch.Tensor:
        """One shard rank's segment is the whole flat buffer: the held gradients are copied
        (cast) into a fresh one, freeing each, and it becomes the sharded ``.grad``, where
        filling a flat buffer and copying it out (as FSDP2 does) would copy them twice.
        Padding and parameters that got no gradient are zeros, as in the flat buffer."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._held_into_segment()
        out = self.grads.full.new_empty(self.layout.segment_size)
        for start, stop in self.layout.gaps():
            out[start:stop].zero_()
        self._received.clear()
        for i, (mp, piece) in enumerate(zip(self.params, self._segment_pieces, strict=True)):
            view = out[piece].view(self._grad_views[i].shape)
            grad = self._held.pop(i, None)
            if grad is not None:
                self._land(view, i, grad)
            elif mp.requires_grad:
                view.zero_()
        return out

    @functools.cached_property
    def _segment_pieces(self) -> list[slice]:
        """Each parameter's piece of this rank's segment (the layout's ``segment_piece``, taken
        once: the layout and the rank never change), where its sharded ``.grad`` lies."""
        rank, everything = self.mesh.shard_rank, range(self.layout.segment_size)
        pieces = [self.layout.segment_piece(mp.fqn, rank, everything) for mp in self.params]
        return [slice(piece.start, piece.stop) for piece in pieces]

    def reduce_completed(self) -> bool:
        return self._reduce is None or self._reduce[0].is_completed()

    @property
    def finish_is_local(self) -> bool:
        """Whether ``finish_reduce`` runs no collective (HSDP's replicate all-reduce)."""
        return not (self.mesh.is_hsdp and self.requires_all_reduce)

    @property
    def reduce_pending(self) -> bool:
        """Whether a reduce-scatter was started and ``finish_reduce`` has not run yet."""
        return self._reduce is not None

    def finish_reduce(self) -> list[nn.Parameter]:
        """Wait for the reduce-scatter, free the full gradient buffer and set the sharded
        ``.grad`` of each parameter: a view of the reduced segment (cast to the parameters'
        dtype if the reduction ran in another), or added to a ``.grad`` kept from before.
        HSDP without ``requires_all_reduce`` keeps the reduce-scattered sum instead; the next
        reduction with it adds that in before its replicate all-reduce. Returns the sharded
        parameters whose ``.grad`` it set."""
        if self._reduce is None:
            return []
        handle, out = self._reduce
        self._reduce = None
        with self._failing_as("reduce-scatter"):
            handle.wait()
        self.grads.free_full()
        received = set(self._received)
        self._received.clear()
        if self.mesh.is_hsdp:
            if self._partial is not None:  # reduce-scattered earlier without the all-reduce
                out.add_(self._partial)
                received |= self._partial_received
                self._partial = None
            if not self.requires_all_reduce:
                self._partial, self._partial_received = out, received
                return []
            with self._failing_as("replicate all-reduce"):
                all_reduce_flat(out, self.mesh.replicate_group, op=self._reduce_op)
        # the parameters' dtype, and under CPU offload their host memory (the optimizer steps
        # there); a blocking copy: the step reads it next
        out = out.to(device=self.host_device, dtype=self.orig_dtype)
        updated = []
        # plain buffers and fresh RaggedTensors: nothing for autograd to record
        for i, mp in enumerate(self.params):
            if not mp.requires_grad or i not in received:
                continue
            local = out[self._segment_pieces[i]]
            if mp.sharded.grad is not None:
                mp.sharded.grad.local.add_(local)
            else:  # split as the parameter (with the TP record, for a TP parameter)
                mp.sharded.grad = mp.sharded.sibling(local)
            updated.append(mp.sharded)
        return updated


def is_plain_embedding_weight(mp: ManagedParam) -> bool:
    """Whether ``mp`` is only ever the weight of plain ``nn.Embedding`` modules (their own
    ``forward``): a lookup, whose backward needs the indices and the output gradient only."""
    return all(
        name == "weight"
        and isinstance(module, nn.Embedding)
        and type(module).forward is nn.Embedding.forward
        for module, name in mp.locations
    )


def _units(
    policy: ShardPolicy, params: list[ManagedParam], dtype: torch.dtype, world: int
) -> dict[str, int]:
    """Each parameter's unit, through the one entry point every planner uses
    (``resolve_units``): a group policy decides for the whole group, a plain one per
    parameter (seeing the parameter itself)."""
    tensors = [(mp.fqn, tuple(mp.local_original.shape), dtype) for mp in params]
    return resolve_units(policy, tensors, world, {mp.fqn: mp.local_original for mp in params})


def _use_hint(group: weakref.ref[ParamGroup]) -> str:
    """Why a sharded parameter reached an op that needs it whole: code read it without calling
    the module fully_shard wrapped (whose forward gathers it), which only wrapping the caller
    fixes. The group's name is read now: the root's first forward sets it to the module path."""
    alive = group()
    where = repr(alive.name) if alive is not None else "its fully_shard module"
    return (
        f"It is a parameter of fully_shard module {where}, whole only while that module's "
        "forward runs: code that reads it without calling the module (as nn.MultiheadAttention "
        "reads out_proj.weight) meets it sharded. Wrap the module that uses it instead (the "
        "attention module or its block)."
    )
