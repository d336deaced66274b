"""Optimizer step time and drop-in memory, against torch.optim.AdamW.

Step time (one process, ~50M parameters shaped like a 6-layer d=768 transformer): each round
times one step of every variant in turn (A B C ... B C A ..., the order rotating so no variant
always runs first), over the same gradients, and the
report is the ratio of median step times to ``torch.optim.AdamW(foreach=True)`` and
``(fused=True)``. Variants: torch's two, ours in single-process mode (the same per-parameter
tensors), ours over RaggedTensor parameters that are views of one flat buffer (FSDP mode at W=1:
the update runs on whole runs), and ``AdamW8bit`` on the flat buffer.

Memory (W=2 gloo processes on 127.0.0.1): peak resident memory per rank of plain DDP +
``torch.optim.AdamW`` against the same model trained with ``raggedfsdp.optim.AdamW`` in drop-in
mode (ZeRO-2). Processes start with ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_ARENA_MAX=1
MALLOC_TRIM_THRESHOLD_=65536`` so freed tensors leave RSS; "resident" is RSS after two warm-up
steps above the RSS before the model existed, "peak" the high-water mark during three more steps
(reset through /proc/self/clear_refs) above the same base.

    .venv/bin/python benchmarks/optim_step.py            # table + one JSON line
    .venv/bin/python benchmarks/optim_step.py --rounds 5 --skip-memory --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raggedfsdp.optim import AdamW, AdamW8bit
from raggedfsdp.sharding import FlatBuffer, RaggedTensor, TensorSpec, plan_layout

MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_TRIM_THRESHOLD_": "65536",
}


def model_shapes(layers: int = 6, d: int = 768, vocab: int = 8192) -> dict[str, tuple[int, ...]]:
    """~49M parameters: embedding, attention and MLP matrices, norms (a small LLaMA-ish stack)."""
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d)}
    for i in range(layers):
        shapes |= {
            f"l{i}.attn_norm": (d,),
            f"l{i}.wq": (d, d),
            f"l{i}.wk": (d, d),
            f"l{i}.wv": (d, d),
            f"l{i}.wo": (d, d),
            f"l{i}.mlp_norm": (d,),
            f"l{i}.w1": (4 * d, d),
            f"l{i}.w2": (d, 4 * d),
        }
    return shapes | {"norm": (d,)}


# ----------------------------------------------------------------------------- step time
def _plain(shapes, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes.values()]


def _flat(shapes, policy) -> list[torch.nn.Parameter]:
    """RaggedTensor parameters at W=1: views of one planned flat buffer, as fully_shard makes."""
    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    specs = [TensorSpec(n, s, "float32", max(1, policy(n, init[n]))) for n, s in shapes.items()]
    layout = plan_layout(specs, 1)
    buf = FlatBuffer(layout, 0, torch.float32)
    buf.load_full_tensors(init)
    grads = FlatBuffer(layout, 0, torch.float32)
    params = []
    for n in shapes:
        p = torch.nn.Parameter(RaggedTensor(buf.shard_view(n), layout.shards[n], 0))
        p.grad = RaggedTensor(grads.shard_view(n), layout.shards[n], 0)
        params.append(p)
    return params


def _fill_grads(params, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        g = p.grad.local if isinstance(p.grad, RaggedTensor) else None
        target = g if g is not None else p.grad
        if target is None:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        else:
            target.copy_(torch.randn(target.shape, generator=gen) * 1e-3)


def time_steps(rounds: int, with_8bit: bool) -> dict[str, dict[str, float]]:
    """Median wall and CPU time (this process, all threads) of one step of each variant, timed
    in rotating rounds. CPU time is the figure to trust on a shared machine: it leaves out the
    time spent waiting for a core. The 8-bit phase runs apart from the AdamW phase: its large
    temporaries churn the allocator and would slow whichever variant runs next."""
    shapes = model_shapes()
    makers: dict[str, tuple[Callable[[], list], Callable[[list], torch.optim.Optimizer]]] = {
        "torch foreach": (lambda: _plain(shapes), lambda ps: torch.optim.AdamW(ps, foreach=True)),
        "torch fused": (lambda: _plain(shapes), lambda ps: torch.optim.AdamW(ps, fused=True)),
    }
    if with_8bit:
        makers["ours 8-bit flat"] = (
            lambda: _flat(shapes, AdamW8bit.shard_policy()),
            lambda ps: AdamW8bit(ps),
        )
    else:
        flat = AdamW.shard_policy()
        makers |= {
            "ours single foreach": (lambda: _plain(shapes), lambda ps: AdamW(ps, foreach=True)),
            "ours flat foreach": (lambda: _flat(shapes, flat), lambda ps: AdamW(ps, foreach=True)),
            "ours flat fused": (lambda: _flat(shapes, flat), lambda ps: AdamW(ps, fused=True)),
        }
    variants = {}
    for name, (make_params, make_opt) in makers.items():
        params = make_params()
        _fill_grads(params, 1)
        variants[name] = make_opt(params)
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds + 1):  # the first round warms up (state allocation)
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate: no slot bias
            start, start_cpu = time.perf_counter(), time.process_time()
            variants[name].step()
            if r:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    return {
        name: {"wall": statistics.median(wall[name]), "cpu": statistics.median(cpu[name])}
        for name in variants
    }


# ----------------------------------------------------------------------------- memory
def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class _Stack(torch.nn.Module):
    """The benchmark's tensors as a module whose loss touches every weight (for DDP's hooks)
    with negligible activations: the memory is parameters, gradients and optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(s) * 0.02) for s in model_shapes().values()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(w.sum() for w in self.weights) * x.sum()


