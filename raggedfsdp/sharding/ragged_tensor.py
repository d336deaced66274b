"""``RaggedTensor``: a tensor that reports its global shape but stores only this rank's units.

Sharded parameters must not lie about their shape (DeepSpeed's ``(0,)`` parameters break user
code and optimizers), yet optimizers must be able to update them without communication. A
``RaggedTensor`` is a wrapper subclass (like DTensor) with the global shape and dtype whose data is
a 1-D local tensor, usually a view of a flat buffer, plus the ``RaggedShard`` saying which
elements those are.

Element-wise math works directly on it: pointwise ops (``mul_``, ``lerp_``, ``addcdiv_``...),
their ``_foreach_`` forms and ``*_like`` factories run on the local pieces when every ragged
operand has the same spec (plain tensors take part as scalars only), which is all
``torch.optim.AdamW`` and friends need. Random fills (``nn.init``) draw what one process would
draw and keep the local piece. Whatever answers for the whole tensor (``sum``, ``max``, ``any``,
norms, ``torch.equal``, ``allclose``, ``item()``, ``bool()``...) gives every rank torch's answer
on the gathered tensor, NaN and dtype rules included, with one small all-reduce, so models can
be initialised, clipped and checked as usual, and ranks that branch on an answer agree.
Anything else that would need other ranks' data (matmul, other reductions, views, indices)
raises an error that says what to do instead: ``full_tensor()`` to gather, ``.local`` for
per-rank math; never a local answer.

It also speaks DCP's checkpoint protocol: a rank's flat range is written as the rectangular boxes
it covers, so ``torch.distributed.checkpoint`` saves without gathering and loads at any other
world size or layout.

Under tensor parallelism the spec is a ``TPRaggedShard`` (``tp_shard.py``): what is cut over the
data-parallel ranks is this rank's TP block, and the tensor still reports the global shape;
gathers, whole-tensor answers, plain full-shape operands, random fills and DCP boxes then also
account for the TP split.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map_only

from raggedfsdp.comm.nan_safe import WholeReduce, all_reduce_nan_safe
from raggedfsdp.sharding.ragged_shard import Box, RaggedShard
from raggedfsdp.sharding.tp_shard import global_shape_of, tp_of

__all__ = ["RaggedTensor"]

aten = torch.ops.aten


class _GroupRef:
    """A process group held by reference: deep copies of a RaggedTensor (DCP's ``async_save``
    stages state dicts with one) share it, since process groups cannot be copied."""

    __slots__ = ("group",)

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> _GroupRef:
        return self


class RaggedTensor(torch.Tensor):
    """Global-shape view of this rank's ragged piece of a tensor.

    Args:
        local: this rank's elements, 1-D, ``spec.length(rank)`` long.
        spec: how the tensor is split over the ranks of ``group``.
        rank: this process's rank in ``group``.
        group: the process group of the shard dimension (``None``: default group, or a single
            process when torch.distributed is not initialised).
    """

    _local: torch.Tensor
    _spec: RaggedShard
    _rank: int
    _group_ref: _GroupRef

    __slots__ = ("_group_ref", "_local", "_rank", "_spec")

    #: Set by an owner on the tensors it hands out (fully_shard, on its sharded parameters):
    #: says why the tensor is sharded where code expected it whole, and the fix. Read only
    #: when an op that needs the whole tensor is refused, so it costs nothing otherwise.
    sharded_use_hint: Callable[[], str] | None = None

    @staticmethod
    def __new__(
        cls,
        local: torch.Tensor,
        spec: RaggedShard,
        rank: int,
        group: dist.ProcessGroup | None = None,
        requires_grad: bool = False,
    ) -> RaggedTensor:
        if local.dim() != 1 or local.numel() != spec.length(rank):
            raise ValueError(
                f"local: rank {rank} of tensor {spec.name!r} holds {spec.length(rank)} elements "
                f"as a 1-D tensor, got shape {tuple(local.shape)}"
            )
        return _assemble(local, spec, rank, _GroupRef(group), requires_grad)

    # ----------------------------------------------------------------------------- accessors
    @property
    def rank(self) -> int:
        """This process's rank in ``group`` (the index of its piece in ``ragged_shard``)."""
        return self._rank

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group the tensor is split over (``None``: the default group, or a single
        process). Read-only: pieces of one tensor are only meaningful over the ranks that hold
        them."""
        return self._group_ref.group

    @property
    def local(self) -> torch.Tensor:
        """This rank's elements (1-D; a view of the group's flat buffer for FSDP parameters)."""
        return self._local

    @property
    def ragged_shard(self) -> RaggedShard:
        return self._spec

    def sibling(self, local: torch.Tensor) -> RaggedTensor:
        """A RaggedTensor split as this one (its spec, rank and process group) around
        ``local``, 1-D and as long as this rank's piece: how an owner that laid the pieces out
        itself (fully_shard, a parameter's ``.grad`` each step) skips ``__new__``'s checks."""
        return _sibling(local, self)

    @property
    def local_range(self) -> tuple[int, int]:
        """``(start, stop)`` of the local piece in the flat (row-major) storage of the tensor
        that is cut: the whole tensor, or under tensor parallelism this rank's TP block."""
        return self._spec.local_range(self._rank)

    @property
    def reduce_groups(self) -> tuple[dist.ProcessGroup | None, ...]:
        """The process groups over which a whole-tensor answer (a norm, a sum) of this tensor
        is combined, in order: the data-parallel group (none for a single rank), then the TP
        group when the TP ranks hold different blocks. Replicated TP blocks count once."""
        return _reduce_groups(self)

    def piece_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece (a 1-D view where possible) of a plain tensor of the global
        shape: its TP block under tensor parallelism, then the local flat range."""
        tp = tp_of(self._spec)
        block = full if tp is None else tp.local_of(full)
        start, stop = self.local_range
        return block.reshape(-1)[start:stop]

    def full_tensor(self) -> torch.Tensor:
        """Gather the whole tensor on every rank (for inspection and tests, not the hot path).

        gloo has no uneven all-gather, so pieces of about even length travel in one all-gather
        padded to the longest. A tensor that only some ranks hold (most tensors of a planned
        group at large W) would make that gather as large as the whole group's buffer, so it
        travels as one all-reduce of its bytes instead: each rank writes its range over zeros,
        and a byte sum with one non-zero term is exact (``-0.0`` and NaN payloads included).
        Which way is decided from the spec alone, the same on every rank. Under tensor
        parallelism the gathered TP block then goes through DTensor's own gather over the TP
        group (every rank of both dims must call this).
        """
        tp = tp_of(self._spec)
        block = self._gather_block()
        return block if tp is None else tp.gather(block)

    def _gather_block(self) -> torch.Tensor:
        """The tensor that is cut (the TP block under tensor parallelism), gathered over the
        data-parallel ranks."""
        spec, local = self._spec, self._local.detach()
        if spec.world_size == 1 or spec.numel == 0:
            return local.clone().view(spec.shape)
        lengths = spec.lengths
        longest = max(lengths)
        if spec.world_size * longest > 2 * spec.numel:
            whole = local.new_zeros(spec.numel)
            start, stop = self.local_range
            whole[start:stop] = local
            dist.all_reduce(whole.view(torch.uint8), op=dist.ReduceOp.SUM, group=self.group)
            return whole.view(spec.shape)
        padded = local.new_zeros(longest)
        padded[: local.numel()] = local
        gathered = local.new_empty(spec.world_size * longest)
        dist.all_gather_single(gathered, padded, group=self.group)
        return _unpadded(gathered, lengths, longest).view(spec.shape)

    def __repr__(self) -> str:  # the default repr would dispatch ops we refuse
        return (
            f"RaggedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"rank={self._rank}/{self._spec.world_size}, local={self._local!r})"
        )

    def __reduce_ex__(self, protocol: int):
        raise TypeError(
            "a RaggedTensor holds only this rank's piece: save it with torch.distributed."
            "checkpoint (DCP), or pickle .full_tensor() / .local explicitly"
        )

    # ----------------------------------------------------------------------------- dispatch
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = _ROUTES.get(func)
        if handler is None:
            handler = _ROUTES[func] = _route(func)
        return handler(func, args, kwargs or {})

    # ----------------------------------------------------------------------------- DCP protocol
    def _boxes(self) -> list[tuple[Box, int, int]]:
        """The rectangular boxes of the local piece, in global coordinates (shifted by the TP
        block's offset under tensor parallelism), with their local flat ranges. Replicated TP
        ranks write the same boxes, which DCP's planner saves once."""
        out, cursor = [], 0
        tp = tp_of(self._spec)
        for box in self._spec.boxes(self._rank):
            out.append((box if tp is None else tp.global_box(box), cursor, cursor + box.numel))
            cursor += box.numel
        return out

    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_tensor

        properties = _create_write_item_for_tensor(fqn, self._local).tensor_data.properties
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(box.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes)),
                    properties=properties,
                    size=self.size(),
                ),
            )
            for box, _, _ in self._boxes()
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [
            ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes))
            for box, _, _ in self._boxes()
        ]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for box, start, stop in self._boxes():
            if torch.Size(box.offsets) == index.offset:
                return self._local[start:stop].view(box.sizes)
        raise ValueError(f"{index.fqn}: no local chunk at offset {tuple(index.offset)}")


