"""Shampoo step: where its time goes on CPU, batched vs per-block eigendecompositions and block
products side by side, against this machine's eigh and matmul ceilings; optionally the step at
W = 1, 2, 4 (CPU, gloo).

The parameters are 4 layers of a small transformer (qkv 768x256, o 256x256, up 1024x256,
down 256x1024, a norm), so block sizes repeat: at B = 128 every block is 128x128 (384
eigendecompositions per root step, 192 blocks); at B = 1024 the 768-, 256- and 1024-sided
factors repeat across layers.

Part 1 (one process, one thread), per root frequency (``--frequencies``: 1, every step, is
eigh-bound; 100, DistributedShampoo's default, times the steps between roots): ``Shampoo()``
(batched eigh on CPU), ``batch_roots=False`` (everything per block), ``batch_blocks=True``
(equal-size blocks' products as one ``bmm`` per group) and ``SOAP`` for scale step on the same
gradients, alternating, after the first roots; medians and ratios to the per-block step. Beside
them, the step's block products alone (one ``mm`` each on contiguous blocks: the matmul floor of
a step without roots) and its GFLOP/s; the share of the step inside ``torch.linalg.eigh``;
nominal GFLOP/s (eigh counted 9n³, the textbook cost of a symmetric eigendecomposition with
vectors; matmuls 2mnk) against two ceilings measured in the same run: one eigh of each block
size alone and a 1024³ fp32 matmul.

Part 2 (``--worlds``): the step at each world size with ``Shampoo.shard_policy(B)`` (every block
whole on one rank, 0 bytes moved), roots every step; on a 2-core machine W = 4 oversubscribes
the cores.

DistributedShampoo's own step is not measured: it is not on PyPI (installed from its
repository, which this machine cannot reach) and needs Python >= 3.12.

    python benchmarks/shampoo_step.py [--blocks 128 1024] [--frequencies 1 100] [--repeats 5]
        [--worlds 1 2 4] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from measure import init_gloo

LAYER = (
    ("qkv", (768, 256)),
    ("o", (256, 256)),
    ("up", (1024, 256)),
    ("down", (256, 1024)),
    ("norm", (256,)),
)
LAYERS = 4  # the figures' model; --layers 1 only smoke-tests the script
SHAPES: dict[str, tuple[int, ...]] = {}


def use_layers(layers: int) -> None:
    """Set ``SHAPES`` to ``layers`` layers (the figures: 4; fewer only to smoke-test the script
    quickly). Every rank calls it too, as spawned ranks import this module afresh."""
    SHAPES.clear()
    SHAPES.update({f"l{i}.{name}": shape for i in range(layers) for name, shape in LAYER})


use_layers(LAYERS)
EIGH_FLOPS = 9  # × n³ per symmetric eigendecomposition with eigenvectors (nominal)


def _blocks(block: int) -> list[tuple[int, int]]:
    """Every block's (rows, cols) of the preconditioned parameters."""
    out = []
    for shape in SHAPES.values():
        if len(shape) < 2:
            continue
        rows, cols = shape
        for r0 in range(0, rows, block):
            for c0 in range(0, cols, block):
                out.append((min(block, rows - r0), min(block, cols - c0)))
    return out


def _nominal_flops(block: int) -> float:
    """One Shampoo step with roots: factors, eigh + root per side, preconditioning."""
    total = 0.0
    for r, c in _blocks(block):
        total += 2 * (2 * r * r * c + 2 * r * c * c)  # G Gᵀ, Gᵀ G; L⁻ᵖ F R⁻ᵖ
        total += (EIGH_FLOPS + 2) * (r**3 + c**3)  # eigh and Q diag Qᵀ per side
    return total


def _eigh_flops(block: int) -> float:
    return sum(EIGH_FLOPS * (r**3 + c**3) for r, c in _blocks(block))


def _ceilings(block: int) -> dict[str, float]:
    """GFLOP/s of one eigh per block side (alone) and of a 1024³ fp32 matmul."""
    gen = torch.Generator().manual_seed(0)

    def best(fn: Callable[[], object], repeats: int = 3) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    sides = sorted({n for rc in _blocks(block) for n in rc})
    out = {}
    for n in sides:
        x = torch.randn(n, n + 8, generator=gen)
        a = x @ x.T
        out[f"eigh_{n}"] = EIGH_FLOPS * n**3 / best(lambda a=a: torch.linalg.eigh(a)) / 1e9
    a, b = torch.randn(1024, 1024, generator=gen), torch.randn(1024, 1024, generator=gen)
    out["matmul_1024"] = 2 * 1024**3 / best(lambda: a @ b) / 1e9
    return out


