"""Where a blocked preconditioner computes its slabs: where they lie whole, or on an owner.

Shampoo and SOAP cut a parameter's matrix view into ``B × B`` blocks (``ShampooBlocks``,
``SoapBlocks``); a *slab* is one row of blocks. Their per-block math needs every element of a
slab, so this module decides, per step, where each slab is computed and moves the data for it:

* a slab that lies whole on this rank (always, under the optimizers' ``shard_policy``) is
  computed here from views of the local pieces: no communication;
* a slab that a forced layout cut is computed by its *owner* (the rank holding its first
  element, where its per-slab state lives): the holders send their parts of each named input
  through one batched uneven all-to-all per input (``owner_compute.ExchangePlan``), and the
  owner sends the slab's output back the same way.

``SlabRunner.run`` hands the optimizer every slab this rank computes at once, as
``SlabTask`` s, so the optimizer can batch work across slabs (equal-size eigendecompositions).
Per-slab state is split by whole slabs in rank order (``SlabGeometry.slab_shard``), so it is a
``RaggedTensor`` that DCP reshards like any other state.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from raggedfsdp.optim.contract import Piece
from raggedfsdp.optim.owner_compute import ExchangePlan
from raggedfsdp.sharding import RaggedShard
from raggedfsdp.sharding.owners import Job

__all__ = ["SlabGeometry", "SlabRunner", "SlabTask", "SlabWork", "Slabs"]


class Slabs(Protocol):
    """What the runner reads of a tensor's blocks: its ``rows × cols`` view cut into slabs of
    ``slab_rows`` whole rows (``ShampooBlocks``, ``SoapBlocks``), and (for TP splits) the
    blocked view's ``dims`` with the block ``sides`` along each."""

    @property
    def dims(self) -> tuple[int, ...]: ...

    @property
    def sides(self) -> tuple[int, ...]: ...

    @property
    def rows(self) -> int: ...

    @property
    def cols(self) -> int: ...

    @property
    def num_slabs(self) -> int: ...

    def slab_range(self, i: int) -> tuple[int, int]: ...

    def slabs_starting_in(self, start: Any, stop: Any) -> Any: ...

    def slab_owners(self, bounds: Sequence[int]) -> list[int]: ...


@dataclass
class SlabGeometry:
    """A blocked parameter's blocks (``ShampooBlocks``, ``SoapBlocks``) and this rank's place
    in them."""

    blocks: Slabs
    bounds: list[int]  # rank r holds [bounds[r], bounds[r + 1]) of the flat parameter
    rank: int
    counts: list[int]  # slabs whose first element each rank holds (whose state it keeps)
    owners: list[int]  # owner rank of every slab
    first_owned: int  # this rank's first owned slab (index 0 of its per-slab state)

    @classmethod
    def of(cls, piece: Piece, blocks: Slabs) -> SlabGeometry:
        spec = piece.spec
        bounds = [0, blocks.rows * blocks.cols] if spec is None else list(spec.bounds)
        counts = [blocks.slabs_starting_in(a, b) for a, b in itertools.pairwise(bounds)]
        first = sum(counts[: piece.rank])
        return cls(blocks, bounds, piece.rank, counts, blocks.slab_owners(bounds), first)

    @property
    def num_owned(self) -> int:
        return self.counts[self.rank]

    def held(self, i: int) -> slice:
        """This rank's part of slab ``i``, in its local flat view of the parameter."""
        start, stop = self.blocks.slab_range(i)
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        return slice(max(start, lo) - lo, min(stop, hi) - lo)

    def is_local(self, i: int) -> bool:
        start, stop = self.blocks.slab_range(i)
        return self.bounds[self.rank] <= start and stop <= self.bounds[self.rank + 1]

    def slab_shard(
        self, piece: Piece, name: str, shape: tuple[int, ...], per_slab: int
    ) -> RaggedShard | None:
        """The split of a per-slab state tensor of global ``shape`` (slabs first, ``per_slab``
        elements each): whole slabs, each on its owner; None in single mode."""
        if piece.spec is None:
            return None
        return RaggedShard.from_counts(shape, per_slab, self.counts, f"{piece.name}.{name}")


@dataclass
class SlabWork:
    """One blocked parameter's step on this rank: its named flat inputs (this rank's piece of
    each) and the flat output the slabs' results are written into."""

    piece: Piece
    inputs: dict[str, Tensor]
    out: Tensor


@dataclass
class SlabTask:
    """One slab this rank computes: ``inputs`` are its ``rows × cols`` views (of local pieces,
    or assembled from the holders), ``owned`` its index in this rank's per-slab state."""

    piece: Piece
    geometry: SlabGeometry
    slab: int
    inputs: dict[str, Tensor]

    @property
    def owned(self) -> int:
        return self.slab - self.geometry.first_owned


@dataclass
class _CutSlabs:
    """The slabs of one set of pieces that their layout cut, and their exchange."""

    plan: ExchangePlan
    slabs: list[tuple[Piece, int]]  # (piece, slab index) per job


