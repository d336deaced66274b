"""``RaggedTensor``: a tensor that reports its global shape but stores only this rank's units.

Sharded parameters must not lie about their shape (DeepSpeed's ``(0,)`` parameters break user
code and optimizers), yet optimizers must be able to update them without communication. A
``RaggedTensor`` is a wrapper subclass (like DTensor) with the global shape and dtype whose data is
a 1-D local tensor, usually a view of a flat buffer, plus the ``RaggedShard`` saying which
elements those are.

Element-wise math works directly on it: pointwise ops (``mul_``, ``lerp_``, ``addcdiv_``...),
their ``_foreach_`` forms and ``*_like`` factories run on the local pieces when every ragged
operand has the same spec, which is all ``torch.optim.AdamW`` and friends need. Random fills
(``nn.init``) draw what one process would draw and keep the local piece; ``any()``, ``all()``
and whole-tensor norms (``torch.nn.utils.clip_grad_norm_``) answer for the whole tensor with
one small all-reduce, so models can be initialised and clipped as usual. Anything else that
would need other ranks' data (matmul, other reductions, views) raises an error that says what
to do instead: ``full_tensor()`` to gather, ``.local`` for per-rank math.

It also speaks DCP's checkpoint protocol: a rank's flat range is written as the rectangular boxes
it covers, so ``torch.distributed.checkpoint`` saves without gathering and loads at any other
world size or layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map_only

from raggedfsdp.sharding.ragged_shard import Box, RaggedShard

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

    @property
    def local_range(self) -> tuple[int, int]:
        """``(start, stop)`` of the local piece in the tensor's flat (row-major) storage."""
        return self._spec.local_range(self._rank)

    def full_tensor(self) -> torch.Tensor:
        """Gather the whole tensor on every rank (for inspection and tests, not the hot path).

        Uses an all-gather of pieces padded to the longest one: gloo has no uneven all-gather.
        """
        spec = self._spec
        world = spec.world_size
        if world == 1:
            return self._local.detach().clone().view(spec.shape)
        longest = max(spec.lengths)
        padded = self._local.new_zeros(longest)
        padded[: self._local.numel()] = self._local.detach()
        gathered = self._local.new_empty(world * longest)
        dist.all_gather_single(gathered, padded, group=self.group)
        pieces = [gathered[r * longest : r * longest + spec.length(r)] for r in range(world)]
        return torch.cat(pieces).view(spec.shape)

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
        kwargs = kwargs or {}
        handler = _SPECIAL.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if func.name().startswith("aten::_foreach_") or func.name() in _FUSED_OPTIMIZER_OPS:
            return _foreach(func, args, kwargs)
        if torch.Tag.pointwise in func.tags:
            return _pointwise(func, args, kwargs)
        raise NotImplementedError(
            f"{func.name()} needs the whole tensor, but a RaggedTensor holds only this rank's "
            f"piece of {cls._describe(args)}. Gather it with .full_tensor() (or unshard the "
            "module), or use .local for per-rank math (norms of whole tensors work as they are)."
        )

    @staticmethod
    def _describe(args: Any) -> str:
        ragged = [a for a in tree_flatten(args)[0] if isinstance(a, RaggedTensor)]
        return repr(ragged[0]._spec.name or tuple(ragged[0].shape)) if ragged else "a tensor"

    # ----------------------------------------------------------------------------- DCP protocol
    def _boxes(self) -> list[tuple[Box, int, int]]:
        """The rectangular boxes of the local piece with their local flat ranges."""
        out, cursor = [], 0
        for box in self._spec.boxes(self._rank):
            out.append((box, cursor, cursor + box.numel))
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
        spec.shape,
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


