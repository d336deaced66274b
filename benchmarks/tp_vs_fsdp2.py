"""raggedfsdp.fully_shard x TP vs PyTorch FSDP2 x TP on the recipe's Llama (CPU, gloo).

The model is the recipe's dense ``Transformer`` built by the recipe itself
(``recipes.llama.parallel.build_model``: meta device, each block materialized from the seed,
torchtitan's TP plan from ``recipes/llama/tensor_parallel.py``, then the block wrapped; the
embedding alone, ``[norm, output]`` kept unsharded after forward, the root) on a ``(dp_shard,
tp)`` mesh, once with ``--fsdp raggedfsdp`` and once with ``--fsdp fsdp2``; both step
``torch.optim.AdamW`` (element-wise, the same math on TP pieces and on DTensors), or with
``--optimizer muon`` (``tp_muon.py``): ours ``raggedfsdp.optim.Muon`` on ``split_muon_params``'
groups (with ``Muon.shard_policy()``), FSDP2's ``torch.optim.Muon`` on the hidden matrices'
DTensors + ``torch.optim.AdamW`` on the rest, and a third system, ``gather``: the FSDP2 x TP
model with every NS input gathered whole on every rank (``tp_muon.GatherMuon``,
benchmarks/muon_step.py's "gather everything"). Every rank builds them all and alternates them
(A B A B, the order rotating each round) over the same batches: each data-parallel rank its
own, shared by its TP ranks. Reported per system and as ratios ours / FSDP2 (and ours /
gather; lower is better):

* ``step``: a training step (forward, backward, optimizer step), median; ``optim``: the
  optimizer step alone (timed from a barrier after backward), median;
* ``all_gather`` / ``reduce_scatter``: calls and bytes of one step over data parallel, counted
  at the runtimes' collective calls (``measure.CollectiveBytes``: gathered buffer / unreduced
  input). TP's own collectives (DTensor's functional ones, the same plan under both) are not
  counted;
* ``static_tensors``: storage bytes of this rank's parameters, gradients and optimizer state,
  what a GPU holds between steps; ``static``: the same as resident memory, what the resident
  set drops by when the system is deleted after the run, glibc's free heap pages returned
  before each reading (``measure.trimmed_rss_kib``: else FSDP2's sub-64 KiB tensors, freed
  inside the heap, would stay counted and its figure come out ~1 MiB short);
* ``transient``: peak resident memory above the post-warm-up level during a step (ranks started
  with ``MALLOC_*`` set, ``VmHWM`` reset before the step: ``measure.py``), median; memory
  figures are the maximum over ranks;
* final losses and their difference;
* with ``--optimizer muon``: ``optimizer_bytes``, the bytes every rank sent in the optimizer
  step, summed over ranks (ours: ``last_step_stats["bytes_sent"]`` of the owner exchange;
  torch's: DTensor's functional collectives, ``tp_muon.DTensorCollectives``), and ``check``:
  each system stepped twice from the same weights with the same global gradients on a
  one-block copy, its update against one process's ``torch.optim.Muon`` + ``AdamW`` on the
  unsharded tensors (``bitwise``, worst relative error) and against fp64 Newton–Schulz
  (``tp_muon.same_gradient_check``).

    python benchmarks/tp_vs_fsdp2.py [--world-size 4] [--tp 2] [--steps 8] [--dim 256]
        [--layers 4] [--heads 8] [--kv-heads 4] [--vocab 4096] [--batch 4] [--seq 128]
        [--mixed-precision] [--loss-parallel] [--optimizer {adamw,muon}]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from measure import (
    CollectiveBytes,
    alternate_rounds,
    init_gloo,
    spawn_ranks,
    train_step,
    trimmed_rss_kib,
)
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the recipe, for a script run from benchmarks/
    sys.path.insert(0, str(REPO))
from moe_vs_fsdp2 import ratios, tensor_bytes  # noqa: E402
from tp_muon import DTensorCollectives, owner_bytes, same_gradient_check  # noqa: E402
from tp_muon import optimizer as muon_optimizer  # noqa: E402

from recipes.llama.config import Config, ConfigError  # noqa: E402
from recipes.llama.model import Transformer  # noqa: E402
from recipes.llama.model_config import ModelConfig  # noqa: E402
from recipes.llama.parallel import build_model, check_world, make_env  # noqa: E402
from recipes.llama.tensor_parallel import loss_context  # noqa: E402
from recipes.llama.train import loss_fn  # noqa: E402

SYSTEMS = {"ours": "raggedfsdp", "fsdp2": "fsdp2", "gather": "fsdp2"}  # gather: Muon only
ADAMW = {"lr": 1e-3, "weight_decay": 0.1}
LABELS = {"ours": "raggedfsdp", "fsdp2": "FSDP2", "gather": "FSDP2+gather"}


def systems(args: argparse.Namespace) -> list[str]:
    """The systems compared: ours and FSDP2, and with Muon FSDP2's gather-everything too."""
    return ["ours", "fsdp2", "gather"] if args.optimizer == "muon" else ["ours", "fsdp2"]


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
    cfg.loss_parallel = args.loss_parallel
    cfg.check()
    return cfg


