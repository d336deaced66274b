"""gloo all-gather of one flat buffer: raggedfsdp's exchange against the alternatives.

``all_gather_flat`` on gloo sends each rank's segment to every other rank and receives theirs
straight into their segments of the buffer (point-to-point, in place). Timed beside what it
replaced, a bitwise-OR all-reduce of the zero-filled buffer (in place too, but a ring
all-reduce moves twice an all-gather's bytes and the buffer is zero-filled first), and
torch's ``all_gather_single`` (which gloo stages through a scratch copy of the whole buffer).
Every rank checks each result bit for bit; medians of ``--repeats`` timed calls after a
barrier, rank 0's.

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

from raggedfsdp.comm import all_gather_flat

METHODS = ("exchange", "or_all_reduce", "all_gather_single")


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
    print("W   MiB    exchange   OR all-reduce   all_gather_single   (ms, rank 0, medians)")
    for world in args.world_sizes:
        for row in spawn_ranks(_worker, args, world):
            print(json.dumps({"benchmark": "gloo_gather", **row}))
            times = "  ".join(f"{row[m]:14.2f}" for m in METHODS)
            print(f"{world:<3} {row['mib']:<6g} {times}")


if __name__ == "__main__":
    main()
