"""Plot fully_shard x TP / FSDP2 x TP ratios from the JSON lines of ``tp_vs_fsdp2.py`` runs.

    python benchmarks/tp_vs_fsdp2.py [--mixed-precision] [--optimizer muon] \\
        | grep '^{' >> benchmarks/results/tp_vs_fsdp2.jsonl
    python benchmarks/plot_tp_vs_fsdp2.py [--results ...jsonl] [--out ...png]

One group of bars per configuration, its latest run: training step, optimizer step, all-gather
bytes, static tensor bytes and transient peak; the dashed line at 1.0 is FSDP2 x TP (with
``torch.optim.Muon`` for the Muon rows), the legend gives the TP issue's goals at (2, 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plot_moe_vs_fsdp2 import RESULTS, latest_runs, plot_ratios

METRICS = [
    ("step", "training step", 0.9),
    ("optim", "optimizer step, Muon's", 0.5),
    ("all_gather_bytes", "all-gather bytes / step", 1.0),
    ("static_tensors", "static memory (tensor bytes)", 1.0),
    ("transient", "transient peak (resident)", 0.85),
]


def label(run: dict) -> str:
    a = run["args"]
    text = f"dp {a['world_size'] // a['tp']} x tp {a['tp']}\n{run['params'] / 1e6:.1f}M"
    text += ", bf16/fp32" if a["mixed_precision"] else ", fp32"
    return text + f"\n{a.get('optimizer', 'adamw')}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS / "tp_vs_fsdp2.jsonl")
    parser.add_argument("--out", type=Path, default=RESULTS / "tp_vs_fsdp2.png")
    args = parser.parse_args()
    title = "Tensor parallelism: fully_shard x TP vs FSDP2 x TP (CPU, gloo, loaded)"
    plot_ratios(latest_runs(args.results, label), label, METRICS, title, args.out)


if __name__ == "__main__":
    main()