def _unpadded(gathered: torch.Tensor, lengths: tuple[int, ...], longest: int) -> torch.Tensor:
    """The pieces of a padded all-gather (rank r's ``lengths[r]`` elements at ``r * longest``)
    back to back: one mask over the ``(W, longest)`` view, not one slice per rank (100,000
    slices take seconds), so the cost is that of the gathered data."""
    if lengths[0] == longest and len(set(lengths[:-1])) == 1:  # even but for a shorter last
        return gathered[: sum(lengths)]
    held = torch.tensor(lengths, device=gathered.device)
    keep = torch.arange(longest, device=gathered.device) < held[:, None]
    return gathered.view(len(lengths), longest)[keep]


# --------------------------------------------------------------------------------- op handlers
def _assemble(
    local: torch.Tensor,
    spec: RaggedShard,
    rank: int,
    group_ref: _GroupRef,
    requires_grad: bool = False,
) -> RaggedTensor:
    out = torch.Tensor._make_wrapper_subclass(
        RaggedTensor,
        global_shape_of(spec),
        dtype=local.dtype,
        device=local.device,
        requires_grad=requires_grad,
    )
    out._local, out._spec, out._rank, out._group_ref = local, spec, rank, group_ref
    return out


def _sibling(local: torch.Tensor, like: RaggedTensor) -> RaggedTensor:
    """A RaggedTensor split as ``like`` (sharing its process-group reference) around ``local``:
    what every op's result is, so it skips ``__new__``'s checks."""
    return _assemble(local, like._spec, like._rank, like._group_ref)


