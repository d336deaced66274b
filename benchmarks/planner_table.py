"""Planner on real model layers: padding against the lower bound and against FSDP2's rule.

For each model's per-layer group (one FSDP group per transformer block), each shard-group size W
and each unit (1, 16, 128 rows), prints one JSON line per case and a markdown table:

* plan padding and the lower bound's padding (% of the group's elements),
* FSDP2's padding (dim 0 rounded up to a multiple of W per tensor) and how many tensors FSDP2's
  even split would cut through a unit,
* planning time, and whether S was forced to the LCM of several spanning units.

    python benchmarks/planner_table.py [--worlds 8 64 256 1024] [--rows 1 16 128] [--json]
"""

from __future__ import annotations

import argparse
import json
from importlib import resources

from raggedfsdp.sharding import TensorSpec, plan_layout, row_numel
from raggedfsdp.sharding.baselines import fsdp2_cuts_units, fsdp2_padding

GROUPS = [
    ("llama3-8b", "layer"),
    ("llama3-70b", "layer"),
    ("deepseek-v3", "moe_layer"),
    ("gpt-oss-120b", "layer"),
]


def load_group(model: str, group: str) -> list[tuple[str, list[int]]]:
    data = json.loads(resources.files("raggedfsdp").joinpath("data/model_shapes.json").read_text())
    spec = next(m for m in data["models"] if m["name"] == model)
    return next(g for g in spec["groups"] if g["name"] == group)["tensors"]


def measure(model: str, group: str, world: int, rows: int) -> dict:
    tensors = load_group(model, group)
    specs = [TensorSpec.rows(name, shape, "bfloat16", rows) for name, shape in tensors]
    layout = plan_layout(specs, world)
    layout.check()
    numel = layout.numel
    return {
        "model": model,
        "group": group,
        "tensors": len(specs),
        "world": world,
        "unit_rows": rows,
        "padding_pct": 100 * layout.padding / numel,
        "lower_bound_pct": 100 * layout.lower_bound_padding / numel,
        "fsdp2_padding_pct": 100 * sum(fsdp2_padding(s, world) for _, s in tensors) / numel,
        "fsdp2_cut_tensors": sum(
            fsdp2_cuts_units(s, world, rows * row_numel(s)) for _, s in tensors
        ),
        "plan_ms": 1e3 * layout.planning_time_s,
        "lcm_forced": any("LCM" in note for note in layout.notes),
        "notes": list(layout.notes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--json", action="store_true", help="print JSON lines only")
    args = parser.parse_args()
    rows = [
        measure(model, group, world, k)
        for model, group in GROUPS
        for world in args.worlds
        for k in args.rows
    ]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(
        "| model | W | unit rows | plan pad % | bound pad % | FSDP2 pad % | FSDP2 cut tensors "
        "| plan ms | LCM-forced |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|:-:|")
    for r in rows:
        print(
            f"| {r['model']} ({r['tensors']} tensors) | {r['world']} | {r['unit_rows']} "
            f"| {r['padding_pct']:.3f} | {r['lower_bound_pct']:.3f} | {r['fsdp2_padding_pct']:.3f} "
            f"| {r['fsdp2_cut_tensors']} | {r['plan_ms']:.1f} "
            f"| {'yes' if r['lcm_forced'] else ''} |"
        )
    print(
        json.dumps(
            {
                "summary": {
                    "cases": len(rows),
                    "max_plan_ms": max(r["plan_ms"] for r in rows),
                    "max_excess_over_bound_pts_where_bound_lt_1pct": max(
                        (
                            r["padding_pct"] - r["lower_bound_pct"]
                            for r in rows
                            if r["lower_bound_pct"] < 1
                        ),
                        default=0.0,
                    ),
                }
            }
        )
    )


if __name__ == "__main__":
    main()
