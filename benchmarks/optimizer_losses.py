"""Loss at equal steps for AdamW, Muon, Shampoo (Adam-grafted) and SOAP on the recipe's tiny LLaMA.

Each optimizer trains the recipe's default model (0.80M parameters, 4 blocks, byte-level data)
for the same steps, batch, schedule (linear warmup then cosine) and seed, at its documented
learning rate: the recipe's ``lr`` (3e-3) for AdamW, for Shampoo (Adam grafting sets its step
size, so Adam's lr carries over) and for SOAP (Adam in Shampoo's eigenbasis; 3e-3 is also the
SOAP authors' default), and ``muon_lr`` (0.02) for Muon's matrices with AdamW at ``lr`` for the
rest. One process each, one thread, one after the other (``python -m recipes.llama.train``).

It writes ``benchmarks/results/optimizer_losses.png`` (the training-loss curves) and prints, per
optimizer, the final training loss (mean of the last 10 steps), the final validation loss and
the median step time.

    python benchmarks/optimizer_losses.py [--steps 100] [--optimizers adamw muon shampoo soap]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from recipe_runs import train_recipe

RESULTS = Path(__file__).parent / "results"
LABELS = {
    "adamw": "AdamW (lr 3e-3)",
    "muon": "Muon (matrices 0.02, rest AdamW 3e-3)",
    "shampoo": "Shampoo, Adam-grafted (lr 3e-3)",
    "soap": "SOAP (lr 3e-3)",
}


def summary(records: list[dict]) -> dict[str, float]:
    losses = [r["loss"] for r in records]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    return {
        "final_loss": statistics.mean(losses[-10:]),
        "final_val_loss": vals[-1] if vals else float("nan"),
        "step_ms": 1e3 * statistics.median(r["step_time_s"] for r in records[1:]),
    }


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, records in curves.items():
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], label=LABELS[name])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title("Tiny LLaMA (0.80M), same data, schedule and seed")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--optimizers", nargs="+", default=list(LABELS), choices=list(LABELS))
    args = parser.parse_args()
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.optimizers:
            flags = ["--steps", str(args.steps), "--optimizer", name]
            curves[name] = train_recipe(flags, Path(tmp) / name)
    RESULTS.mkdir(exist_ok=True)
    plot(curves, RESULTS / "optimizer_losses.png")
    rows = {name: summary(records) for name, records in curves.items()}
    print(json.dumps({"benchmark": "optimizer_losses", "steps": args.steps, "results": rows}))
    print(f"{'optimizer':<40} {'final loss':>10} {'val loss':>9} {'step ms':>8}")
    for name, r in rows.items():
        print(
            f"{LABELS[name]:<40} {r['final_loss']:10.3f} {r['final_val_loss']:9.3f} "
            f"{r['step_ms']:8.1f}"
        )


if __name__ == "__main__":
    main()
