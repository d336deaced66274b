"""The capacity planner on real MoE models with fused experts, against FSDP2's even split.

For each model (``--experts fused``: one ``(E, d_ff, d)`` tensor per projection, as GPT-OSS,
DeepSeek-V3 and torchtitan store them) and shard size W, from ``raggedfsdp.capacity.estimate``
(the same answer as ``raggedfsdp plan <model> --experts fused -w W``; bf16 compute, fp32
master weights and reduction, AdamW, NCCL):

* our per-rank total at the peak (activations excluded) and what the expert units became;
* padding, ours and FSDP2's (``torch.chunk`` rows of dim 0, every rank allocating the
  largest chunk), in % of the parameters;
* persistent bytes per rank (fp32 master + fp32 gradients + AdamW moments, 16 bytes per
  sharded element; both cast to bf16 at gather time), ours and FSDP2's;
* all-gather bytes per rank per step, ours and FSDP2's.

    python benchmarks/moe_plan_table.py [--models mixtral-8x7b ...] [--worlds 8 64 256 1024]

With ``--budgets F ...`` it tables instead what the default policy's padding budget
(``ExpertShardPolicy(max_extra_padding=F)``) buys, per model, expert layout (as listed, and
fused) and W: the padding added beyond element units' (% of the parameters, every group
counted as often as the model repeats it), the expert matrices that end up whole on one rank
(from the planned layout; the table shows those cut between ranks) and the seconds the units
search took (JSON lines):

    python benchmarks/moe_plan_table.py --budgets 0 0.0001 0.001 0.01 --worlds 8 16 64 256
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time

from raggedfsdp.capacity import Group, Mesh, ModelShapes, PlanError, Settings, estimate, load_model
from raggedfsdp.sharding import TensorSpec, plan_layout
from raggedfsdp.sharding.units import ExpertShardPolicy, expert_matrix

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b")
#: Bytes per sharded element between steps: fp32 master, fp32 gradient, 2 moments.
PERSISTENT_BYTES = 4 + 4 + 8
GIB = 2**30


PER_EXPERT = re.compile(r"^(.*experts)\.(\d+)\.(.*)$")


def fuse(group: Group) -> Group:
    """Per-expert tensors ``...experts.<i>.<name> (m, n)`` stacked into one ``...experts.<name>
    (E, m, n)`` tensor each, in place of the first expert's (the rest keep their order)."""
    stacks: dict[str, list[tuple[int, ...]]] = {}
    tensors: list[tuple[str, tuple[int, ...]]] = []
    for name, shape in group.tensors:
        match = PER_EXPERT.match(name)
        if match is None:
            tensors.append((name, shape))
            continue
        fused = f"{match[1]}.{match[3]}"
        if fused not in stacks:
            stacks[fused] = []
            tensors.append((fused, ()))
        stacks[fused].append(shape)
    out = [(n, (len(stacks[n]), *stacks[n][0]) if n in stacks else s) for n, s in tensors]
    return dataclasses.replace(group, tensors=tuple(out))


def fused_model(model: str) -> ModelShapes:
    """``model`` with fused experts: ``--experts fused`` for the presets built from a Hugging
    Face config, stacked here for those listed one tensor per expert."""
    try:
        return load_model(model, experts="fused")
    except PlanError:
        shapes = load_model(model)
        groups = tuple(fuse(g) for g in shapes.groups)
        return dataclasses.replace(shapes, groups=groups, source=shapes.source + ", fused here")


def row(model: str, world: int) -> dict:
    est = estimate(fused_model(model), Settings(Mesh(1, world)))
    ours = sum(p.instances * p.segment for p in est.plans)
    fsdp2 = sum(p.instances * p.fsdp2_shard for p in est.plans)
    return {
        "model": model,
        "world": world,
        "params": est.model.numel,
        "total_gib": est.memory["total"] / GIB,
        "padding_pct": est.padding["pct"],
        "fsdp2_padding_pct": est.padding["fsdp2_pct"],
        "persistent_gib": ours * PERSISTENT_BYTES / GIB,
        "fsdp2_persistent_gib": fsdp2 * PERSISTENT_BYTES / GIB,
        "all_gather_gib": est.traffic["all_gather"] / GIB,
        "fsdp2_all_gather_gib": est.traffic["fsdp2_all_gather"] / GIB,
        "expert_notes": [n for n in est.notes if "expert" in n],
        "elapsed_s": est.elapsed_s,
    }