def _check_no_plain_tensors(operands: list[Any], like: RaggedTensor) -> None:
    for a in operands:
        if isinstance(a, torch.Tensor) and not isinstance(a, RaggedTensor) and a.numel() > 1:
            raise ValueError(
                f"mixing a RaggedTensor ({like._spec.name!r}) with a plain tensor of shape "
                f"{tuple(a.shape)}: wrap it with the same RaggedShard, or use .local"
            )


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
    pytree."""
    operands = [*args, *kwargs.values()]
    if any(isinstance(a, (list, tuple, dict)) for a in operands):
        operands = tree_flatten((args, kwargs))[0]
        unwrapped_args, unwrapped_kwargs = _unwrap(args), _unwrap(kwargs)
    else:
        unwrapped_args = [a._local if isinstance(a, RaggedTensor) else a for a in args]
        unwrapped_kwargs = {
            k: v._local if isinstance(v, RaggedTensor) else v for k, v in kwargs.items()
        }
    like = _spec_of([a for a in operands if isinstance(a, RaggedTensor)])
    _check_no_plain_tensors(operands, like)
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
    if not elementwise:
        raise NotImplementedError(
            f"{func.name()} is not element-wise; on RaggedTensors gather with .full_tensor(), or "
            "use .local for per-rank math"
        )
    lists = [
        a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)
    ]
    for i in range(len(lists[0])):
        ragged = [lst[i] for lst in lists if isinstance(lst[i], RaggedTensor)]
        if ragged:
            _spec_of(ragged)
    out = func(*_unwrap(args), **_unwrap(kwargs))
    if out is None or func._schema.is_mutable:
        return out
    return [
        _wrap(o, like) if isinstance(like, RaggedTensor) else o
        for o, like in zip(out, lists[0], strict=True)
    ]


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


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, RaggedTensor):
        if isinstance(src, RaggedTensor):
            _spec_of([dst, src])
            dst._local.copy_(src._local, **kwargs)
        elif src.numel() == dst.numel():  # a full tensor: keep this rank's piece of it
            start, stop = dst.local_range
            dst._local.copy_(src.reshape(-1)[start:stop], **kwargs)
        else:
            dst._local.copy_(src, **kwargs)  # scalar broadcast
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
    start, stop = dst.local_range
    dst._local.copy_(full.view(-1)[start:stop])
    return dst


def _named_arguments(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An op's arguments by schema name, whether passed by position or keyword."""
    return {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)} | kwargs


def _combined(value: torch.Tensor, like: RaggedTensor, op: dist.ReduceOp) -> torch.Tensor:
    """``value`` all-reduced over ``like``'s process group (as is for a single rank)."""
    if like._spec.world_size > 1:
        dist.all_reduce(value, op=op, group=like.group)
    return value


def _any_or_all(func, args, kwargs):
    """``t.any()`` / ``t.all()`` over the whole tensor: one small all-reduce, so every rank
    gets the same answer (``nn.init.trunc_normal_`` loops until no sample is out of range)."""
    src = args[0]
    op = dist.ReduceOp.MAX if func is aten.any.default else dist.ReduceOp.MIN
    return _combined(func(src._local).to(torch.uint8), src, op).bool()


def _norms(func, args, kwargs):
    """Norms of whole tensors, the same on every rank, so ``torch.nn.utils.clip_grad_norm_``
    (and ``get_total_norm``) work on ``fully_shard`` gradients: each rank takes ``sum |x|^p``
    (``max |x|``, ...) of its pieces in fp32, one all-reduce per process group covers the whole
    list, then the root. Plain tensors in the list are whole already."""
    foreach = func is aten._foreach_norm.Scalar
    named = _named_arguments(func, args, kwargs)
    tensors = named["self"] if foreach else [named["self"]]
    order = float(named.get("ord", 2.0))
    if not foreach and (named.get("dim") is not None or named.get("keepdim")):
        raise NotImplementedError(
            "a norm over some dims of a RaggedTensor needs whole rows; gather with "
            ".full_tensor(), or take the norm of the whole tensor"
        )
    if order < 0 and not math.isinf(order):
        raise NotImplementedError(f"ord={order}: RaggedTensor norms take ord >= 0 or +-inf")
    dtype = named.get("dtype")
    op, reduce_op = _NORM_PARTS[order if math.isinf(order) or order == 0 else "p"]
    parts = [op(t._local if isinstance(t, RaggedTensor) else t.reshape(-1), order) for t in tensors]
    by_group: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, RaggedTensor) and t._spec.world_size > 1:
            by_group.setdefault(t.group, []).append(i)
    for group, members in by_group.items():
        stacked = torch.stack([parts[i] for i in members])
        dist.all_reduce(stacked, op=reduce_op, group=group)
        for i, value in zip(members, stacked, strict=True):
            parts[i] = value
    finite_p = not math.isinf(order) and order != 0
    out = [
        (part.pow(1 / order) if finite_p else part).to(dtype or t.dtype)
        for part, t in zip(parts, tensors, strict=True)
    ]
    return out if foreach else out[0]


