"""Plot raggedfsdp / FSDP2 ratios from the JSON lines of ``moe_vs_fsdp2.py`` runs.

    python benchmarks/moe_vs_fsdp2.py ... | grep '^{' >> benchmarks/results/moe_vs_fsdp2.jsonl
    python benchmarks/plot_moe_vs_fsdp2.py [--results ...jsonl] [--out ...png] [--ep-out ...png]

One group of bars per configuration, its latest run (training step, all-gather bytes, static and
transient memory); the dashed line at 1.0 is FSDP2, the legend gives the W=4, E=6 goals of the
MoE issue. Runs with ``--ep`` (ours against FSDP2 x EP) go to a figure of their own, with the
expert-parallelism issue's goals; a figure without runs is not written.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = Path(__file__).parent / "results"
METRICS = [
    ("step", "training step", 0.7),
    ("all_gather_bytes", "all-gather bytes / step", 0.77),
    ("static_tensors", "static memory (tensor bytes)", 0.8),
    ("transient", "transient peak (resident)", 0.6),
]
#: The expert-parallelism issue's goals at W=4 against FSDP2 x EP (none for the transient).
EP_METRICS = [
    ("step", "training step", 0.85),
    ("all_gather_bytes", "all-gather bytes / step", 0.9),
    ("static_tensors", "static memory (tensor bytes)", 0.9),
    ("transient", "transient peak (resident)", None),
]


def label(run: dict) -> str:
    a = run["args"]
    ep = f" (ep {a['ep']})" if a.get("ep", 1) > 1 else ""
    text = f"W={a['world_size']}{ep}, E={a['experts']}\n{run['params'] / 1e6:.0f}M"
    text += ", bf16/fp32" if a["mixed_precision"] else ", fp32"
    text += f"\n{a['optimizer']}"
    return text + (", experts-heavy" if a.get("shared_experts") == 0 else "")


def plot_ratios(
    runs: list[dict],
    label_of: Callable[[dict], str],
    metrics: list[tuple[str, str, float | None]],
    title: str,
    out: Path,
) -> None:
    """One group of bars per run (its ``ratio`` entries), the goal of each metric in the
    legend (where it has one), FSDP2 as the dashed line at 1.0. Shared by the MoE and TP
    plots."""
    width = 0.8 / len(metrics)
    fig, ax = plt.subplots(figsize=(1.4 * len(runs) + 2, 4.8))
    for i, (key, name, goal) in enumerate(metrics):
        xs = [j + i * width for j in range(len(runs))]
        ys = [r["ratio"].get(key, 0.0) for r in runs]
        ax.bar(xs, ys, width, label=name if goal is None else f"{name} (goal ≤ {goal})")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="FSDP2")
    ticks = [j + (len(metrics) - 1) / 2 * width for j in range(len(runs))]
    ax.set_xticks(ticks, [label_of(r) for r in runs], fontsize=7)
    ax.set_ylabel("raggedfsdp / FSDP2 (lower is better)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def latest_runs(path: Path, label_of: Callable[[dict], str]) -> list[dict]:
    """The latest run of each configuration in a JSON-lines file (a rerun after a change
    replaces the older one)."""
    lines = path.read_text().splitlines()
    latest = {label_of(r): r for r in map(json.loads, filter(str.strip, lines)) if "ratio" in r}
    return list(latest.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS / "moe_vs_fsdp2.jsonl")
    parser.add_argument("--out", type=Path, default=RESULTS / "moe_vs_fsdp2.png")
    parser.add_argument("--ep-out", type=Path, default=RESULTS / "moe_ep_vs_fsdp2.png")
    args = parser.parse_args()
    runs = latest_runs(args.results, label)
    plain = [r for r in runs if r["args"].get("ep", 1) == 1]
    ep = [r for r in runs if r["args"].get("ep", 1) > 1]
    if plain:
        title = "MoE (fused experts, E not divisible by W): fully_shard vs FSDP2 (CPU, gloo)"
        plot_ratios(plain, label, METRICS, title, args.out)
    if ep:
        title = "MoE with expert parallelism: fully_shard x EP vs FSDP2 x EP (CPU, gloo)"
        plot_ratios(ep, label, EP_METRICS, title, args.ep_out)


if __name__ == "__main__":
    main()