def whole_matrices(layout, specs: list[TensorSpec]) -> tuple[int, int]:
    """``(expert matrices whole on one rank, expert matrices)`` of a planned group."""
    whole = total = 0
    for t in specs:
        matrix = expert_matrix(t.name, t.shape)
        if matrix is None:
            continue
        experts, rows, row = matrix
        size, start, seg = rows * row, layout.offsets[t.name], layout.segment_size
        total += experts
        whole += sum(
            (a // seg) == ((a + size - 1) // seg)
            for a in range(start, start + experts * size, size)
        )
    return whole, total


def budget_row(shapes: ModelShapes, world: int, budget: float) -> dict:
    """What ``ExpertShardPolicy(max_extra_padding=budget)`` gives ``shapes`` at ``world``."""
    policy = ExpertShardPolicy(max_extra_padding=budget)
    extra = whole = total = 0
    elapsed = 0.0
    for group in shapes.groups:
        tensors = [(name, shape, "float32") for name, shape in group.tensors]
        t0 = time.perf_counter()
        units = policy.units_for_group(tensors, world)
        elapsed += time.perf_counter() - t0
        specs = [TensorSpec(n, s, "float32", units[n]) for n, s, _ in tensors]
        layout = plan_layout(specs, world)
        elements = plan_layout([dataclasses.replace(t, unit=1) for t in specs], world)
        extra += group.repeat * (layout.padding - elements.padding)
        w, t = whole_matrices(layout, specs)
        whole, total = whole + group.repeat * w, total + group.repeat * t
    return {
        "model": shapes.name,
        "world": world,
        "budget": budget,
        "extra_padding_pct": 100 * extra / shapes.numel,
        "whole": whole,
        "matrices": total,
        "search_s": elapsed,
    }


def budget_table(models: list[str], worlds: list[int], budgets: list[float]) -> None:
    """One line per model, expert layout and W; per budget, the expert matrices cut between
    ranks and the padding added beyond element units'."""
    head = " | ".join(f"{100 * b:g} %" for b in budgets)
    print(f"| model | experts | W | expert matrices | {head} |")
    print("|---|---|---:|---:|" + "---:|" * len(budgets))
    for model in models:
        listed = load_model(model)
        fused = fused_model(model)
        layouts = [("as listed", listed)]
        if fused.groups != listed.groups:
            layouts.append(("fused", fused))
        for form, shapes in layouts:
            for world in worlds:
                rows = [budget_row(shapes, world, b) for b in budgets]
                for r in rows:
                    print(json.dumps(r | {"experts": form}), flush=True)
                cells = " | ".join(
                    f"{r['matrices'] - r['whole']:,} cut, +{r['extra_padding_pct']:.3f} %"
                    for r in rows
                )
                print(f"| {model} | {form} | {world} | {rows[0]['matrices']:,} | {cells} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[8, 64, 256, 1024])
    parser.add_argument("--budgets", nargs="+", type=float, default=None)
    args = parser.parse_args()
    if args.budgets is not None:
        budget_table(args.models, args.worlds, args.budgets)
        return
    print(
        "| model | W | ours: total / rank (GiB) | padding ours / FSDP2 (%) | persistent / rank "
        "ours / FSDP2 (GiB) | all-gather / rank / step ours / FSDP2 (GiB) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for model in args.models:
        for world in args.worlds:
            r = row(model, world)
            print(json.dumps(r), flush=True)
            persistent = r["persistent_gib"] / r["fsdp2_persistent_gib"]
            gathered = r["all_gather_gib"] / r["fsdp2_all_gather_gib"]
            print(
                f"| {model} | {world} | {r['total_gib']:.1f} | {r['padding_pct']:.2f} / "
                f"{r['fsdp2_padding_pct']:.1f} | {r['persistent_gib']:.2f} / "
                f"{r['fsdp2_persistent_gib']:.2f} ({persistent:.2f}×) | "
                f"{r['all_gather_gib']:.1f} / {r['fsdp2_all_gather_gib']:.1f} ({gathered:.2f}×) |"
            )


if __name__ == "__main__":
    main()