class SlabRunner:
    """Runs an optimizer's per-slab computation on every slab of a step, each on the rank that
    holds it whole or on its owner; caches geometries and exchange plans (the layout is fixed
    for an optimizer's lifetime)."""

    def __init__(self, blocks_of: Callable[[Piece], Slabs]) -> None:
        self._blocks_of = blocks_of
        self._geometries: dict[Piece, SlabGeometry] = {}
        self._cut: dict[tuple[str, ...], _CutSlabs] = {}

    def geometry(self, piece: Piece) -> SlabGeometry:
        if piece not in self._geometries:
            self._geometries[piece] = SlabGeometry.of(piece, self._blocks_of(piece))
        return self._geometries[piece]

    def run(
        self,
        work: Sequence[SlabWork],
        compute: Callable[[list[SlabTask]], list[Tensor]],
        stats: dict[str, int],
    ) -> None:
        """Call ``compute`` once with every slab this rank computes (local ones first, then the
        cut slabs it owns) and write each returned ``rows × cols`` result into ``out``, here or,
        for cut slabs, on their holders."""
        tasks = []
        for w in work:
            geo = self.geometry(w.piece)
            for i in range(geo.blocks.num_slabs):
                if geo.is_local(i):
                    tasks.append(SlabTask(w.piece, geo, i, self._views(w.inputs, geo, i)))
        local = len(tasks)
        cut = self._cut_plan([w.piece for w in work])
        owned = self._to_owners(cut, work) if cut.slabs else []
        tasks += owned
        outs = compute(tasks) if tasks else []
        out_of = {w.piece: w.out for w in work}
        for task, result in zip(tasks[:local], outs, strict=False):
            out_of[task.piece][task.geometry.held(task.slab)] = result.reshape(-1)
        if cut.slabs:
            self._to_holders(cut, work, outs[local:], stats)
        stats["owner_slabs"] += len(owned)

    @staticmethod
    def _views(inputs: dict[str, Tensor], geo: SlabGeometry, i: int) -> dict[str, Tensor]:
        held, cols = geo.held(i), geo.blocks.cols
        return {name: x[held].view(-1, cols) for name, x in inputs.items()}

    def _to_owners(self, cut: _CutSlabs, work: Sequence[SlabWork]) -> list[SlabTask]:
        """Send every cut slab's inputs to its owner; the tasks of the slabs owned here."""
        by_piece = {w.piece: w for w in work}
        names = list(work[0].inputs)
        like = work[0].out
        group = cut.slabs[0][0].pgroup
        assembled = {}
        for name in names:

            def part(j: int, name: str = name) -> Tensor:
                pc, i = cut.slabs[j]
                return by_piece[pc].inputs[name][self.geometry(pc).held(i)]

            assembled[name] = cut.plan.to_owners(part, like, group)[1]
        tasks = []
        for n, j in enumerate(cut.plan.owned_jobs):
            pc, i = cut.slabs[j]
            geo = self.geometry(pc)
            inputs = {name: assembled[name][n].view(-1, geo.blocks.cols) for name in names}
            tasks.append(SlabTask(pc, geo, i, inputs))
        return tasks

    def _to_holders(
        self,
        cut: _CutSlabs,
        work: Sequence[SlabWork],
        outs: list[Tensor],
        stats: dict[str, int],
    ) -> None:
        """Send the owned cut slabs' results back and write this rank's parts into ``out``."""
        by_piece = {w.piece: w for w in work}
        like = work[0].out
        flat = torch.cat([o.reshape(-1) for o in outs]) if outs else like.new_empty(0)
        back = cut.plan.to_holders(flat, cut.slabs[0][0].pgroup)
        for j, part in back.items():
            pc, i = cut.slabs[j]
            by_piece[pc].out[self.geometry(pc).held(i)] = part
        size, inputs, ex = like.element_size(), len(work[0].inputs), cut.plan
        stats["bytes_sent"] += (inputs * ex.elements_sent + ex.elements_received) * size
        stats["bytes_received"] += (inputs * ex.elements_received + ex.elements_sent) * size

    def _cut_plan(self, pieces: list[Piece]) -> _CutSlabs:
        """Every cut slab of these pieces as an owner-compute job, the same on every rank
        (built from the global splits, then cached)."""
        key = tuple(pc.name for pc in pieces)
        if key in self._cut:
            return self._cut[key]
        jobs, slabs, groups = [], [], set()
        for pc in pieces:
            if pc.spec is None:
                continue  # single mode: every slab is whole
            geo = self.geometry(pc)
            for i in range(geo.blocks.num_slabs):
                start, stop = geo.blocks.slab_range(i)
                job = Job.spanning(start, stop, geo.bounds, float(stop - start))
                if job.sole_holder is None:
                    jobs.append(job)
                    slabs.append((pc, i))
                    groups.add(id(pc.pgroup))
        if len(groups) > 1:
            raise ValueError(
                "parameters whose blocks are cut by their layout must share one process group "
                "in a param group"
            )
        world = slabs[0][0].spec.world_size if slabs else 1
        rank = slabs[0][0].rank if slabs else 0
        owners = [self.geometry(pc).owners[i] for pc, i in slabs]
        self._cut[key] = _CutSlabs(ExchangePlan(jobs, owners, rank, world), slabs)
        return self._cut[key]
