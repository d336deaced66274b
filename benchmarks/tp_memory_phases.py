"""Where a training step's memory peaks under tensor parallelism: ``memory_phases.py``'s rows
for ``tp_vs_fsdp2.py``'s model (the recipe's Llama at (dp x tp), built by the recipe) on
raggedfsdp.fully_shard x TP, FSDP2 x TP, or the TP-only floor (``floor``: the same TP plan with
no FSDP, every TP-local parameter and gradient allocated beforehand: the activations and
temporaries that every FSDP holds on top of its own buffers).

    python benchmarks/tp_memory_phases.py {ours,fsdp2,floor} [tp_vs_fsdp2.py's flags]

One row per hook of the step (forward pre/post and backward pre/post of the embedding, each
block, the final norm and the head; then the loss, the end of backward, the optimizer step and
``zero_grad``): the resident memory above the post-warm-up level at that moment, and the highest
level since the previous row (VmHWM, reset at every row; ranks started with ``measure.py``'s
``MALLOC_*`` so that freed tensors leave the resident set). ``<==`` marks the step's summit.
The rank with the highest summit is printed (its TP ranks hold the same shapes). Then the
step's transient peak measured as ``tp_vs_fsdp2.py`` does, the profiler's allocator peak (the
view a GPU has), and for the floor the *bound*: each row's peak plus the TP-local bytes of the
group an FSDP wrapped as the recipe is must have gathered there (torchtitan's wrapping: the
embedding alone, each block, ``[norm, output]``; the embedding's backward reads no weight).

    python benchmarks/tp_memory_phases.py static [tp_vs_fsdp2.py's flags]

``static``: where each runtime's memory between steps comes from, both in one process (after
``tp_vs_fsdp2.py``'s warm-up, ours built first): the resident set's growth since the system's
start after its build (materialized blocks, TP plan, ``fully_shard``: the recipe's
``build_model``), the optimizer's creation, the first step and the second, each read with
glibc's free heap pages returned (``measure.trimmed_rss_kib``); its tensor bytes
(``tensor_bytes``) and the part in storages under ``MALLOC_ENV``'s mmap threshold (kept in
glibc's heap); and what deleting it drops the resident set by, read as is and trimmed. Freed
heap pages stay resident until trimmed, so an untrimmed reading misses a system's small tensors
and Python objects: FSDP2 keeps ~0.8 MiB of small per-parameter tensors in the heap here, ours
(flat buffers) next to none, which made ours look 1.07x FSDP2's in ``tp_vs_fsdp2.py``.
"""

from __future__ import annotations

import argparse
import gc
import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from fsdp_vs_fsdp2 import PhaseRecorder
from measure import (
    MALLOC_ENV,
    init_gloo,
    peak_above_now,
    peak_allocated,
    spawn_ranks,
    status_kib,
    trimmed_rss_kib,
)
from moe_vs_fsdp2 import storage_bytes
from torch import nn
from tp_vs_fsdp2 import _step, _warm_up, build, build_sharded, config, make_optimizer, parse_args

from recipes.llama.moe import model_class
from recipes.llama.parallel import make_env
from recipes.llama.tensor_parallel import apply_tp_to_block, apply_tp_to_root
from recipes.llama.train import loss_fn