def _whole_reduction(func, args, kwargs):
    """``sum()``, ``mean()``, ``max()``, ``min()``, ``amax()``, ``amin()``, ``var()`` and
    ``std()`` of the whole tensor (logging a gradient's mean or spread, as with DTensor): each
    rank reduces its piece in float64 (int64 for integer sums), one all-reduce combines them,
    and every rank gets the same plain tensor. Reductions over some dims need whole rows."""
    src = args[0]
    named = _named_arguments(func, args, kwargs)
    if named.get("dim") not in (None, [], ()) or named.get("keepdim"):
        raise NotImplementedError(
            f"{func.name()} over some dims of a RaggedTensor needs whole rows; gather with "
            ".full_tensor(), or reduce the whole tensor"
        )
    local, kind = src._local, func.overloadpacket
    if local.is_complex():
        raise NotImplementedError(f"{func.name()} of a complex RaggedTensor: use .full_tensor()")
    floating = local.is_floating_point()
    wide = local.to(torch.float64 if floating or kind is not aten.sum else torch.int64)
    numel = src.numel()
    if kind in (aten.max, aten.amax, aten.min, aten.amin):
        biggest = kind in (aten.max, aten.amax)
        if numel == 0:
            raise RuntimeError(f"{func.name()}: the tensor is empty")
        if wide.numel():
            part = wide.max() if biggest else wide.min()
        else:  # this rank holds none of it: the identity of the combining op
            part = torch.tensor(
                -math.inf if biggest else math.inf, dtype=wide.dtype, device=wide.device
            )
        result = _combined(part, src, dist.ReduceOp.MAX if biggest else dist.ReduceOp.MIN)
        return result.to(src.dtype)
    total = _combined(wide.sum(), src, dist.ReduceOp.SUM)
    if kind is aten.sum:
        return total.to(named.get("dtype") or (src.dtype if floating else torch.int64))
    mean = total / numel
    if kind is aten.mean:
        return mean.to(named.get("dtype") or src.dtype)
    correction = 1 if named.get("correction") is None else named["correction"]
    variance = _combined((wide - mean).pow(2).sum(), src, dist.ReduceOp.SUM)
    variance = variance / max(numel - correction, 0)
    return (variance if kind is aten.var else variance.sqrt()).to(src.dtype)


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
        g.group: None for g in grads if isinstance(g, RaggedTensor) and g._spec.world_size > 1
    }
    for group in groups:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)


def _empty_safe(reduce: Callable[[torch.Tensor], torch.Tensor], empty: float):
    """``reduce`` of a rank's piece in fp32, or ``empty`` for a rank that holds none."""

    def part(x: torch.Tensor, order: float) -> torch.Tensor:
        x = x.float()
        return reduce(x) if x.numel() else torch.tensor(empty, device=x.device)

    return part


_NORM_PARTS = {  # per-rank part of a norm of the whole tensor, and how ranks combine them
    math.inf: (_empty_safe(lambda x: x.abs().amax(), 0.0), dist.ReduceOp.MAX),
    -math.inf: (_empty_safe(lambda x: x.abs().amin(), math.inf), dist.ReduceOp.MIN),
    0.0: (lambda x, order: (x != 0).sum().float(), dist.ReduceOp.SUM),
    "p": (lambda x, order: x.float().abs().pow(order).sum(), dist.ReduceOp.SUM),
}


def _equal(func, args, kwargs):
    a, b = args
    if isinstance(a, RaggedTensor) and isinstance(b, RaggedTensor) and a._spec == b._spec:
        return torch.equal(a._local, b._local)
    raise NotImplementedError("torch.equal on RaggedTensors needs the same RaggedShard")


# torch.optim's ``fused=True`` kernels: element-wise updates over lists of tensors
_FUSED_OPTIMIZER_OPS = frozenset(
    f"aten::_fused_{name}_" for name in ("adam", "adamw", "sgd", "adagrad")
)

_SPECIAL = {
    aten.detach.default: _same_spec_unary,
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
