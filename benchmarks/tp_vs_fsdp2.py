"""raggedfsdp.fully_shard x TP vs PyTorch FSDP2 x TP on the recipe's Llama (CPU, gloo).

The model is the recipe's dense ``Transformer`` built by the recipe itself
(``recipes.llama.parallel.build_model``: meta device, each block materialized from the seed,
torchtitan's TP plan from ``recipes/llama/tensor_parallel.py``, then the block wrapped; the
embedding alone, ``[norm, output]`` kept unsharded after forward, the root) on a ``(dp_shard,
tp)`` mesh, once with ``--fsdp raggedfsdp`` and once with ``--fsdp fsdp2``; both step
``torch.optim.AdamW`` (element-wise, the same math on TP pieces and on DTensors). Every rank
builds both and alternates them (A B A B, the order rotating each round) over the same batches:
each data-parallel rank its own, shared by its TP ranks. Reported per system and as ratios ours
/ FSDP2 (lower is better):

* ``step``: a training step (forward, backward, optimizer step), median;
* ``all_gather`` / ``reduce_scatter``: calls and bytes of one step over data parallel, counted
  at the runtimes' collective calls (``measure.CollectiveBytes``: gathered buffer / unreduced
  input). TP's own collectives (DTensor's functional ones, the same plan under both) are not
  counted;
* ``static_tensors``: storage bytes of this rank's parameters, gradients and optimizer state,
  what a GPU holds between steps; ``static``: the same as resident memory, what the resident
  set drops by when the system is deleted after the run;
* ``transient``: peak resident memory above the post-warm-up level during a step (ranks started
  with ``MALLOC_*`` set, ``VmHWM`` reset before the step: ``measure.py``), median; memory
  figures are the maximum over ranks;
* final losses and their difference.

    python benchmarks/tp_vs_fsdp2.py [--world-size 4] [--tp 2] [--steps 8] [--dim 256]
        [--layers 4] [--heads 8] [--kv-heads 4] [--vocab 4096] [--batch 4] [--seq 128]
        [--mixed-precision]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from measure import CollectiveBytes, init_gloo, peak_above_now, spawn_ranks, status_kib
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the recipe, for a script run from benchmarks/
    sys.path.insert(0, str(REPO))
from moe_vs_fsdp2 import ratios, tensor_bytes  # noqa: E402

from recipes.llama.config import Config, ConfigError  # noqa: E402
from recipes.llama.model import Transformer  # noqa: E402
from recipes.llama.model_config import ModelConfig  # noqa: E402
from recipes.llama.parallel import build_model, check_world, make_env  # noqa: E402
from recipes.llama.train import loss_fn  # noqa: E402

SYSTEMS = {"ours": "raggedfsdp", "fsdp2": "fsdp2"}
ADAMW = {"lr": 1e-3, "weight_decay": 0.1}


def config(args: argparse.Namespace, fsdp: str = "raggedfsdp") -> Config:
    """The recipe's configuration of this run (the checks ``--tp`` gets in the recipe too)."""
    model = ModelConfig(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
    )
    cfg = Config(model=model, seq_len=args.seq, tp=args.tp, fsdp=fsdp, device="cpu")
    cfg.mixed_precision = "bf16" if args.mixed_precision else "none"
    cfg.check()
    return cfg


