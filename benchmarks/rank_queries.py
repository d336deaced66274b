"""Per-rank queries and set-up at 1,000 to 100,000 ranks, without a process group.

Everything a rank computes about the other ranks (where each one's piece starts, how long it
is, who owns which matrix, which blocks each holds) must cost O(W) per tensor at most, or a
100,000-rank job spends its first minutes in bookkeeping. Each case is built for one rank
(``W // 3``) of a W-rank layout of tiny tensors (every rank holds about 160 elements), so
only the bookkeeping is timed:

* ``spec.lengths``: every rank's piece length of one ``RaggedShard``;
* ``full state dict``: ``get_model_state_dict(full_state_dict=True)``'s gathers of 8 tensors
  (the collectives replaced by no-ops: the bookkeeping and buffers are timed, not the network);
* ``Muon set-up``: the optimizer and its owner plan (``assign_owners`` + ``ExchangePlan``,
  with the exchange's assembly index) for 8 matrices and a stacked expert tensor;
* ``AdamW8bit set-up``: the optimizer, whose state holds each parameter's block grid;
* ``Shampoo set-up``: the optimizer (slab geometry and factor splits of every parameter);
* ``Shampoo cut-slab exchange``: the exchange plan of the slabs an element-wise layout cuts
  (one owner-compute job per slab; ``n/a`` where the checkout has no ``Job.spanning``).

Each case runs in its own process under ``--timeout`` seconds. It also runs against an older
checkout (``PYTHONPATH=/path/to/checkout``) for before/after figures; cases that checkout
cannot express print ``n/a``.

    .venv/bin/python benchmarks/rank_queries.py [--worlds 1000 10000 100000] [--timeout 120]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist

from raggedfsdp.sharding import RaggedShard, RaggedTensor, TensorSpec, plan_layout

WORLDS = [1_000, 10_000, 100_000]


def _params(world: int, rows_per_unit: int = 1) -> list[tuple[str, torch.nn.Parameter]]:
    """Rank ``world // 3``'s pieces of 8 matrices of ``world // 4`` rows and one stacked
    ``(8, world // 16, 64)`` expert tensor, planned into one flat buffer."""
    shapes = {f"w{i}": (world // 4, 64) for i in range(8)} | {"experts": (8, world // 16, 64)}
    layout = plan_layout(
        [TensorSpec.rows(n, s, "float32", rows_per_unit) for n, s in shapes.items()], world
    )
    rank = world // 3
    out = []
    for name in shapes:
        spec = layout.shards[name]
        local = torch.zeros(spec.length(rank))
        out.append((name, torch.nn.Parameter(RaggedTensor(local, spec, rank))))
    return out


def spec_lengths(world: int) -> None:
    RaggedShard.even((16 * world,), world, 1).lengths  # noqa: B018


def full_state_dict(world: int) -> None:
    from raggedfsdp.state_dict import _gathered

    state = {name: p.detach() for name, p in _params(world)[:8]}
    with (
        mock.patch.object(dist, "all_gather_single", lambda *a, **k: None),
        mock.patch.object(dist, "all_reduce", lambda *a, **k: None),
    ):
        _gathered(state, cpu_offload=False)


def muon_setup(world: int) -> None:
    from raggedfsdp.optim import Muon
    from raggedfsdp.optim import muon as muon_module

    opt = Muon(_params(world))
    pieces = [opt._pieces[p] for p in opt.param_groups[0]["params"]]
    plan = muon_module._plan(pieces, 5)
    plan.exchange.assemble(torch.empty(sum(plan.exchange.recv_splits)))


def adamw8bit_setup(world: int) -> None:
    from raggedfsdp.optim import AdamW8bit

    AdamW8bit(_params(world, rows_per_unit=4), block_size=256, min_8bit_size=1)


def shampoo_setup(world: int) -> None:
    """The optimizer: every parameter's slab geometry and factor splits."""
    from raggedfsdp.optim import Shampoo

    Shampoo(_params(world), max_preconditioner_dim=32)


def shampoo_exchange(world: int) -> None:
    """The exchange plan of the slabs the element-wise layout cuts, built as Shampoo builds it:
    one ``Job.spanning`` per cut slab, owned by the holder of its first element."""
    from raggedfsdp.optim.owner_compute import ExchangePlan
    from raggedfsdp.sharding.blocks import ShampooBlocks
    from raggedfsdp.sharding.owners import Job

    params = _params(world)
    jobs, owners = [], []
    for _, p in params:
        spec, blocks = p.ragged_shard, ShampooBlocks.of(p.shape, 32)
        slab_owners = blocks.slab_owners(spec.bounds)
        for i in range(blocks.num_slabs):
            job = Job.spanning(*blocks.slab_range(i), spec.bounds, 1.0)
            if job.sole_holder is None:
                jobs.append(job)
                owners.append(slab_owners[i])
    rank = params[0][1].rank
    plan = ExchangePlan(jobs, owners, rank, world)
    plan.assemble(torch.empty(sum(plan.recv_splits)))


CASES: dict[str, Callable[[int], None]] = {
    "spec.lengths": spec_lengths,
    "full state dict": full_state_dict,
    "Muon set-up": muon_setup,
    "AdamW8bit set-up": adamw8bit_setup,
    "Shampoo set-up": shampoo_setup,
    "Shampoo cut-slab exchange": shampoo_exchange,
}


def run_case(name: str, world: int) -> float:
    """Seconds for one case, after a warm-up at a small W (imports and first calls)."""
    CASES[name](64)
    t0 = time.perf_counter()
    CASES[name](world)
    return time.perf_counter() - t0


def measure(name: str, world: int, timeout: float) -> str:
    """One case in a fresh process: its time, ``> timeout``, or ``n/a``."""
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--case", name, "--world", str(world)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"> {timeout:.0f} s"
    if out.returncode:
        return "n/a"
    return f"{float(out.stdout.strip().splitlines()[-1]):.3f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=WORLDS)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(run_case(args.case, args.world))
        return
    print("| case | " + " | ".join(f"W={w:,}" for w in args.worlds) + " |")
    print("|---|" + "---:|" * len(args.worlds))
    rows = {}
    for name in CASES:
        rows[name] = [measure(name, w, args.timeout) for w in args.worlds]
        print(f"| {name} | " + " | ".join(rows[name]) + " |", flush=True)
    print(json.dumps({"worlds": args.worlds, "seconds": rows}))


if __name__ == "__main__":
    main()
