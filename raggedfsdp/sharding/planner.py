"""Structure-aware planning: pack one communication group into one flat buffer of W equal segments.

The problem (veScale-FSDP §4): tensors t with ``e_t`` elements and unit ``g_t``; choose a per-rank
segment size S and a start ``l_t`` in a buffer of ``W * S`` elements so that

* tensors do not overlap and each is contiguous (padding only *between* tensors),
* every segment boundary ``k * S`` strictly inside a tensor lies a multiple of ``g_t`` from its
  start (no unit is cut),
* S and every ``l_t`` are multiples of the collective alignment ``a``,

and minimise S. It is NP-hard (Partition reduces to it), so ``plan_layout`` is a heuristic:

1. For a *fixed order* of tensors, placing each one at its earliest legal start is optimal, because
   the set of legal starts only shrinks as the cursor moves right. ``_Packer`` does that in O(1) per
   tensor, and also tries earlier padding gaps first (first fit), which lets small tensors (norms,
   biases) fill the holes that big tensors leave at segment boundaries.
2. A tensor of ``e_t >= 2 S`` elements covers a whole segment, so S itself must be a multiple of
   ``g_t``. The candidate S therefore lie on multiples of a *running LCM* that grows as S shrinks;
   the search walks those intervals upwards from the lower bound and gallops + bisects inside one.
3. Three orders are tried (model order, by unit, by size) and the smallest S wins.

``plan_layout_exact`` solves small instances exactly (a DP over subsets of tensors, exact because of
point 1) so the heuristic can be tested against the optimum. Everything here is plain Python ints,
free of torch.distributed, so a plan for W = 100,000 ranks takes milliseconds.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

from raggedfsdp.sharding.ragged_shard import RaggedShard, row_numel

__all__ = [
    "DEFAULT_ALIGNMENT_BYTES",
    "Layout",
    "TensorSpec",
    "dtype_itemsize",
    "fits_within",
    "plan_layout",
    "plan_layout_exact",
]

#: Segment and tensor offsets are aligned to 16 bytes: NCCL's vectorised copies and the CUDA
#: caching allocator's alignment both reward it, and the padding it costs is negligible.
DEFAULT_ALIGNMENT_BYTES = 16

_ITEMSIZES = {
    name: size
    for size, names in (
        (8, "float64 double int64 long complex64"),
        (4, "float32 float int32 int"),
        (2, "bfloat16 float16 half int16 short"),
        (1, "int8 uint8 bool float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz"),
    )
    for name in names.split()
}


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of a torch/numpy dtype or a dtype name such as ``"bfloat16"``."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZES:
        raise ValueError(
            f"unknown dtype {dtype!r}; pass a torch dtype or one of {sorted(_ITEMSIZES)}"
        )
    return _ITEMSIZES[name]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a group: its name, global shape, dtype and unit in elements.

    ``unit`` defaults to 1 (element-wise); ``TensorSpec.rows(name, shape, dtype, k)`` makes a
    k-row unit.
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any = "float32"
    unit: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: shape {self.shape} has a negative dim")
        if not isinstance(self.unit, int) or self.unit < 1:
            raise ValueError(
                f"tensor {self.name!r}: unit={self.unit!r} must be a positive number of elements "
                "(1 for element-wise, k * row size for k rows)"
            )

    @classmethod
    def rows(
        cls, name: str, shape: Sequence[int], dtype: Any = "float32", k: int = 1
    ) -> TensorSpec:
        """A tensor whose unit is ``k`` rows (k elements for a 1-D tensor)."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"tensor {name!r}: rows per unit k={k!r} must be a positive int")
        return cls(name, tuple(shape), dtype, k * row_numel(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Layout:
    """A planned flat buffer: W segments of ``segment_size`` elements holding every tensor whole.

    ``offsets[name]`` is the tensor's start in the global buffer of ``W * segment_size`` elements;
    ``shards[name]`` its ``RaggedShard`` (built on first access, so plans at huge W stay cheap).
    """

    tensors: tuple[TensorSpec, ...]
    world_size: int
    segment_size: int
    alignment: int
    offsets: Mapping[str, int]
    lower_bound: int
    strategy: str
    notes: tuple[str, ...] = ()
    planning_time_s: float = field(default=0.0, compare=False)

    @property
    def buffer_numel(self) -> int:
        return self.world_size * self.segment_size

    @property
    def numel(self) -> int:
        """Elements of real data (all tensors together)."""
        return sum(t.numel for t in self.tensors)

    @property
    def padding(self) -> int:
        """Elements of padding in the whole buffer (never inside a tensor)."""
        return self.buffer_numel - self.numel

    @property
    def padding_ratio(self) -> float:
        return self.padding / max(self.numel, 1)

    @property
    def lower_bound_padding(self) -> int:
        return self.world_size * self.lower_bound - self.numel

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.tensors[0].dtype) if self.tensors else 1

    @cached_property
    def by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    @cached_property
    def shards(self) -> Mapping[str, RaggedShard]:
        return _LazyShards(self)

    def segment(self, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of ``rank``'s segment in the global buffer."""
        return rank * self.segment_size, (rank + 1) * self.segment_size

    def local_pieces(self, rank: int) -> list[tuple[str, int, int, int]]:
        """``(name, offset_in_segment, offset_in_tensor, length)`` for each tensor on ``rank``.

        Tensors that ``rank`` holds nothing of are left out.
        """
        seg_start, seg_stop = self.segment(rank)
        pieces = []
        for t in self.tensors:
            start = self.offsets[t.name]
            lo, hi = max(start, seg_start), min(start + t.numel, seg_stop)
            if lo < hi:
                pieces.append((t.name, lo - seg_start, lo - start, hi - lo))
        return pieces

    def segment_piece(self, name: str, rank: int, segment: Any) -> Any:
        """Tensor ``name``'s piece of ``segment`` (rank ``rank``'s S-element flat tensor, e.g. a
        reduce-scatter output): ``segment[a:b]`` for the range this rank holds, maybe empty."""
        start = self.offsets[name]
        lo, hi = self.shards[name].local_range(rank)
        seg_start = rank * self.segment_size
        if lo == hi:
            return segment[0:0]
        return segment[start + lo - seg_start : start + hi - seg_start]

    def gaps(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` of every stretch of padding in the global buffer, in order
        (computed once: a gradient buffer zeroes them at every step)."""
        return self._gaps

    @cached_property
    def _gaps(self) -> tuple[tuple[int, int], ...]:
        gaps, cursor = [], 0
        for start, numel in sorted((self.offsets[t.name], t.numel) for t in self.tensors):
            if start > cursor:
                gaps.append((cursor, start))
            cursor = max(cursor, start + numel)
        if cursor < self.buffer_numel:
            gaps.append((cursor, self.buffer_numel))
        return tuple(gaps)

    def check(self) -> None:
        """Verify every guarantee of the plan; raises ``AssertionError`` naming the broken one."""
        s, a, w = self.segment_size, self.alignment, self.world_size
        assert s % a == 0, f"segment size {s} is not a multiple of the alignment {a}"
        spans = sorted(
            ((self.offsets[t.name], t.numel, t) for t in self.tensors), key=lambda x: x[:2]
        )
        cursor = 0
        for start, numel, t in spans:
            assert start % a == 0, f"tensor {t.name!r} starts at {start}, not aligned to {a}"
            assert start >= cursor, f"tensor {t.name!r} overlaps the tensor before it"
            assert start + numel <= w * s, f"tensor {t.name!r} runs past the buffer"
            first_cut = (start // s + 1) * s
            for cut in range(first_cut, start + numel, s):
                assert (cut - start) % t.unit == 0, (
                    f"segment boundary {cut} cuts a unit of tensor {t.name!r} "
                    f"({cut - start} elements from its start, unit {t.unit})"
                )
            cursor = start + numel
        assert s >= self.lower_bound, (
            f"segment size {s} is below the lower bound {self.lower_bound}"
        )

    def summary(self) -> str:
        return (
            f"W={self.world_size} S={self.segment_size} (lower bound {self.lower_bound}) "
            f"padding {self.padding} elements = {100 * self.padding_ratio:.3f}% "
            f"(bound {100 * self.lower_bound_padding / max(self.numel, 1):.3f}%), "
            f"{len(self.tensors)} tensors, strategy {self.strategy}, "
            f"{1e3 * self.planning_time_s:.1f} ms"
        )


class _LazyShards(Mapping[str, RaggedShard]):
    """``RaggedShard`` per tensor, made on access: a W-long count tuple per tensor is costly at
    100,000 ranks and most callers (a rank's runtime) need only their own pieces."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        self._cache: dict[str, RaggedShard] = {}

    def __getitem__(self, name: str) -> RaggedShard:
        if name not in self._cache:
            t = self._layout.by_name[name]
            counts = _units_per_rank(
                self._layout.offsets[name],
                t.numel,
                t.unit,
                self._layout.segment_size,
                self._layout.world_size,
            )
            self._cache[name] = RaggedShard(t.shape, t.unit, counts, name)
        return self._cache[name]

    def __iter__(self) -> Iterator[str]:
        return (t.name for t in self._layout.tensors)

    def __len__(self) -> int:
        return len(self._layout.tensors)


def _units_per_rank(start: int, numel: int, unit: int, seg: int, world: int) -> tuple[int, ...]:
    """Units whose first element falls in each rank's segment (cuts are at unit multiples)."""
    counts = [0] * world
    n_units = -(-numel // unit)
    if n_units == 0:
        return tuple(counts)
    first, last = start // seg, (start + numel - 1) // seg
    for r in range(first, last + 1):
        lo = max(0, -(-(r * seg - start) // unit))
        hi = min(n_units, -(-((r + 1) * seg - start) // unit))
        counts[r] = max(0, hi - lo)
    return tuple(counts)


# --------------------------------------------------------------------------------- packing core
def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _earliest_start(cursor: int, numel: int, unit: int, step: int, seg: int, align: int) -> int:
    """Earliest start >= ``cursor``, aligned, at which a tensor cuts no unit at segment boundaries.

    ``step`` is ``lcm(unit, align)``: the distance from a legal start to the next boundary must be
    a multiple of the unit and (since S and starts are aligned) of the alignment. A tensor that
    crosses two or more boundaries also needs ``seg % unit == 0``. Only two segments need trying:
    from the next segment on, the situation repeats. Returns -1 if no start works.
    """
    start = _align_up(cursor, align)
    for _ in range(2):
        seg_end = (start // seg + 1) * seg
        if start + numel <= seg_end:
            return start
        room = (seg_end - start) // step * step  # largest legal distance to the boundary
        if room > 0 and (numel <= room + seg or seg % unit == 0):
            return seg_end - room
        start = seg_end
    return -1


#: Consecutive tensors of one ``(numel, unit, step)`` in a packing order: the kind and their
#: indices.
_Run = tuple[tuple[int, int, int], list[int]]


class _Packer:
    """Greedy first-fit packing of tensors (in a given order) for one candidate S."""

    def __init__(self, sizes: Sequence[tuple[int, int, int]], align: int) -> None:
        self.sizes = sizes  # (numel, unit, lcm(unit, align)) per tensor, in input order
        self.align = align

    def runs(self, order: Sequence[int]) -> list[_Run]:
        """``order`` cut into runs of consecutive tensors of one size and unit (the experts of a
        MoE layer), so ``pack`` can place a run of element-unit tensors at once."""
        runs: list[_Run] = []
        for i in order:
            if runs and runs[-1][0] == self.sizes[i]:
                runs[-1][1].append(i)
            else:
                runs.append((self.sizes[i], [i]))
        return runs

    def pack(self, runs: Sequence[_Run], seg: int, *, world: int) -> list[int] | None:
        """Offsets per tensor (input order) if all fit in ``world * seg`` elements, else None.

        ``runs`` is an order as ``runs()`` cuts it. A tensor whose unit divides the alignment
        starts at the aligned cursor and opens no hole, so once such a run's tensors are too
        large for every hole, the rest of the run goes back to back in one step: the same
        offsets as placing them one by one, without a Python step per expert.
        """
        align = self.align
        limit = world * seg
        offsets = [0] * len(self.sizes)
        holes = _Holes(align)
        cursor = 0
        for (numel, unit, step), members in runs:
            free = align % unit == 0 and seg % align == 0
            for j, i in enumerate(members):
                if free and numel > holes.widest:
                    cursor = _back_to_back(offsets, members[j:], numel, cursor, align, limit)
                    if cursor < 0:
                        return None
                    break
                start = holes.fill(numel, unit, step, seg)
                if start >= 0:
                    offsets[i] = start
                    continue
                start = _earliest_start(cursor, numel, unit, step, seg, align)
                if start < 0 or start + numel > limit:
                    return None
                holes.add(cursor, start)
                offsets[i] = start
                cursor = start + numel
        return offsets

    def pack_min_waste(self, seg: int, *, world: int) -> list[int] | None:
        """Dynamic order: always place next the tensor that wastes the least padding at the cursor
        (the largest on ties). Tensors of the same size and unit are interchangeable, so only
        one per kind is tried: O(T x kinds) per S, cheap even for MoE layers of hundreds of
        identical experts."""
        limit = world * seg
        offsets = [0] * len(self.sizes)
        kinds: dict[tuple[int, int, int], list[int]] = {}
        for i in sorted(range(len(self.sizes)), key=lambda i: -self.sizes[i][0]):
            kinds.setdefault(self.sizes[i], []).append(i)
        cursor = 0
        while kinds:
            best, best_start = None, limit + 1
            for kind in kinds:  # largest kinds first: they win ties
                start = _earliest_start(cursor, kind[0], kind[1], kind[2], seg, self.align)
                if 0 <= start < best_start:
                    best, best_start = kind, start
                    if start == cursor:
                        break
            if best is None or best_start + best[0] > limit:
                return None
            members = kinds[best]
            offsets[members.pop(0)] = best_start
            if not members:
                del kinds[best]
            cursor = best_start + best[0]
        return offsets


def _back_to_back(
    offsets: list[int], members: Sequence[int], numel: int, cursor: int, align: int, limit: int
) -> int:
    """Place ``members`` (tensors of ``numel`` elements) one after another from ``cursor``, each
    at an aligned start; the new cursor, or -1 (nothing placed) if the last would pass
    ``limit``."""
    first, stride = _align_up(cursor, align), _align_up(numel, align)
    last = first + (len(members) - 1) * stride
    if last + numel > limit:
        return -1
    for k, i in enumerate(members):
        offsets[i] = first + k * stride
    return last + numel


class _Holes:
    """The padding holes a packing has left behind the cursor, in buffer order, for first fit.

    A group of hundreds of experts leaves a hole at almost every segment boundary, and most
    tensors (the experts themselves) are far larger than any hole; ``widest`` (the largest hole's
    size) lets those skip the scan, so a packing costs O(T) instead of O(T x holes). The answer
    is the same as scanning every hole.
    """

    def __init__(self, align: int) -> None:
        self.align = align
        self.spans: list[tuple[int, int]] = []  # [start, stop)
        self.widest = 0

    def add(self, start: int, stop: int) -> None:
        """Record the padding ``[start, stop)`` if at least one aligned tensor could use it."""
        if stop - start >= self.align:
            self.spans.append((start, stop))
            self.widest = max(self.widest, stop - start)

    def fill(self, numel: int, unit: int, step: int, seg: int) -> int:
        """Place a tensor in the first hole it fits in (first fit): its start, or -1."""
        if numel > self.widest:
            return -1
        for h, (lo, hi) in enumerate(self.spans):
            if hi - lo < numel:
                continue
            start = _earliest_start(lo, numel, unit, step, seg, self.align)
            if start >= 0 and start + numel <= hi:
                self.spans[h : h + 1] = [(lo, start), (_align_up(start + numel, self.align), hi)]
                if hi - lo == self.widest:  # only the widest hole shrinking changes it
                    self.widest = max((b - a for a, b in self.spans), default=0)
                return start
        return -1


# --------------------------------------------------------------------------------- the search
def _validate(tensors: Sequence[TensorSpec], world_size: int, alignment_bytes: int) -> int:
    """Check the inputs and return the alignment in elements."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1 (ranks in the shard dim)")
    if not tensors:
        raise ValueError("tensors is empty: a group needs at least one tensor to plan")
    dupes = sorted(n for n, k in Counter(t.name for t in tensors).items() if k > 1)
    if dupes:
        raise ValueError(f"tensor names must be unique in a group; repeated: {dupes}")
    itemsize = dtype_itemsize(tensors[0].dtype)
    for t in tensors[1:]:
        if dtype_itemsize(t.dtype) != itemsize or str(t.dtype) != str(tensors[0].dtype):
            raise ValueError(
                f"tensor {t.name!r} has dtype {t.dtype} but {tensors[0].name!r} has "
                f"{tensors[0].dtype}: one flat buffer holds one dtype; cast it or plan it in a "
                "group of its own (e.g. a separate mixed-precision policy)"
            )
    if not isinstance(alignment_bytes, int) or alignment_bytes < 1:
        raise ValueError(f"alignment_bytes={alignment_bytes!r} must be a positive int")
    if alignment_bytes % itemsize:
        raise ValueError(
            f"alignment_bytes={alignment_bytes} is not a multiple of the dtype size {itemsize}; "
            "use a multiple such as 16"
        )
    return alignment_bytes // itemsize


def _lower_bound(sizes: Sequence[tuple[int, int, int]], world: int, align: int) -> int:
    """The smallest S that no packing can beat: the even share of the aligned data, at least every
    unit that must sit whole in one segment, and a multiple of the units of the tensors that
    would cover a whole segment at that S (the running-LCM rule)."""
    aligned = [_align_up(n, align) for n, _, _ in sizes]
    slack = max(a - n for a, (n, _, _) in zip(aligned, sizes, strict=True))
    share = -(-(sum(aligned) - slack) // world)
    biggest_unit = max(min(n, u) for n, u, _ in sizes)
    basic = _align_up(max(share, biggest_unit, 1), align)
    for a, b, (required, *_) in _intervals(sizes, basic, max(basic, sum(aligned)), align):
        if _align_up(a, required) <= b:
            return _align_up(a, required)
    return basic


def _intervals(sizes: Sequence[tuple[int, int, int]], lo: int, hi: int, align: int):
    """Yield ``(lo, hi, moduli)`` over ranges of S (ascending) in which the set of tensors that
    must cover a whole segment (``numel >= 2 S``) is fixed.

    ``moduli[0]`` is what S must be a multiple of (the LCM of those tensors' units). The others
    also take in the unit of tensors that cross a boundary anyway (one distinct unit at a time,
    then all together): at such S those tensors may cover a whole segment too, instead of
    waiting for a start from which they cross only once, which can waste most of a segment when
    tensors are a little larger than S (MoE experts). The search tries each.
    """
    cuts = sorted({n // 2 for n, u, _ in sizes if u < n and lo <= n // 2 < hi})
    bounds = [lo - 1, *cuts, hi]
    for below, top in itertools.pairwise(bounds):
        required = math.lcm(align, *(u for n, u, _ in sizes if u < n and n >= 2 * (below + 1)))
        crossing = sorted({u for n, u, _ in sizes if u < n and n > top and required % u})
        moduli = [required, *(math.lcm(required, u) for u in crossing[:_MAX_EXTRA_MODULI])]
        if len(crossing) > 1:
            moduli.append(math.lcm(required, *crossing))
        yield below + 1, top, list(dict.fromkeys(moduli))


#: Distinct units of boundary-crossing tensors tried one at a time as extra moduli of S.
_MAX_EXTRA_MODULI = 4


def _search_multiples(pack, lo: int, hi: int, m: int):
    """Smallest ``S = k * m`` in ``[lo, hi]`` at which ``pack`` succeeds, galloping up from the
    bottom then bisecting; ``(S, offsets)`` or None."""
    first, last = _align_up(lo, m) // m, hi // m
    found, good, k, jump = None, None, first, 1
    while k <= last:
        good = pack(k * m)
        if good is not None:
            found = k
            break
        first, k, jump = k + 1, k + jump, jump * 2
    if found is None:
        if first > last or (good := pack(last * m)) is None:
            return None
        found = last
    while first < found:  # bisect between the last failure and the success
        mid = (first + found) // 2
        offsets = pack(mid * m)
        if offsets is None:
            first = mid + 1
        else:
            found, good = mid, offsets
    return found * m, good


def _search(sizes, align: int, pack: Callable[[int], list[int] | None], lo: int, hi: int):
    """Smallest S in ``[lo, hi]`` at which ``pack`` succeeds, walking the intervals upwards;
    ``(S, offsets)`` or None."""
    for a, b, moduli in _intervals(sizes, lo, hi, align):
        found = [f for m in moduli if (f := _search_multiples(pack, a, b, m))]
        if found:
            return min(found, key=lambda f: f[0])
    return None


def _strategies(packer: _Packer, world: int) -> dict[str, Callable[[int], list[int] | None]]:
    """The packing strategies tried: three fixed orders and the least-waste order for every
    group and, for small groups where they cost little, more orders: all of them for up to five
    tensors, else seeded random ones (a fixed seed, so every rank computes the same plan)."""
    sizes = packer.sizes
    orders = {
        "model order": list(range(len(sizes))),
        "by unit": sorted(range(len(sizes)), key=lambda i: (-sizes[i][1], -sizes[i][0])),
        "by size": sorted(range(len(sizes)), key=lambda i: -sizes[i][0]),
    }
    found = {
        name: partial(packer.pack, packer.runs(order), world=world)
        for name, order in orders.items()
    }
    found["least waste"] = partial(packer.pack_min_waste, world=world)
    if len(sizes) <= _SMALL_GROUP:
        n = len(sizes)
        if math.factorial(n) <= _EXTRA_ORDERS:
            extra = itertools.permutations(range(n))
        else:
            rng = random.Random(0)
            extra = (rng.sample(range(n), n) for _ in range(_EXTRA_ORDERS))
        for i, order in enumerate(extra):
            found[f"order {i}"] = partial(packer.pack, packer.runs(order), world=world)
    return found


#: Groups up to this many tensors also get extra (all, or seeded random) orders.
_SMALL_GROUP = 64
_EXTRA_ORDERS = 120  # all orders of up to five tensors, else this many sampled
#: Packings spent re-checking smaller S after the searches (feasibility is not monotone in S).
_SWEEP_BUDGET = 2048


def plan_layout(
    tensors: Sequence[TensorSpec],
    world_size: int,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> Layout:
    """Plan one group's flat buffer over ``world_size`` ranks (heuristic; see module docstring).

    Args:
        tensors: the group's tensors in model order, one dtype.
        world_size: ranks in the shard dimension.
        alignment_bytes: S and every tensor offset are multiples of this many bytes.
    """
    t0 = time.perf_counter()
    align = _validate(tensors, world_size, alignment_bytes)
    sizes = [(t.numel, t.unit, math.lcm(t.unit, align)) for t in tensors]
    lower = _lower_bound(sizes, world_size, align)
    strategies = _strategies(_Packer(sizes, align), world_size)
    seg, offsets, strategy = _best_packing(sizes, align, strategies, lower)
    return _make_layout(tensors, world_size, align, seg, offsets, lower, strategy, t0)


def _best_packing(
    sizes: Sequence[tuple[int, int, int]],
    align: int,
    strategies: Mapping[str, Callable[[int], list[int] | None]],
    lower: int,
) -> tuple[int, list[int], str]:
    """``(S, offsets, strategy)``: each strategy searched below the best S so far, then the
    sweep. Every successful packing met here is at or above the S returned."""
    hi = max(lower, sum(_align_up(n, align) for n, _, _ in sizes))  # all on rank 0 fits
    best: tuple[int, list[int], str] | None = None
    for name, pack in strategies.items():
        found = _search(sizes, align, pack, lower, hi)
        if found is not None:
            best, hi = (*found, name), found[0] - align
    assert best is not None, "packing everything on rank 0 is always feasible"
    return _sweep_down(sizes, align, strategies, lower, best)


class _Fits(Exception):
    """A packing at or below the segment size asked about succeeded (``fits_within``)."""


def fits_within(
    tensors: Sequence[TensorSpec],
    world_size: int,
    max_padding: int,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> bool:
    """Whether ``plan_layout(tensors, ...)`` pads at most ``max_padding`` elements: exactly its
    answer, found with less work.

    ``plan_layout`` only ever lowers S after a successful packing, so the first packing it
    tries that succeeds at an S small enough proves the answer (the search stops there), and a
    lower bound above that S refutes it before any packing. Searches that ask "does this fit
    the budget?" many times (``coarsen_units``) call this instead of planning in full.
    """
    align = _validate(tensors, world_size, alignment_bytes)
    sizes = [(t.numel, t.unit, math.lcm(t.unit, align)) for t in tensors]
    largest = (max_padding + sum(n for n, _, _ in sizes)) // world_size
    lower = _lower_bound(sizes, world_size, align)
    if lower > largest:
        return False

    def proving(pack: Callable[[int], list[int] | None], seg: int) -> list[int] | None:
        offsets = pack(seg)
        if offsets is not None and seg <= largest:
            raise _Fits
        return offsets

    strategies = _strategies(_Packer(sizes, align), world_size)
    try:
        _best_packing(sizes, align, {k: partial(proving, p) for k, p in strategies.items()}, lower)
    except _Fits:
        return True
    return False


def _sweep_down(sizes, align: int, strategies, lower: int, best):
    """Try every strategy at the legal S just below the best one, within a budget: the searches
    assume feasibility is monotone in S, which it is not quite."""
    budget = _SWEEP_BUDGET // (len(strategies) * max(len(sizes), 1))
    if not budget:
        return best
    below = [
        seg
        for a, b, (required, *_) in _intervals(sizes, lower, best[0] - align, align)
        for seg in range(_align_up(a, required), b + 1, required)
    ]
    for seg in below[len(below) - budget :]:
        for name, pack in strategies.items():
            offsets = pack(seg)
            if offsets is not None:
                return seg, offsets, f"{name} (sweep)"
    return best


def plan_layout_exact(
    tensors: Sequence[TensorSpec],
    world_size: int,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    max_tensors: int = 12,
) -> Layout:
    """The optimal layout, for small groups (used to test the heuristic).

    For a fixed order, earliest placement is optimal, and the earliest end of a *set* of tensors is
    all that matters for the rest; so a DP over subsets (``2^T · T`` placements per candidate S),
    scanning S upwards from the lower bound in alignment steps, finds the true optimum.
    """
    t0 = time.perf_counter()
    align = _validate(tensors, world_size, alignment_bytes)
    if len(tensors) > max_tensors:
        raise ValueError(
            f"plan_layout_exact is exponential in the tensor count; got {len(tensors)} tensors, "
            f"max_tensors={max_tensors}. Use plan_layout for real groups."
        )
    sizes = [(t.numel, t.unit, math.lcm(t.unit, align)) for t in tensors]
    seg = _lower_bound(sizes, world_size, align)
    while True:
        offsets = _exact_pack(sizes, seg, world_size, align)
        if offsets is not None:
            return _make_layout(tensors, world_size, align, seg, offsets, seg, "exact", t0)
        seg += align


def _exact_pack(sizes: Sequence[tuple[int, int, int]], seg: int, world: int, align: int):
    limit = world * seg
    n = len(sizes)
    end = {0: 0}  # subset bitmask -> earliest end of a packing of that subset
    parent: dict[int, tuple[int, int]] = {}  # subset -> (previous subset, tensor placed last)
    for mask in range(1 << n):
        if mask not in end:
            continue
        for i in range(n):
            if mask >> i & 1:
                continue
            numel, unit, step = sizes[i]
            start = _earliest_start(end[mask], numel, unit, step, seg, align)
            nxt = mask | 1 << i
            if start >= 0 and start + numel <= limit and start + numel < end.get(nxt, limit + 1):
                end[nxt], parent[nxt] = start + numel, (mask, i)
    full = (1 << n) - 1
    if full not in end:
        return None
    offsets, mask = [0] * n, full
    while mask:
        prev, i = parent[mask]
        offsets[i] = end[mask] - sizes[i][0]
        mask = prev
    return offsets


def _make_layout(
    tensors: Sequence[TensorSpec],
    world: int,
    align: int,
    seg: int,
    offsets: Sequence[int],
    lower: int,
    strategy: str,
    t0: float,
) -> Layout:
    sizes = [(t.numel, t.unit) for t in tensors]
    return Layout(
        tensors=tuple(tensors),
        world_size=world,
        segment_size=seg,
        alignment=align,
        offsets={t.name: off for t, off in zip(tensors, offsets, strict=True)},
        lower_bound=lower,
        strategy=strategy,
        notes=_explain(tensors, sizes, world, seg, lower, align),
        planning_time_s=time.perf_counter() - t0,
    )


def _explain(
    tensors: Sequence[TensorSpec],
    sizes: Sequence[tuple[int, int]],
    world: int,
    seg: int,
    lower: int,
    align: int,
) -> tuple[str, ...]:
    """Advice when structure, not packing, forces padding (the paper's advice: pick a smaller
    HSDP shard group or a smaller unit)."""
    notes = []
    total = sum(n for n, _ in sizes)
    spanning = sorted({u for n, u in sizes if u < n and n >= 2 * seg and align % u})
    modulus = math.lcm(align, *spanning)
    if modulus > align:
        notes.append(
            f"tensors covering whole segments have units {spanning} elements: S must be a "
            f"multiple of their LCM with the alignment, {modulus}; padding "
            f"{100 * (world * seg - total) / max(total, 1):.2f}%. "
            "A smaller shard group (HSDP) or a common unit reduces it."
        )
    big = [t.name for t, (n, u) in zip(tensors, sizes, strict=True) if min(n, u) * world > total]
    if big:
        notes.append(
            f"units of {big[:3]}{'...' if len(big) > 3 else ''} exceed the even share "
            f"{-(-total // world)} elements per rank, so S >= unit; use a smaller unit or a "
            "smaller shard group (HSDP) to cut padding."
        )
    return tuple(notes)