def build(system: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The recipe's model on ``system`` x TP at (world / tp, tp), with torch's AdamW."""
    env = make_env(torch.device("cpu"), dist.get_rank(), tp=args.tp)
    model = build_model(config(args, SYSTEMS[system]), env, policy=None)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def _step(tokens: torch.Tensor):
    """One training step of a (model, optimizer) pair; returns the loss."""

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> float:
        loss = loss_fn(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def _warm_up(args: argparse.Namespace, step) -> None:
    """Both systems on a one-block copy, then dropped: the one-off costs (kernels, autograd and
    gloo threads, the allocator's arenas, the TP groups) are not charged to the first one."""
    small = argparse.Namespace(**{**vars(args), "layers": 1})
    for name in SYSTEMS:
        model, opt = build(name, small)
        for _ in range(2):
            step(model, opt)
        del model, opt
    gc.collect()


def _counted_step(model: nn.Module, opt: torch.optim.Optimizer, step) -> dict[str, Any]:
    """One step with its data-parallel collectives counted: calls, MiB, the loss."""
    counter = CollectiveBytes()
    with counter.counting():
        loss = step(model, opt)
    bytes_mib = {kind: n / 2**20 for kind, n in counter.bytes.items()}
    return {"loss": loss, "calls": dict(counter.calls), "bytes": bytes_mib}


def _static_resident(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """What the resident set drops by when each system is deleted (its memory between steps)."""
    static = {}
    for name, system in systems.items():
        gc.collect()
        before = status_kib("VmRSS")
        system.clear()
        gc.collect()
        static[name] = (before - status_kib("VmRSS")) / 1024
    return static


def _rounds(systems: dict[str, dict[str, Any]], steps: int, step) -> dict[str, dict[str, float]]:
    """``steps`` alternating rounds, the order rotating: medians of step time and transient."""
    names = list(systems)
    rounds: dict[str, dict[str, list[float]]] = {n: {"step": [], "transient": []} for n in names}
    for i in range(steps):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            model, opt = systems[name]["model"], systems[name]["opt"]
            dist.barrier()
            t0 = time.perf_counter()
            mem = peak_above_now(lambda m=model, o=opt: step(m, o))
            rounds[name]["step"].append(time.perf_counter() - t0)
            rounds[name]["transient"].append(mem)
        del model, opt  # no reference left here: deleting a system below must free it
    return {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rounds.items()}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    init_gloo(rank, world, port)
    dp_rank = rank // args.tp  # tp is the mesh's last dim: a TP group is neighbouring ranks
    gen = torch.Generator().manual_seed(dp_rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    step = _step(tokens)
    _warm_up(args, step)
    systems: dict[str, dict[str, Any]] = {}
    for name in SYSTEMS:
        model, opt = build(name, args)
        for _ in range(2):  # optimizer state, gloo connections
            step(model, opt)
        systems[name] = {"model": model, "opt": opt}
        systems[name]["static_tensors"] = tensor_bytes(model, opt) / 2**20
        del model, opt
    report = _rounds(systems, args.steps, step)
    for name, system in systems.items():
        report[name] |= _counted_step(system["model"], system["opt"], step)
        report[name]["static_tensors"] = system["static_tensors"]
    for name, static in _static_resident(systems).items():
        report[name]["static"] = static
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, report)
    if rank == 0:  # memory: the rank that holds most
        for name in SYSTEMS:
            for key in ("static", "static_tensors", "transient"):
                report[name][key] = max(r[name][key] for r in everyone)
        out.put(report)
    dist.barrier()  # leave together: gloo may abort a rank that tears down while a peer runs
    dist.destroy_process_group()


def print_table(result: dict[str, Any]) -> None:
    ours, peer, a = result["ours"], result["fsdp2"], result["args"]
    print(
        f"\ndp {a['world_size'] // a['tp']} x tp {a['tp']}, {result['params'] / 1e6:.1f}M "
        f"parameters, {'bf16/fp32' if a['mixed_precision'] else 'fp32'}, torch AdamW, "
        f"medians of {a['steps']} rounds"
    )
    print(f"{'':30s}{'raggedfsdp':>12s}{'FSDP2':>12s}{'ratio':>8s}")
    rows = [
        ("training step (ms)", lambda r: 1e3 * r["step"]),
        ("all-gather MiB / step", lambda r: r["bytes"].get("all_gather", 0.0)),
        ("all-gathers / step", lambda r: r["calls"].get("all_gather", 0)),
        ("reduce-scatter MiB / step", lambda r: r["bytes"].get("reduce_scatter", 0.0)),
        ("reduce-scatters / step", lambda r: r["calls"].get("reduce_scatter", 0)),
        ("static resident (MiB)", lambda r: r["static"]),
        ("static tensor bytes (MiB)", lambda r: r["static_tensors"]),
        ("transient peak (MiB)", lambda r: r["transient"]),
    ]
    for label, get in rows:
        mine, theirs = get(ours), get(peer)
        ratio = f"{mine / theirs:8.2f}" if theirs else f"{'':8s}"
        print(f"{label:30s}{mine:12.2f}{theirs:12.2f}{ratio}")
    print(
        f"final loss: raggedfsdp {ours['loss']:.6f}, FSDP2 {peer['loss']:.6f} "
        f"(difference {result['loss_diff']:.2e})"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 compute, fp32 reduce")
    args = parser.parse_args(argv)
    if args.tp < 2:
        parser.error(f"--tp {args.tp}: compare tensor parallelism at --tp 2 or more")
    try:  # bad shapes or meshes fail here, in one line, before any process starts
        config(args)
        check_world(args.tp, 1, args.world_size)
    except ConfigError as e:
        parser.error(str(e))
    return args


def main() -> None:
    args = parse_args()
    report = spawn_ranks(_worker, args, args.world_size)
    params = sum(p.numel() for p in Transformer(config(args).model, args.seq).parameters())
    result = {"benchmark": "tp_vs_fsdp2", "args": vars(args), "params": params, **report}
    result["ratio"] = ratios(report["ours"], report["fsdp2"])
    result["loss_diff"] = abs(report["ours"]["loss"] - report["fsdp2"]["loss"])
    print(json.dumps(result))
    print_table(result)


if __name__ == "__main__":
    main()
