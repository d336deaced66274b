"""Optimizer step time and drop-in memory, against torch.optim.AdamW and torchao's AdamW8bit.

Step time (one process, ~50M parameters shaped like a 6-layer d=768 transformer): each round
times one step of every variant in turn (A B C ... B C A ..., the order rotating so no variant
always runs first), over the same gradients, and the report is the ratio of median step times
to ``torch.optim.AdamW(foreach=True)`` and ``(fused=True)``. Two phases, run apart:

* AdamW: torch's two, ours in single-process mode (the same per-parameter tensors), ours over
  RaggedTensor parameters that are views of one flat buffer (FSDP mode at W=1: the update runs
  on whole runs);
* 8-bit: torch's fused fp32 step (the speed to match), torchao's ``AdamW8bit`` (compiled, as it
  always is), and ours on the flat buffer, fused (compiled) and eager (the op-by-op reference),
  with ratios to torchao and to our eager step too.

Each variant's bytes per step (what it must read and write: parameter, gradient and state; 28 B
per element for fp32 AdamW, 16 B plus the block scales for 8-bit) over its median time give its
GB/s, shown against two ceilings measured in the same run on 256 MB tensors: a copy
(``dst.copy_(src)``) and an in-place update (``x.mul_(1)``, read + write: what an optimizer step
does; the higher of the two, so the percentage is the distance to the fastest streaming seen).

Memory (W=2 gloo processes on 127.0.0.1): peak resident memory per rank of plain DDP +
``torch.optim.AdamW`` against the same model trained with ``raggedfsdp.optim.AdamW`` in drop-in
mode (ZeRO-2). Processes start with ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_ARENA_MAX=1
MALLOC_TRIM_THRESHOLD_=65536`` so freed tensors leave RSS; "resident" is RSS after two warm-up
steps above the RSS before the model existed, "peak" the high-water mark during three more steps
(reset through /proc/self/clear_refs) above the same base.

    .venv/bin/python benchmarks/optim_step.py            # table + one JSON line
    .venv/bin/python benchmarks/optim_step.py --rounds 5 --skip-memory --threads 1
    .venv/bin/python benchmarks/optim_step.py --skip-memory --phases 8-bit --rounds 3  # quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from measure import init_gloo, rank_context

from raggedfsdp.comm.launch import serving_store
from raggedfsdp.optim import AdamW, AdamW8bit
from raggedfsdp.sharding import FlatBuffer, RaggedTensor, TensorSpec, plan_layout

#: Bytes a step must move per element: fp32 AdamW reads the parameter, gradient and two moments
#: and writes back the parameter and moments; 8-bit AdamW does the same with 1-byte codes, plus
#: one fp32 scale per 256-element block and moment, read and written.
ADAMW_BYTES = 4 * 3 + 4 * 2 * 2
ADAMW8BIT_BYTES = 4 * 3 + 1 * 2 * 2 + 4 * 2 * 2 / 256


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


def _step_bytes(shapes: dict[str, tuple[int, ...]], eight_bit: bool) -> float:
    """Bytes one step must read and write (tensors below 4096 elements keep fp32 state)."""
    total = 0.0
    for shape in shapes.values():
        n = torch.Size(shape).numel()
        total += n * (ADAMW8BIT_BYTES if eight_bit and n >= 4096 else ADAMW_BYTES)
    return total


def bandwidth_ceilings(numel: int = 1 << 26, repeats: int = 5) -> dict[str, float]:
    """GB/s of a copy and of an in-place update of 256 MB fp32 tensors (bytes read + written),
    medians of ``repeats``; both tensors are touched first so no page fault is timed."""
    src, dst = torch.ones(numel), torch.zeros(numel)

    def median_s(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    moved = 8 * numel
    return {
        "copy_gbs": moved / median_s(lambda: dst.copy_(src)) / 1e9,
        "in_place_gbs": moved / median_s(lambda: src.mul_(1.0)) / 1e9,
    }


def _makers(shapes, phase: str) -> dict[str, tuple[Callable[[], list], Callable]]:
    """The variants of one phase: how to make their parameters and their optimizer."""
    makers: dict[str, tuple[Callable[[], list], Callable[[list], torch.optim.Optimizer]]] = {
        "torch foreach": (lambda: _plain(shapes), lambda ps: torch.optim.AdamW(ps, foreach=True)),
        "torch fused": (lambda: _plain(shapes), lambda ps: torch.optim.AdamW(ps, fused=True)),
    }
    if phase == "8-bit":
        try:
            from torchao.optim import AdamW8bit as TorchaoAdamW8bit
        except ImportError:  # reported as a missing row
            TorchaoAdamW8bit = None
        if TorchaoAdamW8bit is not None:
            makers["torchao 8-bit (compiled)"] = (
                lambda: _plain(shapes),
                lambda ps: TorchaoAdamW8bit(ps, block_size=256),
            )
        flat8 = AdamW8bit.shard_policy()
        makers["ours 8-bit fused"] = (
            lambda: _flat(shapes, flat8),
            lambda ps: AdamW8bit(ps, fused=True),
        )
        makers["ours 8-bit eager"] = (
            lambda: _flat(shapes, flat8),
            lambda ps: AdamW8bit(ps, fused=False),
        )
    else:
        flat = AdamW.shard_policy()
        makers |= {
            "ours single foreach": (lambda: _plain(shapes), lambda ps: AdamW(ps, foreach=True)),
            "ours flat foreach": (lambda: _flat(shapes, flat), lambda ps: AdamW(ps, foreach=True)),
            "ours flat fused": (lambda: _flat(shapes, flat), lambda ps: AdamW(ps, fused=True)),
        }
    return makers


def time_steps(rounds: int, phase: str) -> dict[str, dict[str, float]]:
    """Median wall and CPU time (this process, all threads) of one step of each variant, timed
    in rotating rounds, and the GB/s its bytes make at the median CPU time. CPU time is the
    figure to trust on a shared machine: it leaves out the time spent waiting for a core. The
    8-bit phase runs apart from the AdamW phase: its large temporaries churn the allocator and
    would slow whichever variant runs next. The first round warms up (state allocation and the
    compiled variants' compilation) and is not counted."""
    shapes = model_shapes()
    makers = _makers(shapes, phase)
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
    out = {}
    for name in variants:
        moved = _step_bytes(shapes, eight_bit="8-bit" in name)
        med_cpu = statistics.median(cpu[name])
        out[name] = {
            "wall": statistics.median(wall[name]),
            "cpu": med_cpu,
            "gbs": moved / med_cpu / 1e9,
        }
    return out


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
    init_gloo(rank, world, port, threads=1)
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
    ctx = rank_context()  # MALLOC_ENV set first: glibc reads it when the ranks' server starts
    out = ctx.Queue()
    with serving_store() as port:
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


def _ratios(med: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """CPU-time ratio of every variant to each baseline present in its phase."""
    bases = ("torch foreach", "torch fused", "torchao 8-bit (compiled)", "ours 8-bit eager")
    return {
        k: {f"vs {b}": v["cpu"] / med[b]["cpu"] for b in bases if b in med} for k, v in med.items()
    }


def _print_steps(phases, ratios, ceilings, numel: int, rounds: int) -> None:
    best = max(ceilings.values())
    print(
        f"step time, {numel / 1e6:.1f}M parameters, {rounds} rounds (median, CPU time); "
        f"ceilings: copy {ceilings['copy_gbs']:.1f} GB/s, in-place {ceilings['in_place_gbs']:.1f}"
        " GB/s"
    )
    print(
        "| phase | variant | cpu ms | wall ms | GB/s | % of ceiling | vs torch fused "
        "| vs torchao compiled | vs ours eager |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for phase, med in phases.items():
        for k, v in med.items():
            r = ratios[phase][k]
            cols = [
                f"{r[b]:.2f}" if b in r else "–"
                for b in ("vs torch fused", "vs torchao 8-bit (compiled)", "vs ours 8-bit eager")
            ]
            print(
                f"| {phase} | {k} | {1e3 * v['cpu']:.1f} | {1e3 * v['wall']:.1f} | "
                f"{v['gbs']:.1f} | {100 * v['gbs'] / best:.0f} | " + " | ".join(cols) + " |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--phases", nargs="+", default=["adamw", "8-bit"])
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
    ceilings = bandwidth_ceilings()
    phases = {phase: time_steps(args.rounds, phase) for phase in args.phases}
    ratios = {phase: _ratios(med) for phase, med in phases.items()}
    report: dict[str, object] = {
        "params": numel,
        "threads": torch.get_num_threads(),
        "ceilings": ceilings,
        "median_step_s": phases,
        "ratios": ratios,
    }
    _print_steps(phases, ratios, ceilings, numel, args.rounds)
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
