"""Loss at equal steps for AdamW, Muon, Shampoo (Adam-grafted) and SOAP on the recipe's tiny LLaMA.

Each optimizer trains the recipe's default model (0.80M parameters, 4 blocks, byte-level data)
for the same steps, batch, schedule (linear warmup then cosine) and seed. One process each, one
thread, one after the other (``python -m recipes.llama.train``).

Without ``--sweep`` each runs at its documented learning rate: the recipe's ``lr`` (3e-3) for
AdamW, Shampoo (Adam grafting sets its step size, so Adam's lr carries over) and SOAP (also the
SOAP authors' default), and ``muon_lr`` (0.02) for Muon's matrices with AdamW at ``lr`` for the
rest. With ``--sweep`` each runs at the three learning rates of ``SWEEP`` (a factor of about 3
apart), one more point beyond an edge while the best is at that edge (at most two), and the
table shows each optimizer at its best point (lowest final training loss), so it compares
optimizers rather than one shared learning rate. Muon's knob is ``muon_lr``; its AdamW groups
take AdamW's best ``lr`` of the same sweep (3e-3 when AdamW is not swept).

It writes ``benchmarks/results/optimizer_losses.png`` (the training-loss curves, each
optimizer's best run under ``--sweep``) and prints, per run, the final training loss (mean of
the last 10 steps), the final validation loss and the median step time.

    python benchmarks/optimizer_losses.py [--steps 100] [--optimizers adamw muon shampoo soap]
    python benchmarks/optimizer_losses.py --steps 100 --sweep     # 12-16 runs, ~1 min each
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from recipe_runs import train_recipe

RESULTS = Path(__file__).parent / "results"
NAMES = {"adamw": "AdamW", "muon": "Muon", "shampoo": "Shampoo, Adam-grafted", "soap": "SOAP"}
#: The documented learning rate of each optimizer (Muon: its matrices' ``muon_lr``).
DOCUMENTED = {"adamw": 3e-3, "muon": 0.02, "shampoo": 3e-3, "soap": 3e-3}
#: Three points per optimizer, about 3x apart, around its documented learning rate.
SWEEP = {
    "adamw": (1e-3, 3e-3, 1e-2),
    "muon": (0.01, 0.02, 0.05),
    "shampoo": (1e-3, 3e-3, 1e-2),
    "soap": (3e-3, 1e-2, 3e-2),
}
ADAM_LR = 3e-3  # the recipe's lr: Muon's AdamW groups when AdamW is not swept
MAX_EXTENSIONS = 2


def summary(records: list[dict]) -> dict[str, float]:
    losses = [r["loss"] for r in records]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    return {
        "final_loss": statistics.mean(losses[-10:]),
        "final_val_loss": vals[-1] if vals else float("nan"),
        "step_ms": 1e3 * statistics.median(r["step_time_s"] for r in records[1:]),
    }


def lr_flags(name: str, lr: float, adam_lr: float) -> list[str]:
    """The recipe flags that set ``name``'s swept learning rate ``lr``."""
    if name == "muon":
        return ["--muon-lr", str(lr), "--lr", str(adam_lr)]
    return ["--lr", str(lr)]


def label(name: str, lr: float, adam_lr: float) -> str:
    if name == "muon":
        return f"Muon (matrices {lr:g}, rest AdamW {adam_lr:g})"
    return f"{NAMES[name]} (lr {lr:g})"


def extend(points: list[float], best: float) -> float | None:
    """The next point beyond the edge the best sits on (the grid's outer ratio, rounded to one
    significant digit), or None."""
    if best == points[0]:
        return float(f"{points[0] * points[0] / points[1]:.0e}")
    if best == points[-1]:
        return float(f"{points[-1] * points[-1] / points[-2]:.0e}")
    return None


def sweep(name: str, steps: int, tmp: Path, adam_lr: float) -> dict[float, list[dict]]:
    """Every run of ``name``'s sweep: its three points, extended past an edge holding the best."""
    points = sorted(SWEEP[name])
    runs: dict[float, list[dict]] = {}
    for _ in range(MAX_EXTENSIONS + 1):
        for lr in points:
            if lr not in runs:
                flags = ["--steps", str(steps), "--optimizer", name, *lr_flags(name, lr, adam_lr)]
                runs[lr] = train_recipe(flags, tmp / f"{name}-{lr:g}")
        best = min(runs, key=lambda lr: summary(runs[lr])["final_loss"])
        nxt = extend(points, best)
        if nxt is None:
            break
        points = sorted([*points, nxt])
    return runs


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, records in curves.items():
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title("Tiny LLaMA (0.80M), same data, schedule and seed")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_rows(rows: list[dict]) -> None:
    print(f"{'optimizer':<46} {'final loss':>10} {'val loss':>9} {'step ms':>8}  best")
    for r in rows:
        print(
            f"{r['label']:<46} {r['final_loss']:10.3f} {r['final_val_loss']:9.3f} "
            f"{r['step_ms']:8.1f}  {'*' if r['best'] else ''}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--optimizers", nargs="+", default=list(NAMES), choices=list(NAMES))
    parser.add_argument("--sweep", action="store_true", help="best of SWEEP's lrs per optimizer")
    args = parser.parse_args()
    rows, curves = [], {}
    adam_lr = ADAM_LR
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.optimizers:
            if args.sweep:
                runs = sweep(name, args.steps, Path(tmp), adam_lr)
            else:
                flags = ["--steps", str(args.steps), "--optimizer", name]
                runs = {DOCUMENTED[name]: train_recipe(flags, Path(tmp) / name)}
            best = min(runs, key=lambda lr: summary(runs[lr])["final_loss"])
            for lr in sorted(runs):
                row = {"optimizer": name, "lr": lr, "label": label(name, lr, adam_lr)}
                rows.append(row | summary(runs[lr]) | {"best": lr == best})
            curves[label(name, best, adam_lr)] = runs[best]
            if name == "adamw" and args.sweep:
                adam_lr = best
    RESULTS.mkdir(exist_ok=True)
    plot(curves, RESULTS / "optimizer_losses.png")
    print(json.dumps({"benchmark": "optimizer_losses", "steps": args.steps, "results": rows}))
    print_rows(rows)


if __name__ == "__main__":
    main()