def _params(block: int, rank: int, world: int) -> dict[str, torch.nn.Parameter]:
    """Plain parameters (W = 1) or RaggedTensors on a planned flat shard (W > 1)."""
    from raggedfsdp.optim import Shampoo
    from raggedfsdp.sharding import FlatBuffer, RaggedTensor, TensorSpec, plan_layout

    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    if world == 1:
        return {n: torch.nn.Parameter(t) for n, t in init.items()}
    policy = Shampoo.shard_policy(max_preconditioner_dim=block)
    specs = [TensorSpec(n, s, "float32", max(1, policy(n, init[n]))) for n, s in SHAPES.items()]
    layout = plan_layout(specs, world)
    flat = FlatBuffer(layout, rank, torch.float32)
    flat.load_full_tensors(init)
    return {
        n: torch.nn.Parameter(RaggedTensor(flat.shard_view(n), layout.shards[n], rank))
        for n in SHAPES
    }


def _set_grads(params: dict[str, torch.nn.Parameter], step: int) -> None:
    from raggedfsdp.sharding import RaggedTensor

    gen = torch.Generator().manual_seed(step)
    for n, p in params.items():
        g = torch.randn(SHAPES[n], generator=gen)
        if isinstance(p, RaggedTensor):
            lo, hi = p.local_range
            p.grad = RaggedTensor(g.reshape(-1)[lo:hi].contiguous(), p.ragged_shard, p.rank)
        else:
            p.grad = g


class _EighTimer:
    """Seconds spent inside ``torch.linalg.eigh`` while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._eigh = torch.linalg.eigh

    def __enter__(self) -> _EighTimer:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self._eigh(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        torch.linalg.eigh = timed
        return self

    def __exit__(self, *exc: object) -> None:
        torch.linalg.eigh = self._eigh


def _product_flops(block: int) -> float:
    """The step's block products: G Gᵀ, Gᵀ G and L⁻ᵖ F R⁻ᵖ per block (2mnk each)."""
    return sum(2 * (2 * r * r * c + 2 * r * c * c) for r, c in _blocks(block))


def _products_floor(block: int) -> Callable[[], None]:
    """The step's block products alone, one ``mm`` each on contiguous blocks: the time the
    blocked part of a step without roots cannot go below at this machine's matmul rate."""
    gen = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(r, c, generator=gen), torch.randn(r, r, generator=gen),
         torch.randn(c, c, generator=gen))
        for r, c in _blocks(block)
    ]  # fmt: skip

    def run() -> None:
        for g, left, right in data:
            _ = g @ g.T, g.T @ g, (left @ g) @ right

    return run


def side_by_side(block: int, repeats: int, freq: int) -> dict:
    """Part 1: Shampoo's default (batched eigh), everything per block, and batched block
    products (``batch_blocks=True``), with SOAP for scale, roots every ``freq`` steps; in one
    process, alternating, over the steps after the first roots (with ``freq`` > 1, steps
    without roots, as most steps are), beside the block products alone (``floor``)."""
    from raggedfsdp.optim import SOAP, Shampoo

    common = {"max_preconditioner_dim": block, "epsilon": 1e-6, "precondition_frequency": freq}
    runs = {
        "batched": lambda p: Shampoo(p, **common),
        "per_block": lambda p: Shampoo(p, **common, batch_roots=False),
        "batch_blocks": lambda p: Shampoo(p, **common, batch_blocks=True),
        "soap": lambda p: SOAP(p, max_preconditioner_dim=block, precondition_frequency=freq),
    }
    opts, params = {}, {}
    for name, make in runs.items():
        params[name] = _params(block, 0, 1)
        opts[name] = make(list(params[name].items()))
        for step in range(freq + 1):  # state, first roots / bases at the start step
            _set_grads(params[name], step)
            opts[name].step()
    floor = _products_floor(block)
    times = {name: [] for name in [*runs, "floor"]}
    shares = {name: [] for name in runs}
    for rep in range(repeats):
        for name in runs:
            _set_grads(params[name], freq + 1 + rep)
            with _EighTimer() as timer:
                start = time.perf_counter()
                opts[name].step()
                elapsed = time.perf_counter() - start
            times[name].append(elapsed)
            shares[name].append(timer.seconds / elapsed)
        start = time.perf_counter()
        floor()
        times["floor"].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    stats = opts["batched"].last_step_stats
    eigh_s = med["batched"] * statistics.median(shares["batched"])
    return {
        "step_ms": {name: 1e3 * t for name, t in med.items()},
        "eigh_share": {name: statistics.median(s) for name, s in shares.items()},
        "over_per_block": {n: med[n] / med["per_block"] for n in ("batched", "batch_blocks")},
        "floor_share": med["floor"] / med["per_block"],
        "products_gflops": _product_flops(block) / med["floor"] / 1e9,
        "eigendecompositions": stats["eigendecompositions"],
        "eigh_batched": stats["eigh_batched"],
        "gflops": (_nominal_flops(block) if freq == 1 else _product_flops(block))
        / med["batched"]
        / 1e9,
        "eigh_gflops": _eigh_flops(block) / eigh_s / 1e9 if eigh_s else 0.0,
        "ceilings_gflops": _ceilings(block),
    }


