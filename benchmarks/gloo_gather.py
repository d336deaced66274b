"""gloo all-gather and reduce-scatter of one flat buffer: raggedfsdp's exchanges against the
alternatives.

``all_gather_flat`` on gloo sends each rank's segment to every other rank and receives theirs
straight into their segments of the buffer (point-to-point, in place). Timed beside what it
replaced, a bitwise-OR all-reduce of the zero-filled buffer (in place too, but a ring
all-reduce moves twice an all-gather's bytes and the buffer is zero-filled first), and
torch's ``all_gather_single`` (which gloo stages through a scratch copy of the whole buffer).
The reduce-scatter (averaged, as gradients are): ``reduce_scatter_flat`` of a scratch input,
at W=2 an exchange of segments (each rank sends the other its segment and adds the one it
receives), at W >= 3 an in-place all-reduce; beside the in-place all-reduce itself and torch's
``reduce_scatter_single``. Every rank checks each result bit for bit (a reduce-scatter against
this rank's segment of the all-reduce); medians of ``--repeats`` timed calls after a barrier,
rank 0's.

    python benchmarks/gloo_gather.py [--world-sizes 2 4] [--mib 1 12 48] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from measure import init_gloo, spawn_ranks

from raggedfsdp.comm import all_gather_flat, reduce_scatter_flat

METHODS = ("exchange", "or_all_reduce", "all_gather_single")
REDUCE_METHODS = ("reduce_scatter_flat", "all_reduce", "reduce_scatter_single")


def _methods(full: torch.Tensor, shard: torch.Tensor, rank: int) -> dict[str, Callable]:
    size = shard.numel()
    mine = full[rank * size : (rank + 1) * size]
    out = torch.empty_like(full)

    def or_all_reduce() -> torch.Tensor:
        mine.copy_(shard)
        full[: rank * size].zero_()
        full[(rank + 1) * size :].zero_()
        dist.all_reduce(full.view(torch.int32), op=dist.ReduceOp.BOR)
        return full

    def exchange() -> torch.Tensor:
        mine.copy_(shard)  # as fully_shard's gather does: the shard lives outside the buffer
        all_gather_flat(full, mine)
        return full

    def all_gather_single() -> torch.Tensor:
        dist.all_gather_single(out, shard)
        return out

    return {
        "exchange": exchange,
        "or_all_reduce": or_all_reduce,
        "all_gather_single": all_gather_single,
    }


def _reduce_methods(grads: torch.Tensor, world: int, rank: int) -> dict[str, Callable]:
    """Each averages a fresh scratch copy of ``grads`` (a gradient buffer is filled anew each
    step) and returns this rank's segment."""
    size = grads.numel() // world
    scratch, out = torch.empty_like(grads), torch.empty(size)

    def ours() -> torch.Tensor:
        scratch.copy_(grads)
        reduce_scatter_flat(out, scratch, op="avg", scratch_input=True)
        return out

    def all_reduce() -> torch.Tensor:
        scratch.copy_(grads)
        dist.all_reduce(scratch, op=dist.ReduceOp.AVG)
        return scratch[rank * size : (rank + 1) * size]

    def reduce_scatter_single() -> torch.Tensor:
        scratch.copy_(grads)
        dist.reduce_scatter_single(out, scratch, op=dist.ReduceOp.AVG)
        return out

    return {
        "reduce_scatter_flat": ours,
        "all_reduce": all_reduce,
        "reduce_scatter_single": reduce_scatter_single,
    }


def _time(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    init_gloo(rank, world, port, threads=1)
    rows = []
    for mib in args.mib:
        size = int(mib * 2**20) // 4 // world
        gen = torch.Generator().manual_seed(rank)
        shard = torch.randn(size, generator=gen)
        expected = torch.cat(
            [torch.randn(size, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        )
        full = torch.empty(world * size)
        row = {"world": world, "mib": mib}
        for name, fn in _methods(full, shard, rank).items():
            if not torch.equal(fn().view(torch.int32), expected.view(torch.int32)):
                raise AssertionError(f"{name}: gathered buffer differs from the ranks' shards")
            row[name] = _time(fn, args.repeats) * 1e3
        grads = torch.randn(world * size, generator=torch.Generator().manual_seed(100 + rank))
        reduce = _reduce_methods(grads, world, rank)
        expected = reduce["all_reduce"]().clone()
        for name, fn in reduce.items():
            if not torch.equal(fn().view(torch.int32), expected.view(torch.int32)):
                raise AssertionError(f"{name}: reduced segment differs from the all-reduce's")
            row[name] = _time(fn, args.repeats) * 1e3
        rows.append(row)
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mib", type=float, nargs="+", default=[1, 12, 48])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if min(args.world_sizes) < 2:
        parser.error(f"--world-sizes {args.world_sizes}: a gather needs 2 or more ranks")
    if args.repeats < 1 or min(args.mib) <= 0:
        parser.error("--repeats and --mib must be positive")
    return args


def main() -> None:
    args = parse_args()
    rows = []
    for world in args.world_sizes:
        for row in spawn_ranks(_worker, args, world):
            print(json.dumps({"benchmark": "gloo_gather", **row}))
            rows.append(row)
    for title, methods in (("all-gather", METHODS), ("reduce-scatter (avg)", REDUCE_METHODS)):
        print(f"\n{title}, ms (rank 0, medians)")
        print(f"{'W':<3} {'MiB':<6} " + "  ".join(f"{m:>21}" for m in methods))
        for row in rows:
            times = "  ".join(f"{row[m]:21.2f}" for m in methods)
            print(f"{row['world']:<3} {row['mib']:<6g} {times}")


if __name__ == "__main__":
    main()
