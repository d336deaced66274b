"""A short multi-process tour of the sharding core: plan, zero-copy all-gather, reduce-scatter.

``python examples/demo.py [--world-size 2] [--rows 16]`` starts W gloo processes on
127.0.0.1 and, for the tensors of a small LLaMA-style block:

1. plans one flat buffer with k-row units and prints where every tensor landed;
2. loads each rank's ragged shards, all-gathers the buffer in place, and checks that every
   parameter (a view of the buffer) equals the original bitwise, with no copy;
3. reduce-scatters per-rank gradients written into the flat gradient buffer and checks the
   averaged shard against a single-process reference.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from raggedfsdp.comm import all_gather_flat, reduce_scatter_flat
from raggedfsdp.comm.launch import spawn_local
from raggedfsdp.sharding import FlatBuffer, TensorSpec, plan_layout

BLOCK = {  # a LLaMA block at 1/64 of Llama-3-8B's width (dim 64, GQA 4:1, SwiGLU 224)
    "attention.wq.weight": (64, 64),
    "attention.wk.weight": (16, 64),
    "attention.wv.weight": (16, 64),
    "attention.wo.weight": (64, 64),
    "feed_forward.w1.weight": (224, 64),
    "feed_forward.w3.weight": (224, 64),
    "feed_forward.w2.weight": (64, 224),
    "attention_norm.weight": (64,),
    "ffn_norm.weight": (64,),
}


def _worker(rank: int, world: int, rows: int) -> None:
    torch.manual_seed(0)  # identical "initialisation" on every rank
    params = {name: torch.randn(shape) for name, shape in BLOCK.items()}
    specs = [TensorSpec.rows(name, shape, "float32", rows) for name, shape in BLOCK.items()]
    layout = plan_layout(specs, world)
    if rank == 0:
        _print_plan(layout, rows)

    weights = FlatBuffer(layout, rank, torch.float32)
    weights.load_full_tensors(params)
    start = time.perf_counter()
    all_gather_flat(weights.alloc_full(), weights.shard)
    gather_ms = 1e3 * (time.perf_counter() - start)
    same = all(torch.equal(weights.full_view(n), p) for n, p in params.items())
    zero_copy = all(
        weights.full_view(n).untyped_storage().data_ptr() == weights.full.data_ptr() for n in params
    )

    grads = FlatBuffer(layout, rank, torch.float32)
    grads.alloc_full()
    grads.zero_full_padding()
    for name, p in params.items():  # rank r's gradient is (r + 1) * p
        grads.full_view(name).copy_((rank + 1) * p)  # what autograd writes into the views
    reduce_scatter_flat(grads.shard, grads.full, op="avg")
    mean_scale = (world + 1) / 2  # average of 1..W
    reduced_ok = all(
        torch.allclose(grads.shard_view(name), (mean_scale * params[name]).reshape(-1)[lo : lo + n])
        for name, _, lo, n in layout.local_pieces(rank)
    )
    weights.free_full()
    grads.free_full()
    report = torch.tensor(
        [same, zero_copy, reduced_ok, not weights.is_full_allocated], dtype=torch.int
    )
    dist.all_reduce(report, op=dist.ReduceOp.MIN)
    if rank == 0:
        checks = [
            "all-gather bitwise equal",
            "params are views of the buffer",
            "reduce-scatter average correct",
            "full buffer freed after reshard",
        ]
        for ok, what in zip(report.tolist(), checks, strict=True):
            print(f"  [{'ok' if ok else 'FAILED'}] {what}")
        print(f"  all-gather of {layout.buffer_numel} elements took {gather_ms:.2f} ms on rank 0")
    if not all(report.tolist()):
        raise SystemExit(1)


def _print_plan(layout, rows: int) -> None:
    print(f"Plan for one block, {rows}-row units: {layout.summary()}")
    print(f"  {'tensor':26s} {'shape':>10s} {'offset':>7s}  units per rank")
    for t in layout.tensors:
        shard = layout.shards[t.name]
        shape = "x".join(map(str, t.shape))
        print(f"  {t.name:26s} {shape:>10s} {layout.offsets[t.name]:7d}  {shard.units_per_rank}")
    for note in layout.notes:
        print(f"  note: {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16, help="rows per unit (e.g. 32 for 8-bit)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn_local(_worker, args.world_size, args.rows)


if __name__ == "__main__":
    main()
