"""Flat-buffer collectives for ragged sharding, correct on gloo (CPU) and NCCL (CUDA).

The sharding core keeps one flat buffer of ``W`` equal segments per communication group, so
FSDP traffic is exactly one all-gather and one reduce-scatter of equal segments, in place. Ragged
moves (e.g. a whole matrix to its owner rank for Muon) go through ``all_to_all_single`` with
uneven splits, the one uneven primitive gloo supports: list-based ``all_to_all``, ``all_gather``,
``gather`` and ``scatter`` fail or abort on uneven sizes there.

Backend notes (torch 2.13):

* ``all_gather_single`` / ``reduce_scatter_single`` are used; ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor`` are deprecated aliases of them that emit a ``FutureWarning``.
* ``ReduceOp.AVG`` is native on both gloo and NCCL for floating dtypes (gloo's result is
  bitwise ``SUM / W``), so averaging needs no post-processing; integer AVG fails on gloo, hence
  the floating-point check.
* At world size 1 nothing is issued: the result is a copy (or nothing, when in place).
* gloo stages both all-gather and reduce-scatter through a scratch copy of the whole buffer
  (measured: +100% of the buffer's memory, and slower). So on gloo (CPU tensors) the all-gather
  is an exchange: each rank sends its segment to every other rank and receives theirs straight
  into their segments of the buffer, ``2 (W - 1)`` point-to-point messages tagged
  :data:`GATHER_TAG`, in place and bit-exact, each rank sending ``(W - 1) S`` as a ring would.
  About 2-3x faster than ``all_gather_single`` or a bitwise-OR all-reduce of the zero-filled
  buffer at 1-48 MiB, W=2 and 4 (BENCHMARKS.md, ``benchmarks/gloo_gather.py``). The
  reduce-scatter of two ranks is an exchange too (each sends the other its segment, tagged
  :data:`REDUCE_TAG`, and adds the one it receives: half an all-reduce's traffic, gloo's bits);
  at W >= 3 one whose input is scratch is an in-place all-reduce. NCCL keeps its true
  all-gather and reduce-scatter.

Every function returns a :class:`~raggedfsdp.comm.handle.CommHandle`; with ``async_op=False`` it
is already complete. ``comm_stream`` (CUDA only) runs the collective on a dedicated stream; see
:mod:`raggedfsdp.comm.handle` for the stream protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup, ReduceOp

from raggedfsdp.comm._checks import (
    check_contiguous,
    check_pair,
    check_segment_alias,
    check_splits,
    is_segment,
    overlaps,
)
from raggedfsdp.comm.handle import CommHandle, Works, launch
from raggedfsdp.comm.mesh import group_rank, group_size

__all__ = [
    "GATHER_TAG",
    "REDUCE_TAG",
    "ReduceKind",
    "all_gather_flat",
    "all_reduce_flat",
    "all_to_all_uneven",
    "reduce_scatter_flat",
]

ReduceKind = Literal["avg", "sum"]
# The tag of gloo's all-gather exchange messages: traffic counters tell them from other
# point-to-point traffic (pipeline stages) by it.
GATHER_TAG = 0x4147
# The tag of gloo's two-rank reduce-scatter exchange messages, counted the same way.
REDUCE_TAG = 0x5253
_REDUCE_OPS = {"avg": ReduceOp.AVG, "sum": ReduceOp.SUM}


def _reduce_op(op: str, tensor: Tensor) -> ReduceOp.RedOpType:
    if op not in _REDUCE_OPS:
        raise ValueError(f"op: expected one of {sorted(_REDUCE_OPS)}, got {op!r}")
    if op == "avg" and not tensor.is_floating_point():
        raise TypeError(f"op: 'avg' needs a floating dtype, got {tensor.dtype}; use 'sum'")
    return _REDUCE_OPS[op]


def _copy_unless_same(dst: Tensor, src: Tensor) -> None:
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


def _check_segments(
    full_name: str, full: Tensor, part_name: str, part: Tensor, group: ProcessGroup | None
) -> tuple[int, int]:
    """Validate a flat buffer of W equal segments against one rank's segment; returns
    ``(world, rank)``. Errors name the argument. The usual call (every group's collectives,
    each step) passes in one expression; only a faulty one runs the checks that name the fault."""
    world, rank = group_size(group), group_rank(group)
    if (
        full.dim() == 1 == part.dim()
        and full.is_contiguous()
        and part.is_contiguous()
        and full.dtype == part.dtype
        and full.device == part.device
        and full.numel() == world * part.numel()
        and (is_segment(full, part, rank) or not overlaps(full, part))
    ):
        return world, rank
    check_contiguous(part_name, part)
    check_contiguous(full_name, full)
    check_pair(full_name, full, part_name, part)
    if full.numel() != world * part.numel():
        raise ValueError(
            f"{full_name}: has {full.numel()} elements, expected world size {world} x "
            f"{part_name} {part.numel()} = {world * part.numel()}"
        )
    check_segment_alias(full_name, full, part_name, part, rank)
    return world, rank


def _exchange(
    full: Tensor, shard: Tensor, group: ProcessGroup | None, world: int, rank: int
) -> Works:
    """Send ``shard`` to every other rank and receive each one's into its segment of ``full``.

    The group's own ``send``/``recv`` take group ranks and skip ``dist.isend``'s per-call
    Python checks (already made once by the caller)."""
    pg = _process_group(group)
    size, works = shard.numel(), []
    for peer in range(world):
        if peer != rank:
            works.append(pg.send([shard], peer, GATHER_TAG))
            works.append(pg.recv([full[peer * size : (peer + 1) * size]], peer, GATHER_TAG))
    return Works(works)


def _process_group(group: ProcessGroup | None) -> ProcessGroup:
    return dist.group.WORLD if group is None else group


def _on_gloo_cpu(tensor: Tensor, group: ProcessGroup | None) -> bool:
    """Whether the exchanges of point-to-point messages replace gloo's collectives."""
    return not tensor.is_cuda and dist.get_backend(group) == "gloo"


