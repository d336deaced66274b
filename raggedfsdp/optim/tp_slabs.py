"""Blocked preconditioners on TP parameters whose TP split cuts their blocks: each slab of the
*global* tensor computed on one owner over data parallel × TP.

Why it exists: ``Shampoo`` and ``SOAP`` precondition the global tensor's ``B × B`` blocks, as
one process does. Where every TP block holds whole blocks (``BlockedOptimizer._cut_by_tp`` is
false) each TP rank blocks its own TP block and nothing moves. Elsewhere (a slab taller than a
colwise weight's TP block, a block wider than a rowwise weight's column block, a split on a
middle dim of a 3-D tensor, an EP x TP expert tensor split on ``ep`` and ``tp``) a slab (one
row of blocks) has pieces on several TP ranks, and on several data-parallel ranks of each.
This module then works over the ``T · D`` ranks of TP × dp as one group (``product_group(tp,
dp)``: rank ``t · D + d``, ``t`` row-major over the split mesh dims):

* each global slab's pieces: one contiguous run of each holder's local piece. A split of one
  of the dims that form the blocked view's rows (a *row* split) gives each rank some of a
  slab's rows, a split of a later dim (a *column* split) a block of its columns; a rank's block
  maps onto the global flat order monotonically, so a slab (a run of it) meets it in a run;
* its owner: the holder of the slab's first element, spread over the column splits' ranks
  along each run of slabs on the same row ranks (``slab · C / slabs`` within the run); the
  rank after the balanced share ``slab · W / slabs`` when that order is not monotone (a row
  split after a leading dim, such as ``d_ff`` after the expert dim, interleaves the ranks);
  owners are non-decreasing in slab order, so per-slab state is split by whole slabs in rank
  order;
* the exchange: one uneven all-to-all per input to the owners (``owner_compute.ExchangePlan``,
  as Muon's TP matrices), the owner puts each holder's rows and columns in their place in the
  global slab, the optimizer computes the slab, and the result travels back the same way.
  A slab held whole by its owner is computed from views, and moves nothing.

The per-slab state (factors, roots, bases) of such a parameter is a ``RaggedTensor`` over that
group, split by whole slabs in rank order, in the global tensor's shape: its DCP boxes are
global coordinates, so it reshards to any (dp, tp) and to one process.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from raggedfsdp.comm.mesh import product_group
from raggedfsdp.optim.contract import Piece
from raggedfsdp.optim.owner_compute import ExchangePlan
from raggedfsdp.optim.slabs import Slabs, SlabTask, SlabWork
from raggedfsdp.sharding import RaggedShard
from raggedfsdp.sharding.owners import Job
from raggedfsdp.sharding.tp_shard import TPShard, tp_split_of

__all__ = ["TPSlabGeometry", "TPSlabRunner"]


# ----------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class _Split:
    """How the TP splits run through the blocked view ``dims`` (rows, then the column dims).

    A split-rank ``t`` (``tp.rank``: row-major over the split mesh dims, in mesh order) has one
    coordinate per split. A split of one of the tensor dims that form the view's rows is a
    *row* split (``view_dims`` 0); one of a later dim a *column* split of that view dim."""

    degrees: tuple[int, ...]  # per split, in mesh order
    view_dims: tuple[int, ...]  # per split: 0 for a row split, else the view dim it cuts
    local_dims: tuple[int, ...]  # a split-rank's part of ``dims`` (rows as its own view has)

    @property
    def degree(self) -> int:
        return math.prod(self.degrees)

    @property
    def local_cols(self) -> int:
        return math.prod(self.local_dims[1:])

    @property
    def col_degree(self) -> int:
        """Split-ranks that hold columns of each row (the column splits' degrees)."""
        return math.prod(n for n, v in zip(self.degrees, self.view_dims, strict=True) if v)

    def _coords(self, t: int) -> list[int]:
        coords = [0] * len(self.degrees)
        for k in reversed(range(len(self.degrees))):
            t, coords[k] = divmod(t, self.degrees[k])
        return coords

    def rank_of(self, row_key: int, col_key: int) -> int:
        """The split-rank at row coordinates ``row_key`` and column coordinates ``col_key``
        (each row-major over its splits, in mesh order)."""
        coords = [0] * len(self.degrees)
        for is_col, value in ((False, row_key), (True, col_key)):
            for k in reversed(range(len(self.degrees))):
                if bool(self.view_dims[k]) == is_col:
                    value, coords[k] = divmod(value, self.degrees[k])
        rank = 0
        for k, c in enumerate(coords):
            rank = rank * self.degrees[k] + c
        return rank

    def col_box(self, t: int) -> tuple[slice, ...]:
        """Split-rank ``t``'s part of the view's later dims, one slice per dim."""
        box = [slice(None)] * (len(self.local_dims) - 1)
        for c, v in zip(self._coords(t), self.view_dims, strict=True):
            if v:
                box[v - 1] = slice(c * self.local_dims[v], (c + 1) * self.local_dims[v])
        return tuple(box)


@dataclass(frozen=True)
class _Slab:
    """Where one global slab lies: ``(rank, start, stop)`` runs of the holders' local pieces in
    rank order (what the owner concatenates), its rows, each holding split-rank (in that order)
    with the slab rows it holds (a slice, or their indices where split-ranks' rows interleave),
    the rank holding its first element and that element's row coordinates."""

    parts: tuple[tuple[int, int, int], ...]
    rows: int
    holders: tuple[tuple[int, slice | Tensor], ...]
    first: int
    row_key: int


def _split_of(blocks: Slabs, tp: TPShard) -> tuple[_Split, int]:
    """The TP splits in the blocked view's terms, and the tensor dims that form the view's
    rows: the view's rows are the tensor's leading dims and its later dims the tensor's own
    (``merge_dims`` is refused with TP, so no other views arise)."""
    shape, dims = tp.global_shape, tuple(blocks.dims)
    row_dims = 1 if len(shape) == 1 else len(shape) - len(dims) + 1
    if math.prod(shape[:row_dims]) != dims[0] or dims[1:] != (tuple(shape[row_dims:]) or (1,)):
        raise ValueError(f"blocked view {dims} is not a view of the TP tensor {shape}")
    degrees = tuple(tp.mesh.size(i) for i, _ in tp.splits)
    view_dims = tuple(0 if d < row_dims else d - row_dims + 1 for _, d in tp.splits)
    local = [math.prod(tp.local_shape[:row_dims]), *dims[1:]]
    for v, degree in zip(view_dims, degrees, strict=True):
        if v:
            local[v] //= degree
    return _Split(degrees, view_dims, tuple(local)), row_dims


def _row_map(tp: TPShard, rows: int, row_dims: int) -> tuple[Tensor, Tensor]:
    """For every row of the global view: the row coordinates (row-major over the row splits,
    in mesh order) of the split-ranks holding it, and its row in their own view (the tensor's
    leading dims, each split one cut to its block)."""
    shape, local_shape = tp.global_shape[:row_dims], tp.local_shape[:row_dims]
    r = torch.arange(rows)

    def index(d: int) -> Tensor:  # the row's index along tensor dim d
        return (r // math.prod(shape[d + 1 :])) % shape[d]

    local = sum(
        (index(d) % local_shape[d]) * math.prod(local_shape[d + 1 :]) for d in range(row_dims)
    )
    key = torch.zeros_like(r)
    for i, d in tp.splits:
        if d < row_dims:
            key = key * tp.mesh.size(i) + index(d) // local_shape[d]
    return key, local


def _holders(
    split: _Split, keys: Tensor, local: Tensor
) -> list[tuple[int, int, int, slice | Tensor]]:
    """``(split-rank, first, stop, slab rows)`` of each split-rank holding part of a slab whose
    rows have row coordinates ``keys`` and local rows ``local``, in rank order. A split-rank's
    rows of a slab are contiguous in its view: its block maps onto the global order
    monotonically, so a run of global rows meets it in a run of local rows."""
    holders = []
    for u in torch.unique(keys).tolist():
        held = (keys == u).nonzero().flatten()
        first, count = int(held[0]), held.numel()
        rows = slice(first, first + count) if int(held[-1]) - first + 1 == count else held
        lo, hi = int(local[first]), int(local[held[-1]]) + 1
        for c in range(split.col_degree):
            holders.append((split.rank_of(u, c), lo, hi, rows))
    return sorted(holders, key=lambda h: h[0])


def _slab(
    blocks: Slabs, split: _Split, row_map: tuple[Tensor, Tensor], i: int, bounds: list
) -> _Slab:
    """Slab ``i``'s pieces on the ranks ``t · D + d`` (``bounds``: the dp split of a TP block,
    the same on every split-rank)."""
    a, b = (x // blocks.cols for x in blocks.slab_range(i))
    keys, local = row_map[0][a:b], row_map[1][a:b]
    dp, cols = len(bounds) - 1, split.local_cols
    parts, holders = [], []
    for t, first, stop, rows in _holders(split, keys, local):
        holders.append((t, rows))
        lo, hi = first * cols, stop * cols
        d = bisect_right(bounds, lo) - 1
        while d < dp and bounds[d] < hi:
            start, end = max(lo, bounds[d]), min(hi, bounds[d + 1])
            if end > start:
                parts.append((t * dp + d, start - bounds[d], end - bounds[d]))
            d += 1
    row_key = int(keys[0])
    first = split.rank_of(row_key, 0) * dp + bisect_right(bounds, int(local[0]) * cols) - 1
    return _Slab(tuple(parts), b - a, tuple(holders), first, row_key)


def _owners(slabs: Sequence[_Slab], split: _Split, dp: int) -> list[int]:
    """Each slab's owner, non-decreasing in slab order (see the module docstring): the holder
    of its first element, spread over the column splits' ranks along each run of slabs on
    the same row ranks; balanced shares where that order is not monotone."""
    n, world, cols = len(slabs), dp * split.degree, split.col_degree
    owners = []
    for key, run in itertools.groupby(slabs, key=lambda s: s.row_key):
        run = list(run)
        for j, s in enumerate(run):
            owners.append(split.rank_of(key, j * cols // len(run)) * dp + s.first % dp)
    if all(a <= b for a, b in itertools.pairwise(owners)):
        return owners
    return [i * world // n for i in range(n)]


@dataclass
class TPSlabGeometry:
    """A TP-cut parameter's global blocks and this rank's place among the ``T · D`` ranks of
    TP × data parallel (what ``SlabTask`` and the per-slab state read, as ``SlabGeometry``)."""

    blocks: Slabs
    split: _Split
    slabs: list[_Slab]
    owners: list[int]
    counts: list[int]  # slabs each rank owns (whose state it keeps), in rank order
    rank: int  # ``t · D + d``
    group: ProcessGroup

    @classmethod
    def of(cls, piece: Piece, blocks: Slabs) -> TPSlabGeometry:
        tp = tp_split_of(piece.spec)
        split, row_dims = _split_of(blocks, tp)
        row_map = _row_map(tp, blocks.rows, row_dims)
        bounds, dp = list(piece.spec.bounds), piece.spec.world_size
        slabs = [_slab(blocks, split, row_map, i, bounds) for i in range(blocks.num_slabs)]
        owners = _owners(slabs, split, dp)
        counts = [0] * (dp * tp.size)
        for owner in owners:
            counts[owner] += 1
        group = tp.reduce_group if dp == 1 else product_group(tp.reduce_group, piece.pgroup)
        return cls(blocks, split, slabs, owners, counts, tp.rank * dp + piece.rank, group)

    @property
    def first_owned(self) -> int:
        return sum(self.counts[: self.rank])

    @property
    def num_owned(self) -> int:
        return self.counts[self.rank]

    def slab_shard(self, name: str, shape: tuple[int, ...], per_slab: int) -> RaggedShard:
        """The split of a per-slab state tensor of global ``shape``: whole slabs, each on its
        owner, over this geometry's ``group``."""
        return RaggedShard.from_counts(shape, per_slab, self.counts, name)

    def held(self, i: int) -> slice | None:
        """This rank's part of slab ``i`` in its local flat piece, or None."""
        for rank, start, stop in self.slabs[i].parts:
            if rank == self.rank:
                return slice(start, stop)
        return None

    def is_local(self, i: int) -> bool:
        """Held whole here and owned here: computed from views, nothing moves."""
        parts = self.slabs[i].parts
        return len(parts) == 1 and parts[0][0] == self.owners[i] == self.rank

    def job(self, i: int) -> Job:
        return Job(tuple((rank, stop - start) for rank, start, stop in self.slabs[i].parts), 0.0)

    def to_global(self, i: int, flat: Tensor) -> Tensor:
        """Slab ``i`` as the ``rows × cols`` matrix of the global view, from its pieces
        concatenated in rank order (each holder's rows and columns put in their place)."""
        slab, split = self.slabs[i], self.split
        matrix = flat.new_empty((slab.rows, *self.blocks.dims[1:]))
        sides, offset = split.local_dims[1:], 0
        for t, rows in slab.holders:
            n = _count(rows) * split.local_cols
            matrix[(rows, *split.col_box(t))] = flat[offset : offset + n].view(-1, *sides)
            offset += n
        return matrix.view(slab.rows, self.blocks.cols)

    def to_pieces(self, i: int, matrix: Tensor) -> Tensor:
        """``to_global`` backwards: slab ``i``'s result, flat, in its pieces' rank order."""
        slab, split = self.slabs[i], self.split
        matrix = matrix.reshape(slab.rows, *self.blocks.dims[1:])
        held = [matrix[(rows, *split.col_box(t))].reshape(-1) for t, rows in slab.holders]
        return torch.cat(held)


def _count(rows: slice | Tensor) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


# ----------------------------------------------------------------------------- the runner
@dataclass
class _Exchange:
    """The moved slabs of the work items that share one group and dtype, and their plan."""

    plan: ExchangePlan
    slabs: list[tuple[int, int]]  # (work item, slab) per job
    group: ProcessGroup


class TPSlabRunner:
    """``SlabRunner`` for TP-cut parameters: every global slab computed where it lies whole
    (and is owned) or on its owner over TP × data parallel; caches geometries and plans (the
    layout is fixed for an optimizer's lifetime)."""

    def __init__(self, blocks_of: Callable[[Piece], Slabs]) -> None:
        self._blocks_of = blocks_of
        self._geometries: dict[Piece, TPSlabGeometry] = {}
        self._plans: dict[tuple, list[_Exchange]] = {}

    def geometry(self, piece: Piece) -> TPSlabGeometry:
        if piece not in self._geometries:
            self._geometries[piece] = TPSlabGeometry.of(piece, self._blocks_of(piece))
        return self._geometries[piece]

    def run(
        self,
        work: Sequence[SlabWork],
        compute: Callable[[list[SlabTask]], list[Tensor]],
        stats: dict[str, int],
    ) -> None:
        """Call ``compute`` once with every slab this rank computes (local ones first, then
        the moved ones it owns) and write each result into the holders' ``out``."""
        tasks = []
        for w in work:
            geo = self.geometry(w.piece)
            for i in range(geo.blocks.num_slabs):
                if geo.is_local(i):
                    inputs = {
                        k: x[geo.held(i)].view(-1, geo.blocks.cols) for k, x in w.inputs.items()
                    }
                    tasks.append(SlabTask(w.piece, geo, i, inputs))
        local = len(tasks)
        exchanges = self._exchanges(work)
        owned = [self._to_owners(ex, work) for ex in exchanges]
        tasks += [task for chunk in owned for task in chunk]
        outs = compute(tasks) if tasks else []
        for task, result in zip(tasks[:local], outs, strict=False):
            out = next(w.out for w in work if w.piece is task.piece)
            out[task.geometry.held(task.slab)] = result.reshape(-1)
        cursor = local
        for ex, chunk in zip(exchanges, owned, strict=True):
            self._to_holders(ex, work, chunk, outs[cursor : cursor + len(chunk)], stats)
            cursor += len(chunk)
        stats["owner_slabs"] += len(tasks) - local

    def _exchanges(self, work: Sequence[SlabWork]) -> list[_Exchange]:
        """One exchange per (group, dtype) of the work's moved slabs, the same on every rank
        of the group (built from the global splits, then cached)."""
        key = tuple((w.piece.name, w.out.dtype) for w in work)
        if key in self._plans:
            return self._plans[key]
        by_kind: dict[tuple, list[tuple[int, int]]] = {}
        for n, w in enumerate(work):
            geo = self.geometry(w.piece)
            for i in range(geo.blocks.num_slabs):
                if len(geo.slabs[i].parts) > 1 or geo.slabs[i].parts[0][0] != geo.owners[i]:
                    by_kind.setdefault((id(geo.group), w.out.dtype), []).append((n, i))
        exchanges = []
        for slabs in by_kind.values():
            geos = [self.geometry(work[n].piece) for n, _ in slabs]
            jobs = [geo.job(i) for geo, (_, i) in zip(geos, slabs, strict=True)]
            owners = [geo.owners[i] for geo, (_, i) in zip(geos, slabs, strict=True)]
            world = len(geos[0].counts)
            plan = ExchangePlan(jobs, owners, geos[0].rank, world)
            exchanges.append(_Exchange(plan, slabs, geos[0].group))
        self._plans[key] = exchanges
        return exchanges

    def _to_owners(self, ex: _Exchange, work: Sequence[SlabWork]) -> list[SlabTask]:
        """Send every moved slab's inputs to its owner; the tasks of the slabs owned here, in
        the global view's order."""
        names, like = list(work[0].inputs), work[ex.slabs[0][0]].out
        assembled = {}
        for name in names:

            def part(j: int, name: str = name) -> Tensor:
                n, i = ex.slabs[j]
                return work[n].inputs[name][self.geometry(work[n].piece).held(i)]

            assembled[name] = ex.plan.to_owners(part, like, ex.group)[1]
        tasks = []
        for k, j in enumerate(ex.plan.owned_jobs):
            n, i = ex.slabs[j]
            geo = self.geometry(work[n].piece)
            inputs = {name: geo.to_global(i, assembled[name][k]) for name in names}
            tasks.append(SlabTask(work[n].piece, geo, i, inputs))
        return tasks

    def _to_holders(
        self,
        ex: _Exchange,
        work: Sequence[SlabWork],
        tasks: list[SlabTask],
        outs: list[Tensor],
        stats: dict[str, int],
    ) -> None:
        """Send the owned slabs' results back and write this rank's parts into ``out``."""
        like = work[ex.slabs[0][0]].out
        pieces = [t.geometry.to_pieces(t.slab, o) for t, o in zip(tasks, outs, strict=True)]
        flat = torch.cat(pieces) if pieces else like.new_empty(0)
        for j, part in ex.plan.to_holders(flat.to(like.dtype), ex.group).items():
            n, i = ex.slabs[j]
            work[n].out[self.geometry(work[n].piece).held(i)] = part
        size, inputs, plan = like.element_size(), len(work[0].inputs), ex.plan
        stats["bytes_sent"] += (inputs * plan.elements_sent + plan.elements_received) * size
        stats["bytes_received"] += (inputs * plan.elements_received + plan.elements_sent) * size
