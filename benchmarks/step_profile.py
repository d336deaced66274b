"""Where a training step's time goes, raggedfsdp.fully_shard beside FSDP2, per rank (CPU, gloo).

The model, wrapping and data are ``fsdp_vs_fsdp2.py``'s (its flags). Every rank builds both
systems and alternates them; per step, the forward and backward run under ``cProfile`` and the
optimizer step (``torch.optim.AdamW``, the same for both; ``--our-adamw``: ours with
``raggedfsdp.optim.AdamW``) and ``zero_grad`` are timed apart.
The profile's self time of every function is charged to a category by the file of the function,
or for a C function (an aten op, a ``Work.wait``) by the file that called it:

* ``collectives``: our ``raggedfsdp/comm`` calls, ``torch.distributed``'s, and waiting on work;
* ``copies/casts``: tensor copies, casts, fills and allocations made by FSDP code (FSDP2's
  copy-in and copy-out, our gradient copies into the flat buffer, zeroing, freeing);
* ``views``: views made by FSDP code (``view``, slicing, ``as_strided``, ``split``...);
* ``hooks/bookkeeping``: the Python of the FSDP runtimes themselves (hooks, state, DTensor and
  our RaggedTensor bookkeeping) and the other C calls they make (hook registration, pytree);
* ``model``: everything else in forward and backward: the model's ops, autograd's engine.

cProfile adds a cost per Python call, so the Python-heavy categories read high; the unprofiled
wall time of the same steps is reported beside (``step (unprofiled)``). Ratios by category say
where the two differ.

    python benchmarks/step_profile.py [fsdp_vs_fsdp2.py flags] [--steps 6] [--dump DIR]
        [--our-adamw]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_vs_fsdp2 import add_model_arguments, build
from measure import init_gloo, spawn_ranks

SYSTEMS = ("ours", "fsdp2")
CATEGORIES = ("collectives", "copies/casts", "views", "hooks/bookkeeping", "model")
FSDP_FILES = (
    "raggedfsdp/fsdp/",
    "raggedfsdp/sharding/",
    "torch/distributed/fsdp/",
    "torch/distributed/tensor/",
    "torch/distributed/device_mesh",
    "torch/utils/_pytree",
    "torch/autograd/graph.py",
)
COMM_FILES = ("raggedfsdp/comm/", "torch/distributed/distributed_c10d", "torch/distributed/c10d")
COPY_OPS = (
    "copy_",
    "_foreach_copy_",
    "split_with_sizes_copy",
    "_chunk_cat",
    "to",
    "_to_copy",
    "zero_",
    "zeros",
    "empty",
    "new_empty",
    "new_zeros",
    "resize_",
    "clone",
    "cat",
    "mul_",
    "add_",
    "div_",
    "fill_",
    "_foreach_",
)
VIEW_OPS = ("view", "as_strided", "narrow", "__getitem__", "split", "chunk", "set_", "reshape")


def _builtin_name(func: tuple[str, int, str]) -> str | None:
    """The method or function name of a C function's pstats key, else None."""
    file, _, name = func
    if file != "~":
        return None
    # "<method 'copy_' of 'torch._C.TensorBase' objects>", "<built-in method torch.zeros>"
    if name.startswith("<method '"):
        return name.split("'")[1]
    if name.startswith("<built-in method "):
        return name[len("<built-in method ") :].rstrip(">").split(".")[-1]
    return name


def _category(func: tuple[str, int, str], caller: tuple[str, int, str]) -> str:
    builtin = _builtin_name(func)
    file = caller[0] if builtin is not None else func[0]
    if any(f in file for f in COMM_FILES) or builtin == "wait":
        return "collectives"
    if builtin == "run_backward" or not any(f in file for f in FSDP_FILES):
        return "model"
    if builtin is not None and builtin.startswith(COPY_OPS):
        return "copies/casts"
    if builtin in VIEW_OPS:
        return "views"
    return "hooks/bookkeeping"


def categorize(stats: pstats.Stats) -> Counter[str]:
    """Self time (s) by category, each C function's time split by its callers."""
    out: Counter[str] = Counter()
    for func, (_, _, tottime, _, callers) in stats.stats.items():
        if not callers:
            out[_category(func, ("~", 0, ""))] += tottime
        for caller, (_, _, edge_tottime, _) in callers.items():
            out[_category(func, caller)] += edge_tottime
    return out


def _build(name: str, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``fsdp_vs_fsdp2.build``'s model and optimizer; with ``--our-adamw`` ours steps with
    ``raggedfsdp.optim.AdamW`` (the same hyper-parameters and bits) instead of torch's."""
    model, opt = build(name, args)
    if name == "ours" and args.our_adamw:
        from raggedfsdp.optim import AdamW

        opt = AdamW(model.parameters(), **{k: opt.defaults[k] for k in ("lr", "weight_decay")})
    return model, opt


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    init_gloo(rank, world, port)
    models = {name: _build(name, args) for name in SYSTEMS}
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)

    def forward_backward(model: torch.nn.Module) -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    def step(name: str, profiler: cProfile.Profile | None) -> tuple[float, float]:
        model, opt = models[name]
        dist.barrier()
        t0 = time.perf_counter()
        if profiler is None:
            forward_backward(model)
        else:
            profiler.runcall(forward_backward, model)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return t1 - t0, time.perf_counter() - t1

    for name in SYSTEMS:  # warm-up: optimizer state, allocator, gloo connections
        step(name, None)
        step(name, None)
    profilers = {name: cProfile.Profile() for name in SYSTEMS}
    wall: dict[str, dict[str, list[float]]] = {n: {"step": [], "optimizer": []} for n in SYSTEMS}
    for i in range(args.steps):
        for name in SYSTEMS[i % 2 :] + SYSTEMS[: i % 2]:
            step(name, profilers[name])
            fwd_bwd, optim = step(name, None)  # unprofiled, alternating too
            wall[name]["step"].append(fwd_bwd + optim)
            wall[name]["optimizer"].append(optim)
    report: dict[str, Any] = {}
    for name in SYSTEMS:
        if args.dump:
            profilers[name].dump_stats(f"{args.dump}/{name}-rank{rank}.pstats")
        by_category = categorize(pstats.Stats(profilers[name]))
        report[name] = {k: by_category[k] / args.steps * 1e6 for k in CATEGORIES}
        report[name] |= {
            f"{k} (unprofiled)": statistics.median(v) * 1e6 for k, v in wall[name].items()
        }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, report)
    if rank == 0:
        out.put(everyone)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dump", help="a folder to write each rank's pstats files into")
    parser.add_argument(
        "--our-adamw",
        action="store_true",
        help="step ours with raggedfsdp.optim.AdamW (FSDP2 keeps torch.optim.AdamW)",
    )
    args = parser.parse_args()
    ranks = spawn_ranks(_worker, args, args.world_size)
    print(json.dumps({"benchmark": "step_profile", "args": vars(args), "ranks": ranks}))
    keys = [*CATEGORIES, "optimizer (unprofiled)", "step (unprofiled)"]
    print("\nµs per step (forward+backward profiled; per rank ours / FSDP2 = ratio)")
    print(f"{'':26s}" + "".join(f"{f'rank {r}':>26s}" for r in range(len(ranks))))
    for key in keys:
        pairs = [(r["ours"][key], r["fsdp2"][key]) for r in ranks]
        cells = "".join(f"{a:9.0f} /{b:9.0f} ={a / max(b, 1e-9):5.2f}" for a, b in pairs)
        print(f"{key:26s}{cells}")


if __name__ == "__main__":
    main()