def all_gather_flat(
    full: Tensor,
    shard: Tensor,
    group: ProcessGroup | None = None,
    *,
    async_op: bool = False,
    comm_stream: torch.cuda.Stream | None = None,
) -> CommHandle:
    """Gather every rank's equal-size ``shard`` into the flat ``full`` (rank ``r`` at ``r*S``).

    ``shard`` may be this rank's own segment ``full[r*S:(r+1)*S]``: the gather then runs in place
    with no copy at all, which is how the flat parameter buffers are used. On gloo the ranks
    exchange segments point to point (see the module notes).
    """
    world, rank = _check_segments("full", full, "shard", shard, group)
    if world == 1:
        _copy_unless_same(full, shard)
        return CommHandle()
    if _on_gloo_cpu(full, group):
        size = shard.numel()
        _copy_unless_same(full[rank * size : (rank + 1) * size], shard)
        return launch(
            lambda _: _exchange(full, shard, group, world, rank),
            (full, shard),
            async_op,
            comm_stream,
        )
    return launch(
        lambda a: dist.all_gather_single(full, shard, group=group, async_op=a),
        (full, shard),
        async_op,
        comm_stream,
    )


def reduce_scatter_flat(
    shard_out: Tensor,
    full_in: Tensor,
    group: ProcessGroup | None = None,
    op: ReduceKind = "avg",
    *,
    async_op: bool = False,
    comm_stream: torch.cuda.Stream | None = None,
    scratch_input: bool = False,
) -> CommHandle:
    """Reduce the flat ``full_in`` (``W`` equal segments) across ranks into this rank's segment.

    ``shard_out`` may be this rank's segment of ``full_in`` (in place). Both must share a dtype:
    reducing in a wider dtype than the shard is a policy the caller states by casting first.

    ``scratch_input=True`` says ``full_in`` may be overwritten. gloo implements reduce-scatter as
    an all-reduce of a *copy* of the whole input (measured: +100% of the input's memory and
    slower than an in-place all-reduce), so with a scratch input on gloo this runs that
    all-reduce in place and copies only this rank's segment out (nothing, if ``shard_out`` is
    it). NCCL keeps its true reduce-scatter (half the traffic of an all-reduce).
    """
    reduce_op = _reduce_op(op, full_in)
    world, rank = _check_segments("full_in", full_in, "shard_out", shard_out, group)
    if world == 1:
        _copy_unless_same(shard_out, full_in)
        return CommHandle()
    if world == 2 and _on_gloo_cpu(full_in, group):
        return _pair_reduce_scatter(shard_out, full_in, group, op, async_op, rank)
    if scratch_input and dist.get_backend(group) == "gloo":
        size = shard_out.numel()
        segment = full_in[rank * size : (rank + 1) * size]
        return launch(
            lambda a: dist.all_reduce(full_in, op=reduce_op, group=group, async_op=a),
            (shard_out, full_in),
            async_op,
            comm_stream,
            then=lambda: _copy_unless_same(shard_out, segment),
        )
    return launch(
        lambda a: dist.reduce_scatter_single(
            shard_out, full_in, op=reduce_op, group=group, async_op=a
        ),
        (shard_out, full_in),
        async_op,
        comm_stream,
    )


