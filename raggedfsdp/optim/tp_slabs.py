"""Blocked preconditioners on TP parameters whose TP split cuts their blocks: each slab of the
*global* tensor computed on one owner over data parallel × TP.

Why it exists: ``Shampoo`` and ``SOAP`` precondition the global tensor's ``B × B`` blocks, as
one process does. Where every TP block holds whole blocks (``BlockedOptimizer._cut_by_tp`` is
false) each TP rank blocks its own TP block and nothing moves. Elsewhere (a slab taller than a
colwise weight's TP block, a block wider than a rowwise weight's column block, a split on a
middle dim of a 3-D tensor) a slab (one row of blocks) has pieces on several TP ranks, and on
several data-parallel ranks of each. This module then works over the ``T · D`` ranks of TP × dp
as one group (``product_group(tp, dp)``: rank ``t · D + d``):

* each global slab's pieces: one contiguous run of each holder's local piece (a TP block holds
  a contiguous run of a slab's rows in its own row order, or, for a split along a later dim of
  the blocked view, the slab's rows of its column block);
* its owner: the holder of the slab's first element for a row split (the rank after the
  balanced share ``slab · W / slabs`` when that order is not monotone: a middle-dim split
  interleaves TP ranks), for a column split the holder on TP rank ``slab · T / slabs``; owners
  are non-decreasing in slab order, so per-slab state is split by whole slabs in rank order;
* the exchange: one uneven all-to-all per input to the owners (``owner_compute.ExchangePlan``,
  as Muon's TP matrices), the owner puts the pieces in global order (rows back in order by a
  per-slab row order, or TP column blocks concatenated along the split dim), the optimizer
  computes the slab, and the result travels back the same way.

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
    """How the TP split runs through the blocked view ``dims`` (rows, then the column dims)."""

    view_dim: int  # 0: the view's rows; else the view dim the split cuts (a column split)
    degree: int
    local_dims: tuple[int, ...]  # the TP block's part of ``dims`` (rows as its own view has)

    @property
    def local_cols(self) -> int:
        return math.prod(self.local_dims[1:])


@dataclass(frozen=True)
class _Slab:
    """Where one global slab lies: ``(rank, start, stop)`` runs of the holders' local pieces in
    rank order (what the owner concatenates), its rows, for a row split whose TP ranks
    interleave the slab row of each concatenated row (None: already in order), and the rank
    holding its first element."""

    parts: tuple[tuple[int, int, int], ...]
    rows: int
    order: Tensor | None
    first: int


def _split_of(blocks: Slabs, tp: TPShard) -> tuple[_Split, int]:
    """The TP split in the blocked view's terms, and the tensor dims that form the view's rows:
    the view's rows are the tensor's leading dims and its later dims the tensor's own
    (``merge_dims`` is refused with TP, so no other views arise)."""
    shape, dims = tp.global_shape, tuple(blocks.dims)
    row_dims = 1 if len(shape) == 1 else len(shape) - len(dims) + 1
    if math.prod(shape[:row_dims]) != dims[0] or dims[1:] != (tuple(shape[row_dims:]) or (1,)):
        raise ValueError(f"blocked view {dims} is not a view of the TP tensor {shape}")
    view_dim = 0 if tp.dim < row_dims else tp.dim - row_dims + 1
    local = list(dims)
    local[view_dim] //= tp.size
    return _Split(view_dim, tp.size, tuple(local)), row_dims


def _row_map(tp: TPShard, rows: int, row_dims: int) -> tuple[Tensor, Tensor]:
    """For every row of the global view: the TP rank holding it and its row in that rank's
    own view (the tensor's leading dims, the split one cut to its TP block)."""
    shape, k = tp.global_shape, tp.dim
    r = torch.arange(rows)
    inner, size = math.prod(shape[k + 1 : row_dims]), shape[k]
    local = size // tp.size
    i = (r // inner) % size
    outer = r // (inner * size)
    return i // local, (outer * local + i % local) * inner + r % inner


def _runs(
    blocks: Slabs, split: _Split, row_map: tuple[Tensor, Tensor] | None, i: int
) -> tuple[list[tuple[int, int, int]], Tensor | None]:
    """``(TP rank, first, stop)`` of each TP block's rows of slab ``i`` in its own view, and
    the slab row of each row in that order (None: in order). A TP block's rows of a slab are
    contiguous in its view: the split maps a run of global rows onto a run of local rows."""
    a, b = (x // blocks.cols for x in blocks.slab_range(i))
    if row_map is None:  # a column split: every TP rank holds all the rows
        return [(t, a, b) for t in range(split.degree)], None
    owner, local = row_map[0][a:b], row_map[1][a:b]
    runs = []
    for t in torch.unique(owner).tolist():
        rows = local[owner == t]
        runs.append((t, int(rows[0]), int(rows[-1]) + 1))
    ordered = bool((owner[1:] >= owner[:-1]).all())
    return runs, None if ordered else torch.argsort(owner, stable=True)


def _slab(
    blocks: Slabs, split: _Split, row_map: tuple[Tensor, Tensor] | None, i: int, bounds: list
) -> _Slab:
    """Slab ``i``'s pieces on the ranks ``t · D + d`` (``bounds``: the dp split of a TP block,
    the same on every TP rank)."""
    runs, order = _runs(blocks, split, row_map, i)
    dp, cols = len(bounds) - 1, split.local_cols
    parts = []
    for t, first, stop in runs:
        lo, hi = first * cols, stop * cols
        d = bisect_right(bounds, lo) - 1
        while d < dp and bounds[d] < hi:
            start, end = max(lo, bounds[d]), min(hi, bounds[d + 1])
            if end > start:
                parts.append((t * dp + d, start - bounds[d], end - bounds[d]))
            d += 1
    a = blocks.slab_range(i)[0] // blocks.cols
    t0, row0 = (0, a) if row_map is None else (int(row_map[0][a]), int(row_map[1][a]))
    first = t0 * dp + bisect_right(bounds, row0 * cols) - 1
    rows = sum(stop - f for _, f, stop in runs) if row_map is not None else runs[0][2] - runs[0][1]
    return _Slab(tuple(parts), rows, order, first)


def _owners(slabs: Sequence[_Slab], split: _Split, dp: int) -> list[int]:
    """Each slab's owner, non-decreasing in slab order (see the module docstring)."""
    n, world = len(slabs), dp * split.degree
    if split.view_dim:  # a column split: spread over the TP ranks, on the first row's dp rank
        return [i * split.degree // n * dp + s.first % dp for i, s in enumerate(slabs)]
    owners = [s.first for s in slabs]
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
        row_map = _row_map(tp, blocks.rows, row_dims) if split.view_dim == 0 else None
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
        concatenated in rank order."""
        slab, split, cols = self.slabs[i], self.split, self.blocks.cols
        if split.view_dim:
            sides = (slab.rows, *split.local_dims[1:])
            blocks = [b.view(sides) for b in flat.chunk(split.degree)]
            return torch.cat(blocks, dim=split.view_dim).view(slab.rows, cols)
        matrix = flat.view(slab.rows, cols)
        return matrix if slab.order is None else matrix[torch.argsort(slab.order)]

    def to_pieces(self, i: int, matrix: Tensor) -> Tensor:
        """``to_global`` backwards: slab ``i``'s result, flat, in its pieces' rank order."""
        slab, split = self.slabs[i], self.split
        if split.view_dim:
            sides = (slab.rows, *self.blocks.dims[1:])
            blocks = matrix.reshape(sides).chunk(split.degree, dim=split.view_dim)
            return torch.cat([b.reshape(-1) for b in blocks])
        return (matrix if slab.order is None else matrix[slab.order]).reshape(-1)


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