def _spec_of(tensors: list[RaggedTensor]) -> RaggedTensor:
    first = tensors[0]
    for t in tensors[1:]:
        if t._spec != first._spec or t._rank != first._rank:
            raise ValueError(
                f"RaggedTensors of {first._spec.name!r} and {t._spec.name!r} are split "
                "differently; element-wise math needs the same RaggedShard on both"
            )
    return first


def _check_plain(a: torch.Tensor, like: RaggedTensor) -> None:
    """Refuse a plain tensor operand whose broadcast against ``like`` would not keep ``like``'s
    global shape and elements: only a one-element tensor with at most ``like``'s dims broadcasts
    to every element alike. Anything else would pair this rank's piece with the wrong elements
    or give another shape than torch does, so it is refused rather than answered locally."""
    if a.numel() != 1:
        raise ValueError(
            f"mixing a RaggedTensor ({like._spec.name!r}) with a plain tensor of shape "
            f"{tuple(a.shape)}: element-wise math on a RaggedTensor of shape "
            f"{tuple(like.shape)} takes scalars (0-d or one-element tensors) and RaggedTensors "
            "with the same RaggedShard; wrap it with the same RaggedShard, or use .local / "
            ".full_tensor()"
        )
    if a.dim() > like.dim():
        raise ValueError(
            f"broadcasting a RaggedTensor ({like._spec.name!r}) of shape {tuple(like.shape)} with "
            f"a plain tensor of shape {tuple(a.shape)} gives shape "
            f"{tuple(torch.broadcast_shapes(like.shape, a.shape))}, which a RaggedTensor split "
            "as this one cannot hold; squeeze the plain tensor, or use .full_tensor()"
        )


def _plain_operand(a: torch.Tensor, like: RaggedTensor) -> torch.Tensor:
    """A plain tensor operand as the op on ``like``'s 1-D local piece must see it: checked by
    ``_check_plain``, and as a ``(1,)`` tensor unless torch ranks it below ``like`` in type
    promotion (a 0-d tensor against a dimensioned one), so that shapes and dtypes come out as
    torch's on the whole tensor: the local piece is always dimensioned, and a ``(1, 1)`` operand
    would turn it into a row. A 0-d CPU tensor beside a piece on another device stays 0-d:
    torch takes it there as a scalar only."""
    if a.dim() == 0 and (like.dim() > 0 or a.device != like.device):
        return a  # the common case (lr, betas, step): a scalar both ways
    _check_plain(a, like)
    return a.reshape(1)


def _local_operand(a: Any, like: RaggedTensor) -> Any:
    """What the op on ``like``'s local piece takes for the operand ``a``."""
    if isinstance(a, RaggedTensor):
        return a._local
    return _plain_operand(a, like) if isinstance(a, torch.Tensor) else a