SYSTEMS = ("ours", "fsdp2", "floor", "static")
STATIC_SYSTEMS = ("ours", "fsdp2")
MMAP_THRESHOLD = int(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"])


def build_floor(args: argparse.Namespace) -> nn.Module:
    """The recipe's model with the TP plan and no FSDP, in the compute dtype, every gradient
    allocated (as ``fsdp_vs_fsdp2.build_floor``, on this rank's TP blocks)."""
    cfg = config(args)
    env = make_env(torch.device("cpu"), dist.get_rank(), tp=args.tp)
    with torch.device("meta"):
        model = model_class(cfg.model)(cfg.model, cfg.seq_len, cfg.activation_checkpointing)
    for index, block in enumerate(model.layers):
        model.materialize_block(index, env.device, cfg.seed)
        apply_tp_to_block(block, env.tp_mesh)
    model.materialize_root(env.device, cfg.seed)
    apply_tp_to_root(model, env.tp_mesh)
    model = model.to(torch.bfloat16 if args.mixed_precision else torch.float32)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def _parts(model: nn.Module) -> SimpleNamespace:
    """The modules ``PhaseRecorder`` names its rows after."""
    return SimpleNamespace(
        embed=model.tok_embeddings, layers=model.layers, norm=model.norm, head=model.output
    )


def gathered_bytes(model: nn.Module, args: argparse.Namespace) -> dict[str, int]:
    """TP-local bytes (compute dtype) of the group each row's module needs gathered, keyed by
    the row that ends its interval: the recipe's wrapping (``fsdp_vs_fsdp2.gathered_bytes``'s
    rule with TP-local sizes)."""
    size = 2 if args.mixed_precision else 4

    def local(module: nn.Module) -> int:
        return sum(getattr(p, "_local_tensor", p).numel() for p in module.parameters())

    blocks = {f"layers.{i}": local(b) for i, b in enumerate(model.layers)}
    head = local(model.norm) + local(model.output)
    needs = {"forward embed end": size * local(model.tok_embeddings)}
    for name, n in blocks.items():
        needs[f"forward {name} end"] = needs[f"backward {name} end"] = size * n
    for name in ("norm", "head"):
        needs[f"forward {name} end"] = needs[f"backward {name} end"] = size * head
    return needs


def _report_and_leave(summary: dict[str, Any], world: int, out) -> None:
    """Gather every rank's ``summary``; rank 0 puts them on ``out``. Then all ranks leave
    together (gloo may abort a rank that tears down while a peer still runs)."""
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, summary)
    if dist.get_rank() == 0:
        out.put(everyone)
    dist.barrier()
    dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    init_gloo(rank, world, port)
    gen = torch.Generator().manual_seed(rank // args.tp)  # tp_vs_fsdp2.py's batches
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    if args.system == "floor":
        model, opt = build_floor(args), None
    else:
        model, opt = build(args.system, args)
    phases: PhaseRecorder | None = None

    def mark(label: str) -> None:
        if phases is not None:
            phases.mark(label)

    def step() -> None:
        loss = loss_fn(model, tokens[:, :-1], tokens[:, 1:])
        mark("loss")
        loss.backward()
        mark("backward done")
        if opt is not None:
            opt.step()
            mark("optimizer step")
            opt.zero_grad()
            mark("zero_grad")

    for _ in range(3):  # warm-up: optimizer state, allocator, gloo connections
        step()
    transient = peak_above_now(step)  # before the rows' hooks, which reset VmHWM
    allocated = peak_allocated(step)
    phases = PhaseRecorder(_parts(model))  # type: ignore[arg-type]
    step()
    phases.start()
    step()
    rows = list(phases.rows)
    bound = phases.bound(gathered_bytes(model, args)) if args.system == "floor" else None
    summary: dict[str, Any] = {"rank": rank, "rows": rows, "transient": transient}
    summary |= {"allocated": allocated, "bound": bound}
    _report_and_leave(summary, world, out)


def _grow(rows: list[tuple[str, float]], label: str, start: float) -> None:
    """A row: the trimmed resident set's growth since ``start`` (MiB)."""
    rows.append((label, trimmed_rss_kib() / 1024 - start))


def _static_build(
    name: str, args: argparse.Namespace, step, rows: list[tuple[str, float]]
) -> dict[str, Any]:
    """``name`` built and warmed up as ``tp_vs_fsdp2.py`` does, its phases appended to
    ``rows``; the system (model, optimizer) and its tensor bytes, all and under the mmap
    threshold, in MiB."""
    start = trimmed_rss_kib() / 1024
    model = build_sharded(name, args)  # materialized, TP plan, fully_shard
    _grow(rows, f"{name}: build + fully_shard", start)
    opt = make_optimizer(name, model, args)
    _grow(rows, f"{name}: optimizer created", start)
    for i in range(2):
        step(model, opt)
        _grow(rows, f"{name}: step {i + 1}", start)
    sizes = storage_bytes(model, opt).values()
    small = sum(n for n in sizes if n < MMAP_THRESHOLD)
    return {"model": model, "opt": opt, "tensors": sum(sizes) / 2**20, "heap": small / 2**20}


def _static_delete(system: dict[str, Any]) -> tuple[float, float]:
    """What deleting ``system`` drops the resident set by (MiB): read as is (as
    ``tp_vs_fsdp2.py`` read it before ``trimmed_rss_kib``), and with the heap trimmed."""
    before = trimmed_rss_kib()
    del system["model"], system["opt"]
    gc.collect()
    untrimmed = status_kib("VmRSS")
    return (before - untrimmed) / 1024, (before - trimmed_rss_kib()) / 1024


def _static_worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    init_gloo(rank, world, port)
    gen = torch.Generator().manual_seed(rank // args.tp)  # tp_vs_fsdp2.py's batches
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    step = _step(tokens, args.loss_parallel)
    _warm_up(args, step)
    rows: list[tuple[str, float]] = []
    systems = {name: _static_build(name, args, step, rows) for name in STATIC_SYSTEMS}
    summary: dict[str, Any] = {"rank": rank, "rows": rows}
    for name, system in systems.items():
        summary[name] = {"tensors": system["tensors"], "heap": system["heap"]}
        summary[name]["drop"], summary[name]["drop_trimmed"] = _static_delete(system)
    _report_and_leave(summary, world, out)


def print_static(everyone: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Rank 0's phases, then every rank's tensor bytes against its deletion drops."""
    print(
        f"static, dp {args.world_size // args.tp} x tp {args.tp}, rank 0: trimmed resident "
        "MiB above each system's start"
    )
    for label, grown in everyone[0]["rows"]:
        print(f"{label:34s} {grown:8.2f}")
    heads = ("tensor bytes", f"of which < {MMAP_THRESHOLD // 1024} KiB", "drop", "drop trimmed")
    print(f"{'rank system':18s}" + "".join(f"{h:>18s}" for h in heads))
    for r in everyone:
        for name in STATIC_SYSTEMS:
            s = r[name]
            values = (s["tensors"], s["heap"], s["drop"], s["drop_trimmed"])
            print(f"{r['rank']:<5d}{name:13s}" + "".join(f"{v:18.2f}" for v in values))


def _print_phases(everyone: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The step's rows of the rank with the highest summit, its transient and allocator peaks,
    and for the floor the bound."""
    top = max(everyone, key=lambda r: max(peak for _, _, peak in r["rows"]))
    summit = max(peak for _, _, peak in top["rows"])
    print(
        f"{args.system}, dp {args.world_size // args.tp} x tp {args.tp}, {args.optimizer}, "
        f"rank {top['rank']}: resident MiB above the post-warm-up level"
    )
    print(f"{'phase':28s} {'now':>8s} {'peak since previous row':>24s}")
    for label, now, peak in top["rows"]:
        print(f"{label:28s} {now:8.1f} {peak:24.1f}{'  <==' if peak == summit else ''}")
    print(
        f"transient peak (max over ranks): {max(r['transient'] for r in everyone):.1f} MiB; "
        f"allocator peak (profiler, max over ranks): {max(r['allocated'] for r in everyone):.1f}"
        " MiB"
    )
    if args.system == "floor":
        print(f"bound (each row + the group it needs): {max(r['bound'] for r in everyone):.1f}")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in SYSTEMS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(SYSTEMS)}}} [tp_vs_fsdp2.py's flags]")
    args = parse_args(sys.argv[2:])
    args.system = sys.argv[1]
    if args.system == "static":
        print_static(spawn_ranks(_static_worker, args, args.world_size), args)
        return
    _print_phases(spawn_ranks(_worker, args, args.world_size), args)


if __name__ == "__main__":
    main()
