"""Does the block-wise FP8 all-gather change training? FP8 against bf16 against fp32, over seeds.

Each seed trains the recipe's tiny LLaMA three times on 2 ranks with the same data, schedule and
initialisation: fp32 throughout (``fp32``), bf16 compute over fp32 masters (``bf16``), and the
same with weights all-gathered as 128×128-tile FP8 (``fp8``, ``--all-gather fp8``); ``--modes``
adds ``mxfp8`` (1×32 blocks, ``--all-gather mxfp8``). Only the precision of the gathered weights
differs between ``bf16`` and the FP8 modes.

Why several seeds and an fp32 column: this model memorises its corpus by step 200, where a run's
last losses depend on the trajectory's small chaotic differences, so one pair of runs cannot
tell a 2 % effect from noise. fp32 against bf16 (a change nobody doubts) measures that noise on
the same seeds; FP8 against bf16 is read against it. Per seed and mode it reports the final
training loss (step ``--steps``), the mean of the last 20 steps and the final validation loss,
the paired FP8/bf16 and fp32/bf16 ratios, and the mean over seeds; the plot
(``results/fp8_training.png``) shows each mode's mean curve and its spread over seeds.

    python benchmarks/fp8_training.py [--seeds 0 1 2 3 4] [--steps 200]   # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import tempfile
from pathlib import Path

from recipe_runs import train_recipe

RESULTS = Path(__file__).parent / "results"
MODES = {
    "fp32": [],
    "bf16": ["--mixed-precision", "bf16"],
    "fp8": ["--mixed-precision", "bf16", "--all-gather", "fp8"],
    "mxfp8": ["--mixed-precision", "bf16", "--all-gather", "mxfp8"],
}
LAST = 20  # steps averaged in ``last_mean``


def summary(records: list[dict]) -> dict[str, float]:
    """Final loss, mean of the last ``LAST`` steps and final validation loss of one run."""
    losses = [r["loss"] for r in records]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    return {
        "final": losses[-1],
        "last_mean": statistics.mean(losses[-LAST:]),
        "val": vals[-1] if vals else float("nan"),
    }


def paired(runs: dict[int, dict[str, dict]], mode: str, metric: str) -> list[float]:
    """``mode``'s metric over bf16's on each seed, minus 1 (a relative difference)."""
    return [seed[mode][metric] / seed["bf16"][metric] - 1 for seed in runs.values()]


def plot(curves: dict[str, list[list[float]]], steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = range(1, steps + 1)
    for mode, runs in curves.items():
        by_step = list(zip(*runs, strict=True))
        (line,) = ax.plot(x, [statistics.mean(s) for s in by_step], label=f"{mode} (mean)")
        lo, hi = [min(s) for s in by_step], [max(s) for s in by_step]
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_yscale("log")
    ax.set_title(f"Tiny LLaMA, W=2: mean over {len(runs)} seeds, band = min..max")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def train_all(args: argparse.Namespace) -> tuple[dict, dict[str, list[list[float]]]]:
    """Every (seed, mode) run: summaries by seed then mode, and loss curves by mode."""
    runs: dict[int, dict[str, dict]] = {}
    curves: dict[str, list[list[float]]] = {mode: [] for mode in args.modes}
    common = ["--steps", str(args.steps), *shlex.split(args.recipe_args)]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            runs[seed] = {}
            for mode in args.modes:
                flags = [*common, "--seed", str(seed), *MODES[mode]]
                records = train_recipe(flags, Path(tmp) / f"{seed}-{mode}", args.nproc)
                runs[seed][mode] = summary(records)
                curves[mode].append([r["loss"] for r in records])
    return runs, curves


def report(runs: dict[int, dict[str, dict]], modes: list[str], steps: int) -> None:
    """One JSON line (runs, paired ratios, means over seeds), then a table."""
    metrics = ("final", "last_mean", "val")
    ratios = {m: {k: paired(runs, m, k) for k in metrics} for m in modes if m != "bf16"}
    means = {
        m: {k: statistics.mean(r[m][k] for r in runs.values()) for k in metrics} for m in modes
    }
    result = {"benchmark": "fp8_training", "steps": steps, "runs": runs}
    print(json.dumps(result | {"vs_bf16": ratios, "mean": means}))
    print(f"{'seed':<6}{'mode':<6}{'final':>8}{'last 20':>9}{'val':>8}   vs bf16 (final, val)")
    rows = [
        (seed, mode, r, by_mode["bf16"])
        for seed, by_mode in runs.items()
        for mode, r in by_mode.items()
    ]
    rows += [("mean", mode, r, means["bf16"]) for mode, r in means.items()]
    for seed, mode, r, base in rows:
        rel = (
            ""
            if mode == "bf16"
            else " ".join(f"{r[k] / base[k] - 1:+7.1%}" for k in ("final", "val"))
        )
        print(f"{seed:<6}{mode:<6}{r['final']:8.4f}{r['last_mean']:9.4f}{r['val']:8.4f}   {rel}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--modes", nargs="+", default=["fp32", "bf16", "fp8"], choices=list(MODES))
    parser.add_argument("--plot", type=Path, default=RESULTS / "fp8_training.png")
    parser.add_argument(
        "--recipe-args", default="", help='more recipe flags, one string: "--config debug"'
    )
    args = parser.parse_args()
    if "bf16" not in args.modes:
        parser.error("--modes: include bf16, the run the others are compared with")
    runs, curves = train_all(args)
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(curves, args.steps, args.plot)
    report(runs, args.modes, args.steps)


if __name__ == "__main__":
    main()