def _pair_reduce_scatter(
    shard_out: Tensor,
    full_in: Tensor,
    group: ProcessGroup | None,
    op: ReduceKind,
    async_op: bool,
    rank: int,
) -> CommHandle:
    """gloo's reduce-scatter of two ranks as the exchange it is: each sends the other its
    segment of ``full_in`` (tagged :data:`REDUCE_TAG`) and adds the one it receives to its own,
    half an all-reduce's traffic. ``a + b`` is ``b + a`` bit for bit, and gloo's average is
    the sum halved, so the result is gloo's all-reduce's to the last bit."""
    size = shard_out.numel()
    mine = full_in[rank * size : (rank + 1) * size]
    theirs = full_in[(1 - rank) * size : (2 - rank) * size]
    inbox = torch.empty_like(shard_out) if overlaps(shard_out, full_in) else shard_out
    pg = _process_group(group)

    def exchange(_: bool) -> Works:
        return Works(
            [pg.send([theirs], 1 - rank, REDUCE_TAG), pg.recv([inbox], 1 - rank, REDUCE_TAG)]
        )

    def add() -> None:
        torch.add(inbox, mine, out=shard_out)
        if op == "avg":
            shard_out.div_(2)

    return launch(exchange, (shard_out, full_in, inbox), async_op, None, then=add)


def all_reduce_flat(
    tensor: Tensor,
    group: ProcessGroup | None = None,
    op: ReduceKind = "avg",
    *,
    async_op: bool = False,
    comm_stream: torch.cuda.Stream | None = None,
) -> CommHandle:
    """Reduce ``tensor`` in place across ``group``: the HSDP replicate-dimension reduction."""
    check_contiguous("tensor", tensor, flat=False)
    reduce_op = _reduce_op(op, tensor)
    if group_size(group) == 1:
        return CommHandle()
    return launch(
        lambda a: dist.all_reduce(tensor, op=reduce_op, group=group, async_op=a),
        (tensor,),
        async_op,
        comm_stream,
    )


def all_to_all_uneven(
    output: Tensor,
    input: Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: ProcessGroup | None = None,
    *,
    async_op: bool = False,
    comm_stream: torch.cuda.Stream | None = None,
) -> CommHandle:
    """Send ``input_split_sizes[j]`` consecutive elements of ``input`` to rank ``j`` and receive
    ``output_split_sizes[i]`` elements from rank ``i`` into consecutive runs of ``output``.

    Sizes may be zero (a rank sending or receiving nothing). The split lists must agree across
    ranks (this rank's ``output_split_sizes[i]`` is rank ``i``'s ``input_split_sizes[me]``); only
    the entry for this rank itself can be checked locally, the rest is the caller's contract.
    """
    check_contiguous("output", output)
    check_contiguous("input", input)
    check_pair("input", input, "output", output)
    world, rank = group_size(group), group_rank(group)
    out_splits = check_splits(
        "output_split_sizes", output_split_sizes, world, output.numel(), "output"
    )
    in_splits = check_splits("input_split_sizes", input_split_sizes, world, input.numel(), "input")
    if out_splits[rank] != in_splits[rank]:
        raise ValueError(
            f"output_split_sizes: receives {out_splits[rank]} elements from this rank ({rank}) "
            f"but input_split_sizes sends it {in_splits[rank]}"
        )
    if overlaps(output, input):
        raise ValueError("output: must not overlap input (all-to-all cannot run in place)")
    if world == 1:
        output.copy_(input)
        return CommHandle()
    return launch(
        lambda a: dist.all_to_all_single(
            output, input, out_splits, in_splits, group=group, async_op=a
        ),
        (output, input),
        async_op,
        comm_stream,
    )