def _wrap(out: Any, like: RaggedTensor) -> Any:
    if isinstance(out, torch.Tensor) and out.dim() == 1 and out.numel() == like._local.numel():
        return _sibling(out, like)  # the common case, fast
    return tree_map_only(
        torch.Tensor,
        lambda t: _sibling(t, like) if t.dim() == 1 and t.numel() == like._local.numel() else t,
        out,
    )


def _unwrap(x: Any) -> Any:
    return tree_map_only(RaggedTensor, lambda t: t._local, x)


def _pointwise(func, args, kwargs):
    """Element-wise ops run on the local pieces. Their operands are tensors, scalars or None, so
    one flat pass unwraps them (pytree's traversals cost 5x the op itself in a per-tensor
    optimizer step); nested operands, which no pointwise aten op takes today, go through
    pytree. Plain tensor operands broadcast only as scalars (``_plain_operand``)."""
    operands = [*args, *kwargs.values()]
    nested = False
    for a in operands:  # (a loop, not any(): a generator resumes once per operand)
        if isinstance(a, (list, tuple, dict)):
            nested = True
            break
    if nested:
        operands = tree_flatten((args, kwargs))[0]
    like = _spec_of([a for a in operands if isinstance(a, RaggedTensor)])
    if nested:
        unwrapped_args, unwrapped_kwargs = tree_map_only(
            torch.Tensor, lambda a: _local_operand(a, like), (args, kwargs)
        )
    else:
        unwrapped_args = [_local_operand(a, like) for a in args]
        unwrapped_kwargs = {k: _local_operand(v, like) for k, v in kwargs.items()}
    out = func(*unwrapped_args, **unwrapped_kwargs)
    if func._schema.is_mutable:  # in-place / out=: the ragged operands were updated in place
        return args[0]
    return _wrap(out, like)


def _foreach(func, args, kwargs):
    """``_foreach_*`` ops and torch's fused optimizer kernels: lists of tensors, each updated
    element by element, so every index runs on its local pieces."""
    base = func._schema.name.removeprefix("aten::_foreach_").rstrip("_")
    packet = getattr(aten, base, None)
    elementwise = (
        base in ("zero", "copy")
        or func.name() in _FUSED_OPTIMIZER_OPS
        or (
            packet is not None
            and any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())
        )
    )
    if not elementwise or base == "max":  # max.other is pointwise, _foreach_max reduces
        raise NotImplementedError(
            f"{func.name()} is not element-wise; on RaggedTensors gather with .full_tensor(), or "
            "use .local for per-rank math"
        )
    lists = [
        a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)
    ]
    for i in range(len(lists[0])):
        items = [lst[i] for lst in lists]
        ragged = [t for t in items if isinstance(t, RaggedTensor)]
        if ragged:
            like = _spec_of(ragged)
            if len(ragged) < len(items):  # plain tensors beside a piece: scalars only
                for t in items:
                    if not isinstance(t, RaggedTensor) and t.dim() > 0:
                        _check_plain(t, like)
    out = func(*_unwrap(args), **_unwrap(kwargs))
    if out is None or func._schema.is_mutable:
        return out
    return [
        _wrap_piece(o, like, func) if isinstance(like, RaggedTensor) else o
        for o, like in zip(out, lists[0], strict=True)
    ]


def _wrap_piece(out: torch.Tensor, like: RaggedTensor, func: Any) -> RaggedTensor:
    """One result of an element-wise list op, which must be shaped like ``like``'s piece (a
    one-element operand of higher rank would have turned it into a row)."""
    if out.shape != like._local.shape:
        raise NotImplementedError(
            f"{func.name()} gave a result of shape {tuple(out.shape)} for the piece of "
            f"{like._spec.name!r} (shape {tuple(like._local.shape)}): only element-wise results "
            "keep their meaning per rank; gather with .full_tensor(), or use .local"
        )
    return _sibling(out, like)


def _like_factory(func, args, kwargs):
    src = args[0]
    kwargs = {k: v for k, v in kwargs.items() if k != "memory_format"}
    local = func(src._local, *args[1:], **kwargs)
    return _sibling(local, src)


def _new_empty(func, args, kwargs):
    """``new_empty`` of the global shape (DCP's ``async_save`` stages tensors this way): a
    RaggedTensor with an empty local piece."""
    src, size = args[0], list(args[1])
    if size != list(src.shape):
        raise NotImplementedError(
            f"new_empty({size}) of RaggedTensor {src._spec.name!r} of shape {tuple(src.shape)}: "
            "only the global shape keeps a meaning per rank; use .local.new_empty(...)"
        )
    local = src._local.new_empty(src._local.shape, *args[2:], **kwargs)
    return _sibling(local, src)


