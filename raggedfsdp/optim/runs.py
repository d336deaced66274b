"""``RunPlan``: an element-wise step's merged runs, found once and checked each step.

``pieces.merge_runs`` finds by address which neighbouring pieces form one contiguous run, so
that an element-wise update (AdamW) runs a few kernels over whole runs instead of one per
parameter. Finding them costs a pass over every piece's tensors (their storages, addresses and
sizes), which on a model of many small parameters costs more than the update itself. Parameters
and state do not move between steps, so their runs are planned once. Gradients are fresh tensors
every step (``zero_grad(set_to_none=True)``): the plan checks, with one address per piece, that
they lie in each run as the parameters do (``fully_shard`` reduces each group into one fresh
segment of the parameters' layout, so they do) and makes each run's gradient from its first
piece's. Where they do not (separate tensors) the caller merges what it can for that step; where
the parameters moved, it plans again. The update is the same either way, only the bookkeeping
differs.

The step counters that torch's ``adam`` increments (one per run, copies of the shared counter)
are kept too: after each update they equal the shared counter that the runtime increments once,
as long as nothing else wrote it (its version says so).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from raggedfsdp.optim.contract import Piece
from raggedfsdp.optim.pieces import merge_runs, unwrap

__all__ = ["RunPlan"]


def _address_of(pc: Piece) -> tuple[str, int, int]:
    t = pc.local()
    return (t.device.type, t.device.index or 0, t.data_ptr())  # merge_runs' order


@dataclass(eq=False)
class RunPlan:
    """The runs of one set of sharded pieces and their state, and where each piece's gradient
    must lie in its run's for the gradients to form the same runs."""

    pieces: list[Piece]  # as the caller passed them: what the plan is for
    order: list[Piece]  # the non-empty pieces in address order (merge_runs' order)
    locals_: list[Tensor]  # each ordered piece's local() when planned
    firsts: list[int]  # per ordered piece, the index of its run's first piece
    offsets: list[int]  # per ordered piece, its gradient's byte offset from its run's first's
    bounds: list[tuple[int, int, int]]  # per run: first and last ordered piece, elements
    fixed: list[list[Tensor]]  # per column but the gradient: the runs of parameters, state
    counters: list[Tensor]  # one step counter per run, what torch's adam increments
    _followed: Tensor | None = None  # the shared counter the copies follow
    _expected_version: int = -1  # its version once the runtime has incremented it after an update

    @classmethod
    def build(
        cls, pieces: Sequence[Piece], state: Mapping[Tensor, Mapping[str, Tensor]], keys: list[str]
    ) -> RunPlan | None:
        """The runs of ``pieces``' parameters and state ``keys`` (the longest that both form);
        None if any piece is not sharded (single-mode parameters are whole tensors)."""
        if any(not pc.sharded for pc in pieces):
            return None
        order = sorted((pc for pc in pieces if pc.numel > 0), key=_address_of)
        entries = [[pc.local(), *(unwrap(state[pc.param][k]) for k in keys)] for pc in order]
        runs = merge_runs(entries)
        firsts, offsets, bounds = [], [], []
        i = 0
        for run in runs:  # runs are consecutive in address order: take pieces by size
            first, filled = i, 0
            while filled < run[0].numel():
                firsts.append(first)
                offsets.append(filled * run[0].element_size())  # (gradients: the same dtype)
                filled += order[i].numel
                i += 1
            bounds.append((first, i - 1, filled))
        fixed = [list(c) for c in zip(*runs, strict=True)]
        locals_ = [pc.local() for pc in order]
        return cls(list(pieces), order, locals_, firsts, offsets, bounds, fixed, [])

    def current(self) -> bool:
        """Whether the parameters still lie where they were planned (fully_shard's
        ``Module._apply`` support moves them to new storage: the plan is then stale)."""
        return all(map(operator.is_, [pc.local() for pc in self.order], self.locals_))

    def gradients(self) -> list[Tensor] | None:
        """This step's gradient runs, or None when the gradients do not form the planned runs
        (separate tensors: the caller merges what it can, for this step)."""
        grads = [pc.local_grad() for pc in self.order]
        ptrs = [g.data_ptr() for g in grads]
        if list(map(operator.sub, ptrs, [ptrs[f] for f in self.firsts])) != self.offsets:
            return None
        spans = []
        for first, last, numel in self.bounds:
            head = grads[first]
            if first == last:
                spans.append(head)
                continue
            if head.untyped_storage().data_ptr() != grads[last].untyped_storage().data_ptr():
                return None  # neighbours in memory, but not one tensor's
            spans.append(head.as_strided((numel,), (1,)))
        return spans

    def step_counters(self, step: Tensor) -> list[Tensor]:
        """One copy of ``step`` per run for torch's ``adam`` to increment: the kept copies when
        they still equal it (the runtime incremented ``step`` once after the last update and
        nothing else wrote it), else fresh ones."""
        if self._followed is not step or step._version != self._expected_version:
            self.counters = [step.clone() for _ in self.bounds]
            self._followed = step
        self._expected_version = step._version + 1  # after the runtime's ``step += 1``
        return self.counters