def _memory_worker(rank: int, world: int, port: int, variant: str, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    base = _rss_kb("VmRSS")
    torch.manual_seed(0)
    model = _Stack()
    if variant == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
    else:
        opt = AdamW(model.parameters(), foreach=True)
    x = torch.full((4,), 0.25 * (rank + 1))

    def step() -> None:
        model(x).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    resident = _rss_kb("VmRSS") - base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    for _ in range(3):
        step()
    elapsed = (time.perf_counter() - start) / 3
    peak = _rss_kb("VmHWM") - base
    out.put((rank, resident / 1024, peak / 1024, elapsed))
    dist.barrier()  # leave together: gloo may abort a rank that tears down while a peer runs
    dist.destroy_process_group()


def measure_memory(variant: str, world: int = 2) -> dict[str, float]:
    for k, v in MALLOC_ENV.items():
        os.environ[k] = v  # inherited by the spawned ranks (read by glibc at start-up)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_memory_worker, args=(r, world, port, variant, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return {
        "resident_mb": max(r[1] for r in results),
        "peak_mb": max(r[2] for r in results),
        "step_s": max(r[3] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads for the step-time part (0: torch's default); 1 keeps OpenMP "
        "barriers out of the comparison on a shared machine",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    numel = sum(torch.Size(s).numel() for s in model_shapes().values())
    phases = {"adamw": time_steps(args.rounds, False), "8-bit": time_steps(args.rounds, True)}
    ratios = {
        phase: {
            k: {
                f"{clock}_vs_torch_{base}": v[clock] / med[f"torch {base}"][clock]
                for clock in ("cpu", "wall")
                for base in ("foreach", "fused")
            }
            for k, v in med.items()
        }
        for phase, med in phases.items()
    }
    report: dict[str, object] = {
        "params": numel,
        "threads": torch.get_num_threads(),
        "median_step_s": phases,
        "ratios": ratios,
    }
    print(f"step time, {numel / 1e6:.1f}M parameters, {args.rounds} rounds (median)")
    print("| phase | variant | cpu ms | wall ms | cpu vs torch foreach | cpu vs torch fused |")
    print("|---|---|---:|---:|---:|---:|")
    for phase, med in phases.items():
        for k, v in med.items():
            r = ratios[phase][k]
            print(
                f"| {phase} | {k} | {1e3 * v['cpu']:.1f} | {1e3 * v['wall']:.1f} | "
                f"{r['cpu_vs_torch_foreach']:.2f} | {r['cpu_vs_torch_fused']:.2f} |"
            )
    if not args.skip_memory:
        mem = {v: measure_memory(v) for v in ("ddp", "dropin")}
        report["memory_w2"] = mem
        report["peak_ratio_dropin_vs_ddp"] = mem["dropin"]["peak_mb"] / mem["ddp"]["peak_mb"]
        print("\nmemory per rank at W=2 (MB above the empty process)")
        print("| variant | resident after warm-up | peak during steps | step s |")
        print("|---|---:|---:|---:|")
        for k, m in mem.items():
            print(f"| {k} | {m['resident_mb']:.0f} | {m['peak_mb']:.0f} | {m['step_s']:.2f} |")
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
