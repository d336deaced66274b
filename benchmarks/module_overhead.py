"""Per-module CPU overhead: raggedfsdp.fully_shard vs PyTorch FSDP2 on models of tiny blocks.

With many small modules the wrapping, not the compute, is the step: FSDP2's ``pre_forward``
alone was half of one such step on GPUs (pytorch/pytorch#173680), and launch-bound small models
and MoE layers with many groups pay it every step. Two models whose compute is negligible,
each group one ``fully_shard`` call, then the root:

* ``blocks``: ``N`` tiny blocks in a chain (``Linear(d, d)`` and ``RMSNorm(d)``, d = 8), each
  wrapped;
* ``moe``: one MoE layer of ``N`` tiny experts, each wrapped on its own (many groups); a
  router's softmax weights scale each expert's output and tokens go round-robin, so every
  expert runs every step.

Both systems are built in every rank with the same seed and alternate (A B A B, the order
rotating each round: ``measure.alternate_rounds``) over the same batch, with the same
``torch.optim.SGD`` (``--optim sgd``) or each with its AdamW (``--optim adamw``: ours
``raggedfsdp.optim.AdamW``, which updates the flat runs of the local pieces, beside FSDP2's
``torch.optim.AdamW`` over the DTensor parameters; both ``foreach=True``, the same bits);
reported per group in µs: the whole step (forward, backward, optimizer step) and the
optimizer's part, medians, as ratios ours / FSDP2. Step time depends on the machine's load;
counts in extra steps do not and show where per-group work goes: the Python function calls per
group (``sys.setprofile``), those of the optimizer step and ``zero_grad`` alone, and the tensor
allocations per group (the profiler's allocator events). Each ``--groups`` size runs in its own
launch; the per-group figures at two sizes say whether the overhead is linear in the number of
groups. The bare model (not wrapped, each rank alone, torch's SGD or AdamW) alternates with
them: ``bare µs`` is the floor both steps stand on, and ``added`` what ours adds to it over
what FSDP2 adds, ``(ours - bare) / (fsdp2 - bare)``.

    python benchmarks/module_overhead.py [--model {blocks,moe,both}] [--world-sizes 1 2]
        [--groups 128 512] [--steps 10] [--dim 8] [--tokens N] [--optim {sgd,adamw}]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from measure import alternate_rounds, init_gloo, spawn_ranks, train_step
from torch import nn

SYSTEMS = ("ours", "fsdp2", "bare")  # bare: the same model unwrapped, each rank on its own
COLUMNS = {  # reported per group: key, table heading
    "step_us": "step µs",
    "optim_us": "optim µs",
    "python_calls": "Py calls",
    "optim_calls": "optim Py calls",
    "allocations": "allocs",
}


class TinyBlock(nn.Module):
    """Three parameters and next to no compute: what a block costs is its wrapping."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.norm = nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.linear(x))