def _same_spec_unary(func, args, kwargs):
    src = args[0]
    return _sibling(func(src._local, *args[1:], **kwargs), src)


def _detach(func, args, kwargs):
    """A detached RaggedTensor wraps the same local tensor: writes through it (a DCP load into
    ``model.state_dict()``, whose tensors are detached) move the piece's version counter, which
    ``fully_shard`` checks before trusting kept unsharded parameters."""
    return _sibling(args[0]._local, args[0])


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, RaggedTensor):
        if isinstance(src, RaggedTensor):
            _spec_of([dst, src])
            dst._local.copy_(src._local, **kwargs)
        elif src.numel() == dst.numel():  # a full tensor: keep this rank's piece of it
            dst._local.copy_(dst.piece_of(src.reshape(dst.shape)), **kwargs)
        elif src.numel() == 1:  # a scalar: every element alike (torch's error for more dims)
            dst._local.copy_(src.expand(dst.shape)[(0,) * dst.dim()], **kwargs)
        else:  # broadcast to the whole shape as torch does (its error where it cannot)
            dst._local.copy_(dst.piece_of(src.expand(dst.shape)), **kwargs)
        return dst
    raise NotImplementedError("copying a RaggedTensor into a plain tensor: use .full_tensor()")


def _in_place_local(func, args, kwargs):
    func(args[0]._local, *_unwrap(args[1:]), **kwargs)
    return args[0]


def _random_fill(func, args, kwargs):
    """In-place random fills (``nn.init``'s ``uniform_``, ``normal_``...): every rank draws the
    whole tensor with its generator, as one process would, and keeps its piece. With the same
    seed on every rank (as for any FSDP initialisation), parameters initialised after
    ``fully_shard`` (on the meta device, then ``to_empty``) are then exactly those of the
    unsharded model, at any world size, and the generator advances as it would there. Costs
    one full-size temporary per call, one tensor at a time."""
    dst = args[0]
    full = torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
    func(full, *args[1:], **kwargs)
    dst._local.copy_(dst.piece_of(full))
    return dst


def _named_arguments(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An op's arguments by schema name, whether passed by position or keyword."""
    return {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)} | kwargs


def _reduce_groups(like: RaggedTensor) -> tuple[dist.ProcessGroup | None, ...]:
    """The groups over which a whole-tensor answer of ``like`` is combined: its
    data-parallel group (unless it is a single rank), then the TP group when the TP ranks
    hold different blocks (replicated blocks count once)."""
    tp = tp_of(like._spec)
    groups = () if like._spec.world_size == 1 else (like.group,)
    return groups if tp is None or tp.reduce_group is None else (*groups, tp.reduce_group)


def _combined(value: torch.Tensor, like: RaggedTensor, op: WholeReduce) -> torch.Tensor:
    """``value`` combined over ``like``'s data-parallel (and TP) groups by ``op``, NaN
    propagating as in torch's reductions whatever the backend (as is for a single rank)."""
    for group in _reduce_groups(like):
        value = all_reduce_nan_safe(value, op, group)
    return value


def _empty_whole(src: torch.Tensor) -> torch.Tensor:
    """A plain empty tensor standing for ``src`` when ``src`` has no elements: no rank holds
    any and shapes are global, so torch's own answer (or error) on it is every rank's answer."""
    return torch.empty(src.shape, dtype=src.dtype, device=src.device)


def _identity(op: WholeReduce, like: torch.Tensor) -> torch.Tensor:
    """The part of a rank that holds none of the tensor: the combining op's identity."""
    if op == "sum":
        return like.new_zeros(())
    if like.is_floating_point():
        return like.new_tensor(-math.inf if op == "max" else math.inf)
    info = torch.iinfo(like.dtype)
    return like.new_tensor(info.min if op == "max" else info.max)


def _any_or_all(func, args, kwargs):
    """``t.any()`` / ``t.all()`` over the whole tensor: one small all-reduce, so every rank
    gets the same answer (``nn.init.trunc_normal_`` loops until no sample is out of range)."""
    src = args[0]
    op = "max" if func is aten.any.default else "min"
    local = func(src._local)  # bool, or uint8 for uint8 tensors as in torch
    return _combined(local.to(torch.uint8), src, op).to(local.dtype)


@functools.cache
def _norm_dtypes(dtype: torch.dtype, out: torch.dtype | None) -> tuple[torch.dtype, torch.dtype]:
    """``(accumulate, result)`` dtypes of a norm of ``dtype`` elements asked as ``out``, by
    torch's rules (and its errors, e.g. for integers): float64 results accumulate in float64,
    the others in float32, as torch's own kernels do."""
    result = torch.linalg.vector_norm(torch.zeros(1, dtype=dtype), dtype=out).dtype
    return (torch.float64 if result == torch.float64 else torch.float32), result


