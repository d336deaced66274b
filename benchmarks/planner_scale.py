"""The planner at scale: a model zoo x W from 8 to 16,384 x units of 1, 16 and 128 rows.

The zoo's largest group is Kimi-K2's MoE layer, 1,166 tensors (385 experts); every group is
planned with every packing order, so a group's planning time covers all of them.

For every case, whole-model figures (every distinct FSDP group planned once, weighted by how
often it repeats), against the three alternatives a user has:

* the lower bound on the plan's padding (what no layout can beat);
* FSDP2's rule: each tensor's dim 0 rounded up to a multiple of W, and the tensors whose units
  its even dim-0 split cuts;
* naive concatenation (FSDP1 / DeepSpeed ZeRO-3 flat parameters): all tensors back to back and
  the buffer split evenly, so padding only at the end but units cut anywhere;

plus planning time. Outputs (``--out-dir``, default ``benchmarks/results``): ``planner_scale.jsonl``
(one JSON line per case, also printed), ``planner_scale.md`` (the summary tables, also printed)
and ``planner_scale.png`` (padding vs W per model, ours vs FSDP2).

    python benchmarks/planner_scale.py [--worlds 8 64 1024] [--rows 1 128] [--models llama3-8b]
        [--repeat 3] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from raggedfsdp.capacity import Mesh, ModelShapes, Precision, Settings, UnitPolicy, estimate
from raggedfsdp.capacity.loader import load_model
from raggedfsdp.capacity.model_shapes import parse_shapes
from raggedfsdp.sharding import Layout

WORLDS = [2**k for k in range(3, 15)]  # 8 .. 16,384
ROWS = [1, 16, 128]
SUMMARY_WORLDS = [8, 128, 1024, 16384]


def mamba2_2_7b() -> ModelShapes:
    """Mamba2-2.7B (public config: d_model 2560, 64 layers, d_state 128, headdim 64, tied
    embeddings): the 1-D-heavy member of the zoo, 6 of 9 tensors per layer are vectors and the
    depthwise conv is a (5376, 1, 4) tensor whose rows are 4 elements."""
    d, inner, state, heads, conv = 2560, 5120, 128, 80, 5376
    layer = [
        ["norm.weight", [d]],
        ["mixer.in_proj.weight", [2 * inner + 2 * state + heads, d]],
        ["mixer.conv1d.weight", [conv, 1, 4]],
        ["mixer.conv1d.bias", [conv]],
        ["mixer.dt_bias", [heads]],
        ["mixer.A_log", [heads]],
        ["mixer.D", [heads]],
        ["mixer.norm.weight", [inner]],
        ["mixer.out_proj.weight", [d, inner]],
    ]
    root = [["embeddings.weight", [50288, d]], ["norm_f.weight", [d]]]
    groups = [
        {"name": "root", "repeat": 1, "root": True, "tensors": root},
        {"name": "layer", "repeat": 64, "tensors": layer},
    ]
    return parse_shapes({"name": "mamba2-2.7b", "groups": groups}, "planner_scale.py")


def kimi_k2() -> ModelShapes:
    """Kimi-K2 (public config: DeepSeek-V3's architecture with 64 attention heads, 384 routed
    experts and one shared, 61 layers of which the first is dense, vocab 163,840): its MoE
    layer is one group of 1,166 tensors, the largest of the zoo (DeepSeek-V3's has 782)."""
    d, heads, ffn, experts = 7168, 64, 2048, 384
    attention = [
        ["self_attn.q_a_proj.weight", [1536, d]],
        ["self_attn.q_a_layernorm.weight", [1536]],
        ["self_attn.q_b_proj.weight", [heads * 192, 1536]],
        ["self_attn.kv_a_proj_with_mqa.weight", [576, d]],
        ["self_attn.kv_a_layernorm.weight", [512]],
        ["self_attn.kv_b_proj.weight", [heads * 256, 512]],
        ["self_attn.o_proj.weight", [d, heads * 128]],
        ["input_layernorm.weight", [d]],
        ["post_attention_layernorm.weight", [d]],
    ]

    def mlp(prefix: str, hidden: int) -> list:
        return [
            [f"{prefix}.gate_proj.weight", [hidden, d]],
            [f"{prefix}.up_proj.weight", [hidden, d]],
            [f"{prefix}.down_proj.weight", [d, hidden]],
        ]

    router = [["mlp.gate.weight", [experts, d]], ["mlp.gate.e_score_correction_bias", [experts]]]
    moe = [*attention, *router]
    for e in range(experts):
        moe += mlp(f"mlp.experts.{e}", ffn)
    moe += mlp("mlp.shared_experts", ffn)
    groups = [
        {
            "name": "embed",
            "repeat": 1,
            "tensors": [["embed_tokens.weight", [163840, d]]],
        },
        {"name": "dense_layer", "repeat": 1, "tensors": attention + mlp("mlp", 18432)},
        {"name": "moe_layer", "repeat": 60, "tensors": moe},
        {
            "name": "head",
            "repeat": 1,
            "tensors": [["norm.weight", [d]], ["lm_head.weight", [163840, d]]],
        },
    ]
    return parse_shapes({"name": "kimi-k2", "groups": groups}, "planner_scale.py")


def zoo() -> dict[str, ModelShapes]:
    """model_shapes.json's models, then our own additions."""
    names = [
        "llama3-8b",
        "llama3-70b",
        "llama3-405b",
        "deepseek-v3",
        "gpt-oss-120b",
        "qwen3-30b-a3b",
        "qwen2-72b",
        "qwen1.5-moe-a2.7b",
    ]
    models = {name: load_model(name) for name in names}
    models["mixtral-8x7b"] = load_model("mixtral-8x7b", experts="per-expert")
    models["mixtral-8x7b-fused"] = load_model("mixtral-8x7b", experts="fused")
    models["mamba2-2.7b"] = mamba2_2_7b()
    models["kimi-k2"] = kimi_k2()
    return models


def naive(layout: Layout) -> tuple[int, int]:
    """(padding, tensors cut) when the group's tensors are concatenated and the buffer is split
    evenly (segments aligned like the plan's)."""
    world, align = layout.world_size, layout.alignment
    seg = -(-math.ceil(layout.numel / world) // align) * align
    cut, start = 0, 0
    for t in layout.tensors:
        end = start + t.numel
        boundary = (start // seg + 1) * seg
        while boundary < end:
            if (boundary - start) % t.unit:
                cut += 1
                break
            boundary += seg
        start = end
    return world * seg - layout.numel, cut


def measure(name: str, model: ModelShapes, world: int, rows: int, repeat: int = 1) -> dict:
    """One case; with ``repeat`` > 1 the fastest of that many estimates is kept (planning is
    deterministic, only the time varies with the machine's other load)."""
    settings = Settings(
        Mesh(1, world), UnitPolicy("rows", rows), precision=Precision(master="bf16")
    )
    wall = plan_ms = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        est = estimate(model, settings)
        wall = min(wall, time.perf_counter() - t0)
        plan_ms = min(plan_ms, max(1e3 * g.layout.planning_time_s for g in est.plans))
    naive_pad = naive_cut = 0
    for plan in est.plans:
        plan.layout.check()
        pad, cut = naive(plan.layout)
        naive_pad += plan.instances * pad
        naive_cut += plan.instances * cut
    p = est.padding
    return {
        "model": name,
        "params": model.numel,
        "tensors": p["tensors"],
        "world": world,
        "unit_rows": rows,
        "padding_pct": p["pct"],
        "lower_bound_pct": p["lower_bound_pct"],
        "fsdp2_padding_pct": p["fsdp2_pct"],
        "naive_padding_pct": 100 * naive_pad / model.numel,
        "fsdp2_cut_tensors": p["fsdp2_cut_tensors"],
        "naive_cut_tensors": naive_cut,
        "max_group_plan_ms": plan_ms,
        "estimate_s": wall,
        "lcm_forced": any("LCM" in n for g in est.plans for n in g.layout.notes),
    }


def summary(rows: list[dict], worlds: list[int]) -> str:
    """Markdown: padding ours / FSDP2 at a few W; gap to the bound; cuts; planning time."""
    shown = [w for w in SUMMARY_WORLDS if w in worlds] or worlds[-4:]
    cut_w = 1024 if 1024 in worlds else worlds[-1]
    head = (
        "| model | unit rows | "
        + " | ".join(f"pad % W={w:,} ours / FSDP2" for w in shown)
        + f" | max gap to bound (pts) | cut tensors W={cut_w:,} FSDP2 / naive / ours"
        " | max plan ms per group |"
    )
    lines = [head, "|---|---:|" + "---:|" * (len(shown) + 3)]
    keys = dict.fromkeys((r["model"], r["unit_rows"]) for r in rows)
    for model, k in keys:
        mine = {r["world"]: r for r in rows if r["model"] == model and r["unit_rows"] == k}
        cells = [
            f"{mine[w]['padding_pct']:.2f} / {mine[w]['fsdp2_padding_pct']:.2f}" for w in shown
        ]
        gap = max(r["padding_pct"] - r["lower_bound_pct"] for r in mine.values())
        c = mine[cut_w]
        cuts = f"{c['fsdp2_cut_tensors']:,} / {c['naive_cut_tensors']:,} / 0 of {c['tensors']:,}"
        ms = max(r["max_group_plan_ms"] for r in mine.values())
        lines.append(
            f"| {model} | {k} | " + " | ".join(cells) + f" | {gap:.2f} | {cuts} | {ms:.0f} |"
        )
    return "\n".join(lines)


def totals(rows: list[dict]) -> dict:
    """Headline figures over every case."""
    low = [r for r in rows if r["lower_bound_pct"] < 1]
    return {
        "cases": len(rows),
        "plan_at_bound": sum(r["padding_pct"] - r["lower_bound_pct"] < 1e-9 for r in rows),
        "max_gap_pts_where_bound_lt_1pct": max(
            (r["padding_pct"] - r["lower_bound_pct"] for r in low), default=0.0
        ),
        "max_group_plan_ms": max(r["max_group_plan_ms"] for r in rows),
        "fsdp2_cut_cases": sum(r["fsdp2_cut_tensors"] > 0 for r in rows),
        "naive_cut_cases": sum(r["naive_cut_tensors"] > 0 for r in rows),
        "ours_below_fsdp2": sum(r["padding_pct"] < r["fsdp2_padding_pct"] for r in rows),
        "ours_above_fsdp2": sum(r["padding_pct"] > r["fsdp2_padding_pct"] for r in rows),
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    cols = 4
    fig, axes = plt.subplots(
        -(-len(models) // cols),
        cols,
        figsize=(4 * cols, 3.2 * -(-len(models) // cols)),
        squeeze=False,
        sharex=True,
    )
    units = sorted({r["unit_rows"] for r in rows})
    for ax, model in zip(axes.flat, models, strict=False):
        mine = [r for r in rows if r["model"] == model]
        for k, color in zip(units, ("tab:blue", "tab:orange", "tab:green"), strict=False):
            pts = sorted((r["world"], r["padding_pct"]) for r in mine if r["unit_rows"] == k)
            ax.plot(*zip(*pts, strict=True), "o-", color=color, ms=3, label=f"ours, {k} rows")
        fsdp2 = sorted({(r["world"], r["fsdp2_padding_pct"]) for r in mine})
        ax.plot(*zip(*fsdp2, strict=True), "s--", color="black", ms=3, label="FSDP2")
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set_ylim(bottom=0)
        ax.set_title(model, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.flat[len(models) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("W (shard group size)")
    for ax in axes[:, 0]:
        ax.set_ylabel("padding % of params")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Padding vs W: raggedfsdp's plan (units of 1/16/128 rows, never cut) vs FSDP2")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=WORLDS)
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--models", nargs="+", help="subset of the zoo (default: all)")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--repeat", type=int, default=1, help="keep the fastest of this many plans per case"
    )
    args = parser.parse_args()
    models = zoo()
    if args.models:
        unknown = sorted(set(args.models) - set(models))
        if unknown:
            parser.error(f"unknown models {unknown}; the zoo has {sorted(models)}")
        models = {n: models[n] for n in args.models}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    with open(args.out_dir / "planner_scale.jsonl", "w") as jsonl:
        for name, model in models.items():
            for world in args.worlds:
                for k in args.rows:
                    row = measure(name, model, world, k, args.repeat)
                    rows.append(row)
                    line = json.dumps(row)
                    print(line, flush=True)
                    jsonl.write(line + "\n")
    table = summary(rows, args.worlds)
    head = totals(rows) | {"wall_s": time.perf_counter() - t0}
    (args.out_dir / "planner_scale.md").write_text(table + "\n\n" + json.dumps(head) + "\n")
    plot(rows, args.out_dir / "planner_scale.png")
    print("\n" + table + "\n")
    print(json.dumps({"summary": head}))


if __name__ == "__main__":
    main()