def _world_worker(
    rank: int, world: int, port: int, blocks: list[int], steps: int, layers: int, out
) -> None:
    from raggedfsdp.optim import Shampoo

    use_layers(layers)
    init_gloo(rank, world, port, threads=1)
    results = {}
    for block in blocks:
        params = _params(block, rank, world)
        opt = Shampoo(list(params.items()), max_preconditioner_dim=block, epsilon=1e-6)
        times = []
        for step in range(steps):
            _set_grads(params, step)
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            dist.barrier()
            if step:
                times.append(time.perf_counter() - start)
        stats = opt.last_step_stats
        results[block] = {
            "step_ms": 1e3 * statistics.median(times),
            "eigh_rank0": stats["eigendecompositions"],
            "bytes": stats["bytes_communicated"],
        }
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def world_sizes(worlds: list[int], blocks: list[int], steps: int, layers: int = LAYERS) -> dict:
    """Part 2: the step at each world size (one process per rank, one thread each)."""
    from measure import rank_context, start_ranks

    from raggedfsdp.comm.launch import serving_store

    rows = {}
    for world in worlds:
        out = rank_context().Queue()
        with serving_store() as port:
            start_ranks(_world_worker, (world, port, blocks, steps, layers, out), world)
        rows[world] = out.get()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--frequencies", type=int, nargs="+", default=[1, 100])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worlds", type=int, nargs="*", default=[])
    parser.add_argument("--steps", type=int, default=4, help="steps per world size (part 2)")
    parser.add_argument(
        "--layers", type=int, default=LAYERS, help="model layers (fewer: a quick smoke run)"
    )
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers {args.layers} must be >= 1")
    use_layers(args.layers)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    part1 = {
        f"freq{freq}_B{block}": side_by_side(block, args.repeats, freq)
        for freq in args.frequencies
        for block in args.blocks
    }
    part2 = world_sizes(args.worlds, args.blocks, args.steps, args.layers) if args.worlds else {}
    print(json.dumps({"benchmark": "shampoo_step", "side_by_side": part1, "worlds": part2}))
    print(
        f"{'case':>12} {'batched ms':>11} {'per-block ms':>13} {'ratio':>6} "
        f"{'batch_blocks':>13} {'ratio':>6} {'SOAP ms':>8} {'eigh share':>11} "
        f"{'products ms':>12} {'share':>6} {'GFLOP/s':>8}  ceilings GFLOP/s"
    )
    for case, r in part1.items():
        ms, over = r["step_ms"], r["over_per_block"]
        ceilings = ", ".join(f"{k} {v:.1f}" for k, v in r["ceilings_gflops"].items())
        print(
            f"{case:>12} {ms['batched']:11.1f} {ms['per_block']:13.1f} {over['batched']:6.2f} "
            f"{ms['batch_blocks']:13.1f} {over['batch_blocks']:6.2f} {ms['soap']:8.1f} "
            f"{r['eigh_share']['per_block']:11.2f} {ms['floor']:12.1f} "
            f"{r['floor_share']:6.2f} {r['products_gflops']:8.1f}  {ceilings}"
        )
    for world, per_block in part2.items():
        for block, r in per_block.items():
            print(
                f"W={world} B={block}: {r['step_ms']:.1f} ms, {r['eigh_rank0']} eighs on "
                f"rank 0, {r['bytes']} bytes"
            )


if __name__ == "__main__":
    main()