def _norm_part(t: torch.Tensor, order: float, accumulate: torch.dtype) -> torch.Tensor:
    """This rank's part of the ``order``-norm of the whole tensor ``t`` (from the local piece
    of a RaggedTensor, from all of a plain tensor), in ``accumulate``: ``max |x|`` or
    ``min |x|`` for ``±inf`` (the identity for an empty piece), the count of non-zeros for 0,
    else ``sum |x|^p`` (negative ``p`` included)."""
    x = (t._local if isinstance(t, RaggedTensor) else t.reshape(-1)).abs().to(accumulate)
    if order == math.inf or order == -math.inf:
        op: WholeReduce = "max" if order > 0 else "min"
        return (x.amax() if op == "max" else x.amin()) if x.numel() else _identity(op, x)
    if order == 0:
        return (x != 0).sum().to(accumulate)
    return x.pow(order).sum()


def _norms(func, args, kwargs):
    """Norms of whole tensors, the same on every rank, so ``torch.nn.utils.clip_grad_norm_``
    (and ``get_total_norm``) work on ``fully_shard`` gradients: each rank takes ``sum |x|^p``
    (``max |x|``, ...) of its pieces, in float64 for float64 results and float32 otherwise,
    one all-reduce per process group covers the whole list (NaN propagating), then the root.
    Plain tensors in the list are whole already; tensors with no elements get torch's own
    answer (or error)."""
    foreach = func is aten._foreach_norm.Scalar
    named = _named_arguments(func, args, kwargs)
    tensors = named["self"] if foreach else [named["self"]]
    order = float(named.get("ord", 2.0))
    if not foreach and (named.get("dim") is not None or named.get("keepdim")):
        raise NotImplementedError(
            "a norm over some dims of a RaggedTensor needs whole rows; gather with "
            ".full_tensor(), or take the norm of the whole tensor"
        )
    dtypes = [_norm_dtypes(t.dtype, named.get("dtype")) for t in tensors]
    parts = [_norm_part(t, order, acc) for t, (acc, _) in zip(tensors, dtypes, strict=True)]
    op: WholeReduce = "max" if order == math.inf else "min" if order == -math.inf else "sum"
    by_groups: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, RaggedTensor) and _reduce_groups(t):
            by_groups.setdefault(_reduce_groups(t), []).append(i)
    for groups, members in by_groups.items():
        stacked = torch.stack([parts[i] for i in members])
        for group in groups:
            stacked = all_reduce_nan_safe(stacked, op, group)
        for i, value in zip(members, stacked, strict=True):
            parts[i] = value
    rooted = op == "sum" and order != 0
    out = []
    for part, t, (_, result) in zip(parts, tensors, dtypes, strict=True):
        if t.numel():
            out.append((part.pow(1 / order) if rooted else part).to(result))
        elif foreach:  # torch's answer (or error: inf-norms have no identity) with no elements
            out.append(func([_empty_whole(t)], *args[1:], **kwargs)[0])
        else:
            out.append(func(_empty_whole(t), *args[1:], **kwargs))
    return out if foreach else out[0]


def _refuse_dims(func, named: dict[str, Any]) -> None:
    """Reductions over some dims need whole rows, which no rank holds."""
    if named.get("dim") not in (None, [], ()) or named.get("keepdim"):
        raise NotImplementedError(
            f"{func.name()} over some dims of a RaggedTensor needs whole rows; gather with "
            ".full_tensor(), or reduce the whole tensor"
        )


