"""Shampoo step time at W = 1, 2, 4 (CPU, gloo) and the share spent in eigendecompositions.

The parameters (4 layers of a small transformer: qkv 768x256, o 256x256, up 1024x256,
down 256x1024, a norm) are sharded with ``Shampoo.shard_policy(B)``, so every block is whole on
one rank: each rank preconditions its own blocks and no optimizer bytes move. Per world size
and block size B it reports the median step time, the share of it inside ``torch.linalg.eigh``,
eigendecompositions on rank 0, the max/mean eigendecomposition cost over ranks and the bytes
communicated, as one JSON line and a table. On a 2-core machine W=4 oversubscribes the cores:
the work per rank halves, the wall time is not a scaling result.

    python benchmarks/shampoo_step.py [--worlds 1 2 4] [--blocks 1024 128] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {
    f"l{i}.{name}": shape
    for i in range(4)
    for name, shape in (
        ("qkv", (768, 256)),
        ("o", (256, 256)),
        ("up", (1024, 256)),
        ("down", (256, 1024)),
        ("norm", (256,)),
    )
}


def _params(block: int, rank: int, world: int):
    """RaggedTensor parameters on one planned flat shard, as ``fully_shard`` makes them."""
    from raggedfsdp.optim import Shampoo
    from raggedfsdp.sharding import FlatBuffer, RaggedTensor, TensorSpec, plan_layout

    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    policy = Shampoo.shard_policy(max_preconditioner_dim=block)
    specs = [TensorSpec(n, s, "float32", max(1, policy(n, init[n]))) for n, s in SHAPES.items()]
    layout = plan_layout(specs, world)
    params = FlatBuffer(layout, rank, torch.float32)
    params.load_full_tensors(init)
    group = dist.group.WORLD if dist.is_initialized() else None
    return {
        n: torch.nn.Parameter(RaggedTensor(params.shard_view(n), layout.shards[n], rank, group))
        for n in SHAPES
    }


def _measure(block: int, steps: int) -> dict:
    from raggedfsdp.optim import Shampoo
    from raggedfsdp.sharding import RaggedTensor

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    params = _params(block, rank, world)
    opt = Shampoo(list(params.items()), max_preconditioner_dim=block, epsilon=1e-6)
    in_eigh = [0.0]
    eigh = torch.linalg.eigh

    def timed_eigh(*args, **kwargs):
        start = time.perf_counter()
        try:
            return eigh(*args, **kwargs)
        finally:
            in_eigh[0] += time.perf_counter() - start

    torch.linalg.eigh = timed_eigh
    times, shares = [], []
    try:
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            for n, p in params.items():
                lo, hi = p.local_range
                local = torch.randn(SHAPES[n], generator=gen).reshape(-1)[lo:hi].contiguous()
                p.grad = RaggedTensor(local, p.ragged_shard, rank, p.group)
            in_eigh[0] = 0.0
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            opt.step()
            if world > 1:
                dist.barrier()
            elapsed = time.perf_counter() - start
            if step:  # the first step allocates state
                times.append(elapsed)
                shares.append(in_eigh[0] / elapsed)
    finally:
        torch.linalg.eigh = eigh
    stats = opt.last_step_stats
    costs = torch.tensor([float(stats["eigh_cost"])])
    if world > 1:
        peak, total = costs.clone(), costs.clone()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        dist.all_reduce(total)
        balance = float(peak) / (float(total) / world)
    else:
        balance = 1.0
    return {
        "step_ms": 1e3 * statistics.median(times),
        "eigh_share": statistics.median(shares),
        "eigh_rank0": stats["eigendecompositions"],
        "eigh_cost_max_over_mean": balance,
        "bytes": stats["bytes_communicated"],
    }


def _worker(rank: int, world: int, port: int, blocks: list[int], steps: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = {b: _measure(b, steps) for b in blocks}
    if rank == 0:
        out.put(results)
    dist.barrier()  # leave together: gloo may abort a rank that tears down while a peer runs
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 128])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = {}
    ctx = mp.get_context("spawn")
    for world in args.worlds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = ctx.Queue()
        mp.start_processes(
            _worker,
            args=(world, port, args.blocks, args.steps, out),
            nprocs=world,
            start_method="spawn",
        )
        rows[world] = out.get()
    print(json.dumps({"benchmark": "shampoo_step", "results": rows}))
    print(
        f"{'B':>5} {'W':>3} {'step ms':>9} {'eigh share':>11} {'eigh rank0':>11} "
        f"{'cost max/mean':>14} {'bytes':>6}"
    )
    for block in args.blocks:
        for world in args.worlds:
            r = rows[world][block]
            print(
                f"{block:>5} {world:>3} {r['step_ms']:9.1f} {r['eigh_share']:11.2f} "
                f"{r['eigh_rank0']:11d} {r['eigh_cost_max_over_mean']:14.2f} {r['bytes']:6d}"
            )


if __name__ == "__main__":
    main()
