"""What a fake tensor answers when the runtime reads it: zeros (``ZeroValues``) and
addresses (``fake_addresses``).

A fake tensor has a shape and no data, so an op whose *result shape* or Python value depends
on the data (``.item()``, ``nonzero``, ``bincount``) cannot run on it. The runtimes need a few
such reads, all on small control tensors: the ranks' fingerprint check, a non-finite flag,
a step counter, MoE routing counts. This mode answers them as if every fake tensor held zeros:
it runs the op on real zero tensors of the same shapes and hands the result back as a fake
tensor (or a Python number). On the fake process group no data moves anyway, so zeros are
what every rank would see: checks pass, counters stay at their start, and MoE routing sends
every token to expert 0 (the per-expert split changes, the total routed rows do not). Values the
mode can know are kept: small results of ops whose inputs are all known (a rank map made by
``arange``, a count from ``bincount``, a quantization table from Python numbers), so a later
read sees them; such ops also run for real, on at most ``MAX_KNOWN`` elements. An all-to-all
of known values (expert parallelism's routing counts) receives from every peer what this rank
sends it, as if every rank routed as this one does (``_symmetric_all_to_all``).

A fake tensor's storage is a meta storage, whose ``data_ptr()`` is 0 for all of them, yet
raggedfsdp reads addresses to tell a buffer's own segment from an overlap and to find runs of
contiguous pieces. Inside ``fake_addresses`` every meta storage gets an address of its own
(1 TiB apart, so no storage reaches the next even after ``resize_``) and a tensor's address is
its storage's plus its offset, as for real memory. Nothing may dereference them: a native
kernel must not run on fake tensors (the recipe's dry run asks AdamW8bit for its eager update).

torch's optimizers and ``clip_grad_norm_`` pick their foreach kernels (every tensor's
temporaries at once) only for plain ``torch.Tensor``s, so fake tensors would take the
one-tensor-at-a-time loop and another peak; inside ``foreach_as_real`` they choose as real
tensors do.

A ``DeviceMesh`` holds rank numbers in a tensor (``arange``) and finds this rank's coordinate
by comparing them (``nonzero``): with zeros every rank would be nowhere, hence the values
``ZeroValues`` keeps.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = [
    "ZeroValues",
    "fake_addresses",
    "foreach_as_real",
    "real_constant_tables",
    "same_view",
]

MAX_ZERO_ELEMENTS = 1 << 24  # a data-dependent read of a larger tensor is not control flow
MAX_KNOWN = 1 << 16  # results up to this many elements keep their values (rank maps, tables)
ADDRESS_SPACING = 1 << 40  # bytes between two fake storages' addresses


class ZeroValues(TorchDispatchMode):
    """Run data-dependent ops of ``fake_mode``'s tensors on zeros (module docstring)."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self._known = WeakTensorKeyDictionary()  # fake results of this mode -> their values

    def _zeros(self, value: object) -> object:
        if not isinstance(value, FakeTensor):
            return value
        if value in self._known:
            return self._known[value]
        if value.numel() > MAX_ZERO_ELEMENTS:
            raise RuntimeError(
                f"a data-dependent op reads a {tuple(value.shape)} fake tensor; a dry run "
                f"answers such reads with zeros only up to {MAX_ZERO_ELEMENTS} elements: run "
                "this model with real tensors (tensors='real') or avoid the read"
            )
        return torch.zeros(value.shape, dtype=value.dtype, device=value.device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.is_set_to.default:
            return same_view(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            with unset_fake_temporarily():
                real_args, real_kwargs = tree_map(self._zeros, (args, kwargs))
                return tree_map(self._fake, func(*real_args, **real_kwargs))
        self._propagate(func, args, kwargs, out)
        return out

    def _propagate(self, func: OpOverload, args: tuple, kwargs: dict, out: object) -> None:
        """Keep the values of small results whose fake inputs all have known values (rank maps
        made by ``arange``, counts and their views, tables made from Python numbers); a
        mutation by an op with an unknown input forgets them."""
        fakes = [t for t in tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)]
        if any(t not in self._known for t in fakes):
            if func._schema.is_mutable:
                for t in fakes:
                    self._known.pop(t, None)
            return
        if func in _ALL_TO_ALL:
            output, input = (self._known[t] for t in fakes[:2])
            with unset_fake_temporarily():
                return _symmetric_all_to_all(output, input, args[2])
        outs = [t for t in tree_leaves(out) if isinstance(t, FakeTensor)]
        if not outs or any(t.numel() > MAX_KNOWN for t in outs):
            return
        with unset_fake_temporarily():
            real_args, real_kwargs = tree_map(self._zeros, (args, kwargs))
            real = func(*real_args, **real_kwargs)
        for fake, value in zip(tree_leaves(out), tree_leaves(real), strict=True):
            if isinstance(fake, FakeTensor):
                self._known[fake] = value

    def _fake(self, value: object) -> object:
        """A real result as a fake tensor that remembers its values (``counts.tolist()`` after
        ``bincount`` reads the counts, not zeros)."""
        if not isinstance(value, torch.Tensor):
            return value
        fake = self.fake_mode.from_tensor(value)
        self._known[fake] = value
        return fake


_ALL_TO_ALL = (torch.ops.c10d.alltoall_base_.default,)


def _symmetric_all_to_all(output: torch.Tensor, input: torch.Tensor, group: object) -> None:
    """The values a known all-to-all receives on the fake process group, where no peer sends
    anything: each peer is taken to send this rank what this rank sends each peer (the chunk
    addressed to this rank, from every source). For MoE routing counts that is the routing a
    rank sees when every rank routes as it does (every token to expert 0 under zeros), so the
    expert rank simulated receives every rank's tokens for its experts: the largest expert
    batch a real step could make, not none."""
    group = torch.distributed.ProcessGroup.unbox(group)  # the op's argument is a ScriptObject
    ranks = group.size()
    if input.numel() % ranks or output.numel() != input.numel():
        output.zero_()  # uneven splits: nothing received (never the memory it was made with)
        return
    mine = input.reshape(ranks, -1)[group.rank()]
    output.copy_(mine.expand(ranks, -1).reshape(output.shape))


def same_view(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """``aten.is_set_to`` from the tensors' metadata: the same storage, offset, sizes and
    strides. Fake tensors have no kernel for it, and torch's fallback runs it on real zero
    copies of both: the whole gathered buffer allocated for real on every call (most of a
    large MoE model's dry run), and two copies are never one storage, so it always said
    False and ``fully_shard`` rebound every parameter, which a real run does not."""
    return (
        tensor.untyped_storage()._cdata == other.untyped_storage()._cdata
        and tensor.storage_offset() == other.storage_offset()
        and tensor.shape == other.shape
        and tensor.stride() == other.stride()
    )


@contextmanager
def fake_addresses() -> Iterator[None]:
    """Distinct, stable ``data_ptr()`` values for meta storages and fake tensors inside."""
    bases: dict[int, int] = {}
    slots = itertools.count(1)
    storage_ptr = torch.UntypedStorage.data_ptr

    def address(storage: torch.UntypedStorage) -> int:
        if storage.device.type != "meta":
            return storage_ptr(storage)
        key = id(storage)
        if key not in bases:
            bases[key] = next(slots) * ADDRESS_SPACING
            weakref.finalize(storage, bases.pop, key, None)
        return bases[key]

    def tensor_ptr(tensor: FakeTensor) -> int:
        return address(tensor.untyped_storage()) + tensor.storage_offset() * tensor.element_size()

    torch.UntypedStorage.data_ptr = address  # type: ignore[method-assign]
    FakeTensor.data_ptr = tensor_ptr  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.data_ptr = storage_ptr  # type: ignore[method-assign]
        del FakeTensor.data_ptr


@contextmanager
def foreach_as_real() -> Iterator[None]:
    """Fake tensors count as plain tensors where torch chooses foreach kernels."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    lists = (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types)
    for types in lists:
        types.append(FakeTensor)
    try:
        yield
    finally:
        for types in lists:
            types.remove(FakeTensor)


def real_constant_tables() -> None:
    """Build, with real tensors, the constant tables a runtime caches once per process and
    device: AdamW8bit's code maps (``QuantMap.get``, 0.55 MiB per device) and the FP8 gathers'
    decode tables (e4m3 and e8m0, 1 KiB each, built by decoding one MX block). Built inside a dry
    run they would be that run's fake tensors left in the cache, so a later dry run (or real
    code: the FP8 tests after an FP8 dry run) in the
    same process would use them uncounted (its figures would depend on what ran before), and
    their bisection on fake tensors takes most of a small dry run. Built here, before any
    tally starts, no dry run counts them; a real job builds them once per process, outside
    the per-rank memory the planner models (docs/dry_run.md)."""
    from raggedfsdp.fsdp import float8, mxfp8
    from raggedfsdp.optim.quant import QuantMap

    cpu = torch.device("cpu")
    for signed in (True, False):
        QuantMap.get(signed, cpu)
    codes = torch.zeros(mxfp8.MX_BLOCK, dtype=float8.FP8_DTYPE)  # one block decodes each table
    mxfp8.dequantize_mx(codes, torch.zeros(1, dtype=torch.uint8), torch.float32)