def _result_dtype(func, args: tuple, kwargs: dict) -> torch.dtype:
    """The dtype torch's ``func`` gives for ``args[0]``'s dtype, from the op on one element of
    that dtype, so torch's own rules and errors apply (no integer ``mean`` without a ``dtype``,
    no integer ``var`` / ``std``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # var/std of one element: "degrees of freedom <= 0"
        return func(torch.zeros(1, dtype=args[0].dtype), *args[1:], **kwargs).dtype


_EXTREMES: dict[Any, WholeReduce] = {
    aten.max: "max",
    aten.amax: "max",
    aten.min: "min",
    aten.amin: "min",
}


def _whole_reduction(func, args, kwargs):
    """``sum()``, ``mean()``, ``max()``, ``min()``, ``amax()``, ``amin()``, ``var()`` and
    ``std()`` of the whole tensor (logging a gradient's mean or spread, as with DTensor): each
    rank reduces its piece exactly enough (float64 for floating point and means, int64 for
    integers), one all-reduce combines them with NaN propagating as in torch, and every rank
    gets the same plain tensor, of the dtype torch gives (with torch's errors)."""
    src, named = args[0], _named_arguments(func, args, kwargs)
    _refuse_dims(func, named)
    if src.numel() == 0:
        return func(_empty_whole(src), *args[1:], **kwargs)
    if src.is_complex():
        raise NotImplementedError(f"{func.name()} of a complex RaggedTensor: use .full_tensor()")
    result, kind = _result_dtype(func, args, kwargs), func.overloadpacket
    exact = torch.float64 if src.is_floating_point() or kind is aten.mean else torch.int64
    wide = src._local.to(exact)
    extreme = _EXTREMES.get(kind)
    if extreme is not None:
        if not wide.numel():
            return _combined(_identity(extreme, wide), src, extreme).to(result)
        return _combined(wide.amax() if extreme == "max" else wide.amin(), src, extreme).to(result)
    total = _combined(wide.sum(), src, "sum")
    if kind is aten.sum:
        return total.to(result)
    numel = src.numel()
    mean = total / numel
    if kind is aten.mean:
        return mean.to(result)
    correction = 1 if named.get("correction") is None else named["correction"]
    variance = _combined((wide - mean).pow(2).sum(), src, "sum") / max(numel - correction, 0)
    return (variance if kind is aten.var else variance.sqrt()).to(result)


def _count_nonzero(func, args, kwargs):
    """``count_nonzero()`` of the whole tensor: one all-reduce of the pieces' counts."""
    src = args[0]
    _refuse_dims(func, _named_arguments(func, args, kwargs))
    return _combined(func(src._local), src, "sum")


def _foreach_max(func, args, kwargs):
    """``torch._foreach_max``: each tensor's maximum over the whole tensor (torch's own error
    for a tensor with no elements)."""
    return [torch.max(t) if t.numel() else func([_empty_whole(t)])[0] for t in args[0]]


def _paired_pieces(func, a: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor, RaggedTensor]:
    """This rank's pieces of the two operands of a comparison of whole tensors, in order: a
    RaggedTensor split alike gives its piece, a plain tensor of the whole shape this rank's
    range of it, a one-element one itself (``_plain_operand``)."""
    ragged = a if isinstance(a, RaggedTensor) else b

    def piece(t: Any) -> torch.Tensor:
        if isinstance(t, RaggedTensor):
            if t._spec != ragged._spec or t._rank != ragged._rank:
                raise NotImplementedError(
                    f"{func.name()} of RaggedTensors split differently ({ragged._spec.name!r} "
                    f"and {t._spec.name!r}): compare their .full_tensor()s"
                )
            return t._local
        if t.shape == ragged.shape:
            return ragged.piece_of(t)
        return _plain_operand(t, ragged)

    return piece(a), piece(b), ragged


def _equal(func, args, kwargs):
    """``torch.equal`` of whole tensors, the same on every rank (one all-reduce): ranks that
    branch on it must agree, and the pieces alone differ on some ranks only."""
    a, b = args
    if a.shape != b.shape:  # shapes are global: every rank knows without asking
        return False
    mine, theirs, ragged = _paired_pieces(func, a, b)
    same = torch.tensor(int(torch.equal(mine, theirs)), dtype=torch.uint8, device=ragged.device)
    return bool(_combined(same, ragged, "min"))


def _allclose(func, args, kwargs):
    """``torch.allclose`` of whole tensors, the same on every rank: torch's ``allclose`` of
    this rank's pieces, then one all-reduce."""
    named = _named_arguments(func, args, kwargs)
    mine, theirs, ragged = _paired_pieces(func, named.pop("self"), named.pop("other"))
    close = torch.tensor(int(func(mine, theirs, **named)), dtype=torch.uint8, device=ragged.device)
    return bool(_combined(close, ragged, "min"))


def _scalar(func, args, kwargs):
    """``item()``, ``bool()``, ``float()``, ``int()`` of a one-element tensor: the element
    lives on one rank, which shares it (one collective, through ``full_tensor()``), so every
    rank gets the same value."""
    src = args[0]
    if src.numel() != 1:
        raise RuntimeError(f"a Tensor with {src.numel()} elements cannot be converted to Scalar")
    return src.full_tensor().item()


def _amp_unscale(func, args, kwargs):
    """``GradScaler.unscale_`` on ``fully_shard`` gradients: each rank unscales its pieces and
    checks them for inf/NaN, then ``found_inf`` is made global (a MAX all-reduce per process
    group in the list), so every rank skips or takes the same step. torch's ``GradScaler``
    works as is; FSDP's ``ShardedGradScaler`` finds the flag already agreed."""
    named = _named_arguments(func, args, kwargs)
    grads, found_inf = named["self"], named["found_inf"]
    func(
        [g._local if isinstance(g, RaggedTensor) else g for g in grads],
        found_inf,
        named["inv_scale"],
    )
    groups = {
        group: None for g in grads if isinstance(g, RaggedTensor) for group in _reduce_groups(g)
    }
    for group in groups:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)


# torch.optim's ``fused=True`` kernels: element-wise updates over lists of tensors
_FUSED_OPTIMIZER_OPS = frozenset(
    f"aten::_fused_{name}_" for name in ("adam", "adamw", "sgd", "adagrad")
)

_SPECIAL = {
    aten.detach.default: _detach,
    aten.alias.default: _same_spec_unary,
    aten.clone.default: lambda f, a, k: _same_spec_unary(
        f, a, {x: v for x, v in k.items() if x != "memory_format"}
    ),
    aten._to_copy.default: _same_spec_unary,
    aten.zeros_like.default: _like_factory,
    aten.ones_like.default: _like_factory,
    aten.empty_like.default: _like_factory,
    aten.new_empty.default: _new_empty,
    aten.full_like.default: _like_factory,
    aten.copy_.default: _copy_,
    aten.zero_.default: _in_place_local,
    aten.fill_.Scalar: _in_place_local,
    aten.equal.default: _equal,
    aten.allclose.default: _allclose,
    aten.is_same_size.default: lambda f, a, k: a[0].shape == a[1].shape,
    aten._local_scalar_dense.default: _scalar,
    aten.count_nonzero.default: _count_nonzero,
    aten._foreach_max.default: _foreach_max,
    aten._foreach_norm.Scalar: _norms,
    aten.linalg_vector_norm.default: _norms,
    aten._amp_foreach_non_finite_check_and_unscale_.default: _amp_unscale,
    **{
        op: _whole_reduction
        for op in (
            aten.sum.default,
            aten.mean.default,
            aten.max.default,
            aten.min.default,
            aten.amax.default,
            aten.amin.default,
            aten.var.correction,
            aten.std.correction,
        )
    },
    aten.any.default: _any_or_all,
    aten.all.default: _any_or_all,
    **{
        op: _random_fill
        for op in (
            aten.uniform_.default,
            aten.normal_.default,
            aten.bernoulli_.float,
            aten.random_.default,
            getattr(aten.random_, "from"),
            aten.random_.to,
            aten.exponential_.default,
            aten.cauchy_.default,
            aten.log_normal_.default,
            aten.geometric_.default,
        )
    },
}


def _needs_whole(func, args, kwargs):
    """Any other op: it needs elements this rank does not hold, so it is refused, naming the
    tensor and the fix."""
    ragged = next((a for a in tree_flatten(args)[0] if isinstance(a, RaggedTensor)), None)
    what = "a tensor" if ragged is None else repr(ragged._spec.name or tuple(ragged.shape))
    hint = ragged.sharded_use_hint if ragged is not None else None
    raise NotImplementedError(
        f"{func.name()} needs the whole tensor, but a RaggedTensor holds only this rank's "
        f"piece of {what}. {hint() + ' ' if hint is not None else ''}Gather it with "
        ".full_tensor() (or unshard the module), or use .local for per-rank math (norms of "
        "whole tensors work as they are)."
    )


def _route(func) -> Callable:
    """The handler of ``func``, decided once per op (then a dict lookup per call: an optimizer
    step dispatches one op per parameter): its special handler, the ``_foreach_`` / fused
    optimizer path, the element-wise path, or the refusal."""
    if func in _SPECIAL:
        return _SPECIAL[func]
    if func.name().startswith("aten::_foreach_") or func.name() in _FUSED_OPTIMIZER_OPS:
        return _foreach
    if torch.Tag.pointwise in func.tags:
        return _pointwise
    return _needs_whole


_ROUTES: dict[Any, Callable] = {}  # op -> handler, filled by ``_route`` as ops first arrive


def _register_with_torch_optimizers() -> None:
    """Let torch.optim (and torch.nn.utils) pick their ``foreach`` / ``fused`` paths for
    RaggedTensor parameters, as DTensor registers itself: without this they fall back to the
    per-tensor loop on CUDA, and ``fused=True`` refuses the parameters."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for supported in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if RaggedTensor not in supported:
            supported.append(RaggedTensor)


_register_with_torch_optimizers()
