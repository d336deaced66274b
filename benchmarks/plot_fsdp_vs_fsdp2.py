"""Plot raggedfsdp / FSDP2 ratios from the JSON lines of ``fsdp_vs_fsdp2.py`` runs.

    python benchmarks/fsdp_vs_fsdp2.py ... | grep '^{' >> benchmarks/results/fsdp_vs_fsdp2.jsonl
    python benchmarks/plot_fsdp_vs_fsdp2.py [--results ...jsonl] [--out ...png]

One group of bars per configuration (unshard+reshard, training step, peak resident memory,
peak allocated tensor bytes); the dashed line at 1.0 is FSDP2, the legend gives the goals of
the fully_shard issue; a black tick on the memory bar marks the bound, the lowest peak ratio
any FSDP can reach with that configuration's wrapping.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = Path(__file__).parent / "results"
METRICS = [
    ("unshard_reshard", "unshard+reshard", 0.8),
    ("step", "training step", 0.9),
    ("peak_memory", "peak resident memory", 0.85),
    ("peak_allocated", "peak allocated (GPU-like view)", 0.85),
]


def label(run: dict) -> str:
    a = run["args"]
    text = f"W={a['world_size']}, {run['params'] / 1e6:.0f}M"
    text += "\nbf16/fp32" if a.get("mixed_precision") else "\nfp32"
    text += ", AC" if a.get("activation_checkpointing") else ""
    return text + (", titan" if a.get("wrap") == "torchtitan" else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS / "fsdp_vs_fsdp2.jsonl")
    parser.add_argument("--out", type=Path, default=RESULTS / "fsdp_vs_fsdp2.png")
    args = parser.parse_args()
    runs = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    width = 0.8 / len(METRICS)
    fig, ax = plt.subplots(figsize=(1.3 * len(runs) + 2, 4.5))
    for i, (key, name, goal) in enumerate(METRICS):
        xs = [j + i * width for j in range(len(runs))]
        ax.bar(xs, [r["ratio"][key] for r in runs], width, label=f"{name} (goal ≤ {goal})")
    memory = next(i for i, (key, _, _) in enumerate(METRICS) if key == "peak_memory")
    bounds = [r["ratio"].get("bound_peak_memory") for r in runs]
    xs = [j + memory * width for j, b in enumerate(bounds) if b is not None]
    ax.scatter(
        xs,
        [b for b in bounds if b is not None],
        marker="_",
        s=300,
        color="black",
        label="lowest peak any FSDP can reach (bound)",
        zorder=3,
    )
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="FSDP2")
    ax.set_xticks([j + width for j in range(len(runs))], [label(r) for r in runs], fontsize=7)
    ax.set_ylabel("raggedfsdp / FSDP2 (lower is better)")
    ax.set_title("fully_shard vs PyTorch FSDP2, same process run (CPU, gloo)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
