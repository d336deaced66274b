"""The pretraining recipe's tokens/s on raggedfsdp beside the same run on PyTorch FSDP2.

``make run``'s job (the tiny LLaMA, 2 gloo ranks, ``raggedfsdp.optim.AdamW`` on ours; with
``--fsdp fsdp2`` FSDP2 and ``torch.optim.AdamW``) launched as a user launches it, in
alternating pairs (ours first in odd pairs, FSDP2 first in even ones, so a drift in the
machine's load falls on both). Each run's
figure is the median of its per-step tokens/s after ``--warmup`` steps (the first steps pay for
lazy set-up); each pair gives a ratio ours / FSDP2 (higher is better), and the report is the
median of the pairs' ratios, with both runs' final losses.

    python benchmarks/recipe_vs_fsdp2.py [--pairs 3] [--steps 100] [--warmup 5] [-- recipe flags]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from recipe_runs import train_recipe

SYSTEMS = ("raggedfsdp", "fsdp2")


def run_speed(records: list[dict], warmup: int) -> float:
    """The median tokens/s of a run's steps after the first ``warmup``."""
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][warmup:]
    return statistics.median(speeds)


def final_loss(records: list[dict]) -> float:
    return [r["loss"] for r in records if "loss" in r][-1]


def summarize(pairs: list[dict[str, list[dict]]], warmup: int) -> dict:
    """Per pair the two runs' speeds, final losses and the speed ratio; overall the median
    ratio."""
    rows = []
    for pair in pairs:
        speed = {system: run_speed(pair[system], warmup) for system in SYSTEMS}
        loss = {system: final_loss(pair[system]) for system in SYSTEMS}
        ratio = speed["raggedfsdp"] / speed["fsdp2"]
        rows.append({"tokens_per_s": speed, "final_loss": loss, "ratio": ratio})
    return {"pairs": rows, "ratio": statistics.median(row["ratio"] for row in rows)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs of runs")
    parser.add_argument("--steps", type=int, default=100, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of timing")
    parser.add_argument("recipe", nargs="*", help="extra recipe flags, after --")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs {args.pairs}: run at least one pair")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup}: must be >= 0 and below --steps {args.steps}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
            flags = {s: ["--steps", str(args.steps), "--fsdp", s, *args.recipe] for s in SYSTEMS}
            pairs.append(
                {s: train_recipe(flags[s], Path(tmp) / f"{s}-{i}", nproc=2) for s in order}
            )
    result = summarize(pairs, args.warmup)
    print(json.dumps({"benchmark": "recipe_vs_fsdp2", "args": vars(args), **result}))
    for i, row in enumerate(result["pairs"]):
        speed = row["tokens_per_s"]
        print(
            f"pair {i}: raggedfsdp {speed['raggedfsdp']:.0f} tokens/s, FSDP2 "
            f"{speed['fsdp2']:.0f} tokens/s, ratio {row['ratio']:.2f}; final losses "
            f"{row['final_loss']['raggedfsdp']:.6f} / {row['final_loss']['fsdp2']:.6f}"
        )
    print(f"median ratio (ours / FSDP2 tokens/s): {result['ratio']:.2f}")


if __name__ == "__main__":
    main()