class Chain(nn.Module):
    def __init__(self, groups: int, dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(TinyBlock(dim) for _ in range(groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return h


class TinyMoE(nn.Module):
    """A router and ``groups`` experts; token ``t`` goes to expert ``t mod groups`` scaled by
    its router weight, so that every expert (and the router) gets a gradient every step. The
    dispatch is one sort, one split and one scatter (O(tokens)): indexing the router's output
    once per expert would make backward O(tokens x experts) per expert, compute that grows
    with the square of the groups and hides the wrapping's cost at 512."""

    def __init__(self, groups: int, dim: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, groups, bias=False)
        self.layers = nn.ModuleList(TinyBlock(dim) for _ in range(groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = len(self.layers)
        choice = torch.arange(x.shape[0]) % experts
        order = torch.argsort(choice, stable=True)  # the tokens grouped by expert
        counts = torch.bincount(choice, minlength=experts).tolist()
        scale = self.router(x).softmax(-1).gather(1, choice[:, None])[order]
        pieces = x[order].split(counts)
        out = torch.cat([expert(piece) for expert, piece in zip(self.layers, pieces, strict=True)])
        return torch.zeros_like(x).index_add(0, order, scale * out)


def build(system: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model of ``args.model`` wrapped by ``system``: each block or expert, then the root
    (``bare``: not wrapped, the floor both systems' steps stand on)."""
    from torch.distributed.device_mesh import init_device_mesh

    if system == "ours":
        from raggedfsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = (Chain if args.model == "blocks" else TinyMoE)(args.groups, args.dim)
    if system != "bare":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if args.optim == "sgd" or system == "bare":
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)
    if system == "ours":
        from raggedfsdp.optim import AdamW

        return model, AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def _stepper(batch: torch.Tensor):
    def step(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[float, float]:
        return train_step(model(batch).square().mean(), opt)

    return step


def python_calls(fn: Any) -> int:
    """Python function calls (not C ones) made by ``fn()`` on this thread (CPU autograd runs
    the backward, hooks included, on the thread that calls ``backward``)."""
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def allocations(fn: Any) -> int:
    """Tensor allocations made by ``fn()``, from the profiler's allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(
        1
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.nbytes() > 0
    )


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    init_gloo(rank, world, port, threads=1)  # tiny tensors: threads would only add noise
    rows = args.tokens or (args.groups if args.model == "moe" else 8)  # MoE: one per expert
    batch = torch.randn(rows, args.dim, generator=torch.Generator().manual_seed(rank))
    step = _stepper(batch)
    systems = {
        name: dict(zip(("model", "opt"), build(name, args), strict=True)) for name in SYSTEMS
    }
    for system in systems.values():  # warm-up: lazy set-up, optimizer state, gloo connections
        for _ in range(2):
            step(system["model"], system["opt"])
    rounds = alternate_rounds(systems, list(SYSTEMS), args.steps, step)
    report: dict[str, Any] = {}
    for name, system in systems.items():
        run = lambda s=system: step(s["model"], s["opt"])  # noqa: E731
        loss = run()[0]
        calls, allocs = python_calls(run), allocations(run)
        system["model"](batch).square().mean().backward()  # then the optimizer's calls alone
        optim_calls = python_calls(lambda s=system: (s["opt"].step(), s["opt"].zero_grad()))
        per_group = {k: v / args.groups * 1e6 for k, v in rounds[name].items() if k != "transient"}
        report[name] = {
            "step_us": per_group["step"],
            "optim_us": per_group["optim"],
            "python_calls": calls / args.groups,
            "optim_calls": optim_calls / args.groups,
            "allocations": allocs / args.groups,
            "loss": loss,
        }
    if rank == 0:
        out.put(report)
    dist.barrier()  # leave together: gloo may abort a rank that tears down while a peer runs
    dist.destroy_process_group()


def measure(model: str, world: int, groups: int, args: argparse.Namespace) -> dict[str, Any]:
    """One launch: both systems on ``groups`` groups of ``model`` at ``world`` ranks."""
    run_args = argparse.Namespace(**{**vars(args), "model": model, "groups": groups})
    res = spawn_ranks(_worker, run_args, world)
    ours, peer, bare = res["ours"], res["fsdp2"], res["bare"]
    ratio = {k: ours[k] / peer[k] for k in COLUMNS}
    # what each wrapping adds to the bare model's step, ours over FSDP2's
    added = (ours["step_us"] - bare["step_us"]) / (peer["step_us"] - bare["step_us"])
    return {"model": model, "world": world, "groups": groups, **res, "ratio": ratio, "added": added}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\nper group, medians of the alternating rounds (ratio = ours / FSDP2; added = "
        "(ours - bare) / (fsdp2 - bare))"
    )
    head = f"{'model':7s}{'W':>3s}{'groups':>7s}"
    for label in COLUMNS.values():
        head += f"{label:>22s}"
    print(head + f"{'bare µs':>9s}{'added':>7s}")
    for r in rows:
        line = f"{r['model']:7s}{r['world']:3d}{r['groups']:7d}"
        for key in COLUMNS:
            ours, peer = r["ours"][key], r["fsdp2"][key]
            line += f"{ours:8.1f} /{peer:7.1f} ={ours / peer:5.2f}"
        print(line + f"{r['bare']['step_us']:9.1f}{r['added']:7.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("blocks", "moe", "both"), default="both")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--groups", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument(
        "--optim",
        choices=("sgd", "adamw"),
        default="sgd",
        help="sgd: torch's SGD for both; adamw: raggedfsdp.optim.AdamW vs torch's AdamW",
    )
    parser.add_argument(
        "--tokens", type=int, default=None, help="rows of the batch (blocks: 8; moe: groups)"
    )
    args = parser.parse_args(argv)
    for flag in ("world_sizes", "groups"):
        if min(getattr(args, flag)) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.model != "blocks" and args.tokens is not None and args.tokens < max(args.groups):
        parser.error(
            f"--tokens {args.tokens} < --groups {max(args.groups)}: the MoE model routes token "
            "t to expert t mod groups, so every expert needs a token; raise --tokens"
        )
    return args


def main() -> None:
    args = parse_args()
    models = ("blocks", "moe") if args.model == "both" else (args.model,)
    rows = []
    for model in models:
        for world in args.world_sizes:
            for groups in args.groups:
                row = measure(model, world, groups, args)
                print(json.dumps({"benchmark": "module_overhead", **row}), flush=True)
                rows.append(row)
    print_table(rows)


if __name__ == "__main__":
    main()