def build(system: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The recipe's model on ``system`` x TP at (world / tp, tp), with torch's AdamW or, with
    ``--optimizer muon``, the system's Muon (ours planned with ``Muon.shard_policy()``, as the
    recipe's ``--optimizer muon`` does)."""
    model = build_sharded(system, args)
    return model, make_optimizer(system, model, args)


def build_sharded(system: str, args: argparse.Namespace) -> nn.Module:
    """``build``'s model alone (``tp_memory_phases.py static`` reads memory between the two)."""
    from raggedfsdp.optim import Muon

    env = make_env(torch.device("cpu"), dist.get_rank(), tp=args.tp)
    policy = Muon.shard_policy() if args.optimizer == "muon" and system == "ours" else None
    return build_model(config(args, SYSTEMS[system]), env, policy=policy)


def make_optimizer(
    system: str, model: nn.Module, args: argparse.Namespace
) -> torch.optim.Optimizer:
    """``build``'s optimizer for ``model``."""
    if args.optimizer == "muon":
        return muon_optimizer(system, model)
    return torch.optim.AdamW(model.parameters(), **ADAMW)


def _step(tokens: torch.Tensor, loss_parallel: bool = False):
    """One training step of a (model, optimizer) pair; returns the loss and the optimizer
    step's seconds (from a barrier after backward, so that it waits for no peer's backward).
    With ``--loss-parallel`` the loss and its backward run under the recipe's ``loss_context``."""

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[float, float]:
        with loss_context(loss_parallel):
            loss = loss_fn(model, tokens[:, :-1], tokens[:, 1:])
            return train_step(loss, opt, barrier=True)

    return step


def _warm_up(args: argparse.Namespace, step) -> None:
    """Both systems on a one-block copy, then dropped: the one-off costs (kernels, autograd and
    gloo threads, the allocator's arenas, the TP groups) are not charged to the first one."""
    small = argparse.Namespace(**{**vars(args), "layers": 1})
    for name in systems(args):
        model, opt = build(name, small)
        for _ in range(2):
            step(model, opt)
        del model, opt
    gc.collect()


def _counted_step(model: nn.Module, opt: torch.optim.Optimizer, step) -> dict[str, Any]:
    """One step with its data-parallel collectives counted: calls, MiB, the loss; and the
    bytes this rank sent in the optimizer step (ours: Muon's owner exchange; torch's
    optimizers: DTensor's collectives) with their calls."""
    counter, in_optimizer = CollectiveBytes(), DTensorCollectives()
    original = opt.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        with in_optimizer:
            return original(*args, **kwargs)

    opt.step = counted  # type: ignore[method-assign]
    try:
        with counter.counting():
            loss = step(model, opt)[0]
    finally:
        del opt.step  # the class's again
    bytes_mib = {kind: n / 2**20 for kind, n in counter.bytes.items()}
    entry = {"loss": loss, "calls": dict(counter.calls), "bytes": bytes_mib}
    entry["optimizer_bytes"] = owner_bytes(opt) + sum(in_optimizer.bytes.values())
    entry["optimizer_collectives"] = dict(in_optimizer.calls)
    stats = getattr(opt, "last_step_stats", {})
    if "matrices" in stats:  # ours: matrices computed where they lie (over all ranks)
        entry["matrices"] = {k: stats[k] for k in ("matrices", "matrices_local")}
    return entry


def _static_resident(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """What the resident set drops by when each system is deleted (its memory between steps),
    read with glibc's heap trimmed (``trimmed_rss_kib``): FSDP2's small per-parameter tensors
    and objects live in the heap, whose freed pages an untrimmed reading still counts."""
    static = {}
    for name, system in systems.items():
        before = trimmed_rss_kib()
        system.clear()
        static[name] = (before - trimmed_rss_kib()) / 1024
    return static


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    init_gloo(rank, world, port)
    dp_rank = rank // args.tp  # tp is the mesh's last dim: a TP group is neighbouring ranks
    gen = torch.Generator().manual_seed(dp_rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    step = _step(tokens, args.loss_parallel)
    check = None
    if args.optimizer == "muon":  # same gradients, one block: before anything is timed
        small = argparse.Namespace(**{**vars(args), "layers": 1})
        check = same_gradient_check(lambda name: build(name, small), systems(args))
    _warm_up(args, step)
    built: dict[str, dict[str, Any]] = {}
    for name in systems(args):
        model, opt = build(name, args)
        for _ in range(2):  # optimizer state, gloo connections
            step(model, opt)
        built[name] = {"model": model, "opt": opt}
        built[name]["static_tensors"] = tensor_bytes(model, opt) / 2**20
        del model, opt
    report: dict[str, Any] = alternate_rounds(built, list(built), args.steps, step)
    for name, system in built.items():
        report[name] |= _counted_step(system["model"], system["opt"], step)
        report[name]["static_tensors"] = system["static_tensors"]
    for name, static in _static_resident(built).items():
        report[name]["static"] = static
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, report)
    if rank == 0:  # memory: the rank that holds most; optimizer bytes: all ranks together
        for name in systems(args):
            for key in ("static", "static_tensors", "transient"):
                report[name][key] = max(r[name][key] for r in everyone)
            report[name]["optimizer_bytes"] = sum(r[name]["optimizer_bytes"] for r in everyone)
        if check is not None:
            report["check"] = check
        out.put(report)
    dist.barrier()  # leave together: gloo may abort a rank that tears down while a peer runs
    dist.destroy_process_group()


def print_table(result: dict[str, Any]) -> None:
    a = result["args"]
    names = [n for n in SYSTEMS if n in result]
    muon = a["optimizer"] == "muon"
    print(
        f"\ndp {a['world_size'] // a['tp']} x tp {a['tp']}, {result['params'] / 1e6:.1f}M "
        f"parameters, {'bf16/fp32' if a['mixed_precision'] else 'fp32'}, "
        f"{'Muon (+ AdamW)' if muon else 'torch AdamW'}, medians of {a['steps']} rounds"
    )
    heads = "".join(f"{LABELS[n]:>14s}" for n in names)
    ratio_heads = "".join(f"{'/' + LABELS[n]:>14s}" for n in names[1:])
    print(f"{'':30s}{heads}{ratio_heads}")
    rows = [
        ("training step (ms)", lambda r: 1e3 * r["step"]),
        ("optimizer step (ms)", lambda r: 1e3 * r["optim"]),
        ("optimizer MiB sent / step", lambda r: r["optimizer_bytes"] / 2**20),
        ("all-gather MiB / step", lambda r: r["bytes"].get("all_gather", 0.0)),
        ("all-gathers / step", lambda r: r["calls"].get("all_gather", 0)),
        ("reduce-scatter MiB / step", lambda r: r["bytes"].get("reduce_scatter", 0.0)),
        ("reduce-scatters / step", lambda r: r["calls"].get("reduce_scatter", 0)),
        ("static resident (MiB)", lambda r: r["static"]),
        ("static tensor bytes (MiB)", lambda r: r["static_tensors"]),
        ("transient peak (MiB)", lambda r: r["transient"]),
    ]
    for label, get in rows:
        values = [get(result[n]) for n in names]
        ratio = "".join(f"{values[0] / v:14.2f}" if v else f"{'':14s}" for v in values[1:])
        print(f"{label:30s}{''.join(f'{v:14.2f}' for v in values)}{ratio}")
    losses = ", ".join(f"{LABELS[n]} {result[n]['loss']:.6f}" for n in names)
    print(f"final loss: {losses} (raggedfsdp - FSDP2 {result['loss_diff']:.2e})")
    if "matrices" in result["ours"]:
        m = result["ours"]["matrices"]
        print(f"Muon matrices (ours): {m['matrices']}, {m['matrices_local']} whole on one rank")
    if "check" in result:
        check = result["check"]
        print(
            "same gradients, one block, 2 steps, vs one process's torch Muon + AdamW "
            f"(its bf16 NS vs fp64 NS: {check['bf16_vs_fp64']:.2e}):"
        )
        for n in names:
            c = check[n]
            if c["error"]:
                print(f"  {LABELS[n]}: failed: {c['error']}")
                continue
            print(
                f"  {LABELS[n]}: bitwise {c['bitwise']}, matrices {c['matrix_error']:.2e}, "
                f"rest {c['rest_error']:.2e} (vs fp64 NS {c['vs_fp64']:.2e})"
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
    parser.add_argument(
        "--loss-parallel",
        action="store_true",
        help="the recipe's --loss-parallel: vocabulary-sharded logits, torch's loss_parallel()",
    )
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="muon: ours raggedfsdp.optim.Muon, FSDP2's torch.optim.Muon on DTensors and "
        "gathered (hidden matrices; AdamW for the rest)",
    )
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
    ours = report["ours"]
    for peer, suffix in (("fsdp2", ""), ("gather", "_gather")):
        if peer in report:
            ratio = ratios(ours, report[peer])
            if report[peer]["optimizer_bytes"]:
                ratio["optimizer_bytes"] = ours["optimizer_bytes"] / report[peer]["optimizer_bytes"]
            result[f"ratio{suffix}"] = ratio
            result[f"loss_diff{suffix}"] = abs(ours["loss"] - report[peer]["loss"])
    print(json.dumps(result))
    print_table(result)


if __name__ == "__main__":
    main()
