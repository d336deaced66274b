"""Owner compute: moving whole matrices' pieces to their owner rank and the results back.

Who owns which matrix is decided by ``raggedfsdp.sharding.owners`` (``Job``, ``assign_owners``:
torch-free, shared with the capacity planner). This module moves the data: pieces travel to
owners in one batched uneven all-to-all (``all_to_all_single`` with split sizes, the one uneven
collective gloo supports) and results come back the same way. ``ExchangePlan`` is computed from
the jobs and owners alone, identically on every rank, so no extra communication decides who
sends what.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cached_property

import torch

from raggedfsdp.comm import all_to_all_uneven, failing_as
from raggedfsdp.sharding.owners import Job

__all__ = ["ExchangePlan"]


@dataclass
class ExchangePlan:
    """Who sends which piece where, for one rank, in both directions.

    Forward (pieces → owners): this rank sends, to each owner in rank order, its pieces of that
    owner's jobs in job order; an owner receives from each source in rank order. Because ranks
    hold consecutive ranges in rank order, the owner reassembles a job by concatenating the
    sources' pieces: ``assemble`` does all of that with one concatenation. Backward (results →
    holders) is the same exchange with the splits swapped.
    """

    jobs: Sequence[Job]
    owners: Sequence[int]
    rank: int
    world: int
    send_splits: list[int] = field(init=False)
    recv_splits: list[int] = field(init=False)
    local_jobs: list[int] = field(init=False)  # held whole here and owned here: no transfer
    owned_jobs: list[int] = field(init=False)  # owned here, assembled from transfers
    send_order: list[int] = field(init=False)  # jobs whose piece goes into the send buffer

    def __post_init__(self) -> None:
        """One pass over the jobs' pieces: O(W + pieces), so a plan for 100,000 ranks takes
        as long as listing who holds what (nothing here loops over ranks per job)."""
        me = self.rank
        self.send_splits = [0] * self.world
        self.recv_splits = [0] * self.world
        self.local_jobs, self.owned_jobs = [], []
        held: list[tuple[int, int]] = []  # (job, elements) of moved jobs this rank holds
        for j, (job, owner) in enumerate(zip(self.jobs, self.owners, strict=True)):
            if job.sole_holder == owner:
                if owner == me:
                    self.local_jobs.append(j)
                continue
            if owner == me:
                self.owned_jobs.append(j)
            for r, n in job.pieces:
                if r == me and n:
                    self.send_splits[owner] += n
                    held.append((j, n))
                if owner == me:
                    self.recv_splits[r] += n
        held.sort(key=lambda item: self.owners[item[0]])  # by owner, then job (stable)
        self.send_order = [j for j, _ in held]
        self._send_sizes = [n for _, n in held]

    @cached_property
    def elements_sent(self) -> int:
        """Elements this rank sends to other ranks per exchange (itself excluded)."""
        return sum(self.send_splits) - self.send_splits[self.rank]

    @cached_property
    def elements_received(self) -> int:
        return sum(self.recv_splits) - self.recv_splits[self.rank]

    @cached_property
    def _runs(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Where the owned jobs' pieces lie: ``(start in the receive buffer, length)`` in job
        order (how ``assemble`` reads them), and ``(start in the assembled jobs, length)`` in
        receive order (how ``to_holders`` writes them back). The receive buffer lists, per
        source, that source's pieces of the owned jobs. Kept as runs, one pair per piece, not
        as an index per element (8 bytes each, for the optimizer's lifetime)."""
        pieces = [
            (r, k, n) for k, j in enumerate(self.owned_jobs) for r, n in self.jobs[j].pieces if n
        ]
        assembled_at, cursor = [], 0
        for _, _, n in pieces:  # the assembled order: job after job, pieces in job order
            assembled_at.append(cursor)
            cursor += n
        received_at, cursor = {}, 0
        in_receive_order = sorted(range(len(pieces)), key=lambda i: pieces[i][:2])
        for i in in_receive_order:  # the receive order: by source, then job
            received_at[i] = cursor
            cursor += pieces[i][2]
        reads = [(received_at[i], n) for i, (_, _, n) in enumerate(pieces)]
        writes = [(assembled_at[i], pieces[i][2]) for i in in_receive_order]
        return reads, writes

    def assemble(self, recv: torch.Tensor) -> torch.Tensor:
        """The owned jobs' whole flat matrices, job after job, from the receive buffer."""
        reads, _ = self._runs
        return torch.cat([recv.narrow(0, start, n) for start, n in reads]) if reads else recv

    def _disassemble(self, whole: torch.Tensor) -> torch.Tensor:
        """``assemble`` backwards: the owned jobs' results in receive order, to send back."""
        _, writes = self._runs
        return torch.cat([whole.narrow(0, start, n) for start, n in writes]) if writes else whole

    def to_owners(
        self, pieces_of: Callable[[int], torch.Tensor], like: torch.Tensor, group
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Send this rank's pieces (``pieces_of(job)``, 1-D, ``like``'s dtype and device) to
        their owners; returns the owned jobs' whole flat matrices: one buffer and its views, in
        ``owned_jobs`` order."""
        return self.start_to_owners(pieces_of, like, group)()

    def start_to_owners(
        self, pieces_of: Callable[[int], torch.Tensor], like: torch.Tensor, group
    ) -> Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]:
        """``to_owners`` in two halves: start the exchange, work on the local jobs, then call
        the returned function to wait and assemble the owned jobs."""
        sends = [pieces_of(j) for j in self.send_order]
        send = torch.cat(sends) if sends else like.new_empty(0)
        recv = send.new_empty(sum(self.recv_splits))
        with self._failing_as("all-to-all of matrix pieces to their owners"):
            handle = all_to_all_uneven(
                recv, send, self.recv_splits, self.send_splits, group, async_op=True
            )

        def finish() -> tuple[torch.Tensor, list[torch.Tensor]]:
            with self._failing_as("all-to-all of matrix pieces to their owners"):
                handle.wait()
            whole = self.assemble(recv) if recv.numel() else recv
            return whole, self._split(whole)

        return finish

    def to_holders(self, whole: torch.Tensor, group) -> dict[int, torch.Tensor]:
        """Send the owned jobs' results (``whole``, as returned by ``to_owners`` and updated in
        place) back; returns this rank's piece of every moved job it holds, keyed by job."""
        send = self._disassemble(whole) if whole.numel() else whole
        recv = whole.new_empty(sum(self.send_splits))
        with self._failing_as("all-to-all of owner results back to the holders"):
            all_to_all_uneven(recv, send, self.send_splits, self.recv_splits, group)
        out, cursor = {}, 0
        for j, n in zip(self.send_order, self._send_sizes, strict=True):
            out[j] = recv[cursor : cursor + n]
            cursor += n
        return out

    def _failing_as(self, what: str) -> AbstractContextManager[None]:
        return failing_as(
            f"{what} ({len(self.owned_jobs)} jobs owned, {self.elements_sent:,} elements sent) "
            f"on rank {self.rank} of {self.world}"
        )

    def _split(self, whole: torch.Tensor) -> list[torch.Tensor]:
        out, cursor = [], 0
        for j in self.owned_jobs:
            n = self.jobs[j].numel
            out.append(whole[cursor : cursor + n])
            cursor += n
        return out
