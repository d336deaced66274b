"""Scale, simulated: one rank of a 64-100,000-rank job, raggedfsdp beside FSDP2.

Each case is the recipe's dry run (``recipes.llama.dry_run``: torch's fake process group,
fake tensors, the real runtimes) of a preset as rank 0 of W, once with ``--fsdp raggedfsdp``
and once with ``--fsdp fsdp2``, one after the other in this process. Memory is live tensor
bytes (``raggedfsdp.dry_run.MemoryTally``), traffic the bytes through each collective
(``CollectiveCounter``), both for one training step of one micro-batch (the first step, so
``peak_step`` includes making the optimizer state). Set-up cases time wrapping and optimizer
construction alone (no step) at W = 1k, 10k, 100k.

FSDP2 runs with torch's AdamW: the recipe refuses FSDP2 with raggedfsdp's other optimizers,
so the AdamW8bit case compares ours (8-bit state, blocks whole) with FSDP2 + AdamW, and the
Muon case (owner-exchange all-to-all bytes) is ours alone.

    python benchmarks/scale_sim.py [--cases gpt_oss_120b@256 ...] [--runtimes raggedfsdp]
        [--out-dir DIR] [--summary]

Outputs: ``scale_sim.jsonl`` (one line per case and runtime, appended, also printed;
``--summary`` prints its tables: ours / FSDP2 in GiB per rank and the ratio), and
``scale_sim.png`` (per-rank peak and largest all-gather buffer vs W for GPT-OSS-120B).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipes.llama import dry_run  # noqa: E402
from recipes.llama.config import parse_args  # noqa: E402

MOE = ["--mixed-precision", "bf16", "--seq-len", "4096", "--micro-batch-size", "1"]


@dataclass(frozen=True)
class Case:
    """One dry run: recipe options, the world, which runtimes, and whether to train a step."""

    argv: tuple[str, ...]
    world: int
    runtimes: tuple[str, ...] = ("raggedfsdp", "fsdp2")
    steps: int = 1
    fsdp2_argv: tuple[str, ...] = ()  # FSDP2's options in place of ours where they differ


def _cases() -> dict[str, Case]:
    cases = {
        f"gpt_oss_120b@{w}": Case(("--config", "gpt_oss_120b", *MOE), w)
        for w in (64, 128, 256, 512)
    }
    cases["deepseek_v3@256"] = Case(("--config", "deepseek_v3", *MOE), 256)
    cases["llama3_70b@1024"] = Case(("--config", "llama3_70b"), 1024)
    cases["llama3_8b-adamw8bit@64"] = Case(
        ("--config", "llama3_8b", "--optimizer", "adamw8bit"),
        64,
        fsdp2_argv=("--config", "llama3_8b", "--optimizer", "adamw"),
    )
    cases["llama3_8b-muon@256"] = Case(
        ("--config", "llama3_8b", "--optimizer", "muon"), 256, runtimes=("raggedfsdp",)
    )
    for w in (1_000, 10_000, 100_000):
        cases[f"setup-llama3_8b@{w}"] = Case(("--config", "llama3_8b"), w, steps=0)
    return cases


CASES = _cases()
RUNTIMES = ("raggedfsdp", "fsdp2")


def run_case(name: str, case: Case, runtimes: tuple[str, ...] = RUNTIMES) -> list[dict]:
    """The reports of ``case``'s runtimes (those of ``runtimes``), as JSON-ready dicts."""
    rows = []
    for runtime in (r for r in case.runtimes if r in runtimes):
        argv = case.fsdp2_argv if runtime == "fsdp2" and case.fsdp2_argv else case.argv
        cfg = parse_args([*argv, "--fsdp", runtime])
        report = dry_run.run(cfg, dry_run.DryRun(0, case.world, "fake"), steps=case.steps)
        rows.append({"case": name, "optimizer_name": cfg.optimizer, **report.as_dict()})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Peak and largest all-gather buffer per rank vs W, GPT-OSS-120B, both runtimes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in (
        (axes[0], "peak", "per-rank peak (GiB)"),
        (axes[1], "largest_all_gather", "largest all-gather buffer (GiB)"),
    ):
        for runtime in ("raggedfsdp", "fsdp2"):
            points = sorted(
                (r["world_size"], r[key] / 2**30)
                for r in rows
                if r["case"].startswith("gpt_oss_120b@") and r["runtime"] == runtime
            )
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=runtime)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (W)")
        ax.set_title(f"GPT-OSS-120B, bf16: {title}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


COLUMNS = (
    ("static", "static"),
    ("peak", "peak"),
    ("largest all-gather buffer", "largest_all_gather"),
    ("all-gather / step", "all_gather"),
    ("reduce-scatter / step", "reduce_scatter"),
    ("all-to-all / step", "all_to_all"),
)


def summary(rows: list[dict]) -> str:
    """Markdown: per case, ours and FSDP2 in GiB per rank and their ratio; set-up times."""
    by_case: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault(row["case"], {})[row["runtime"]] = row
    head = "| case | optimizer | " + " | ".join(label for label, _ in COLUMNS) + " |"
    lines = [head, "|---" * (len(COLUMNS) + 2) + "|"]
    setup = ["| case | raggedfsdp set-up (s) | FSDP2 set-up (s) |", "|---|---|---|"]
    for name, runs in by_case.items():
        ours, theirs = runs.get("raggedfsdp"), runs.get("fsdp2")
        if name.startswith("setup-"):
            cells = [f"{r['setup_s']:.2f}" if r else "-" for r in (ours, theirs)]
            setup.append(f"| {name} | " + " | ".join(cells) + " |")
            continue
        optim = " / ".join(r["optimizer_name"] for r in (ours, theirs) if r)
        cells = []
        for _, key in COLUMNS:
            text = " / ".join(f"{r[key] / 2**30:.2f}" for r in (ours, theirs) if r)
            if ours and theirs and theirs[key]:
                text += f" (**{ours[key] / theirs[key]:.2f}x**)"
            cells.append(text)
        lines.append(f"| {name} | {optim} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(setup)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=list(RUNTIMES))
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--summary", action="store_true", help="print the tables of the saved results; run none"
    )
    args = parser.parse_args(argv)
    out = args.out_dir / "scale_sim.jsonl"
    if args.summary:
        print(summary([json.loads(line) for line in out.read_text().splitlines()]))
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with out.open("a") as sink:
        for name in args.cases:
            for row in run_case(name, CASES[name], tuple(args.runtimes)):
                line = json.dumps(row)
                print(line, flush=True)
                sink.write(line + "\n")
                sink.flush()
                rows.append(row)
    plot(
        [json.loads(line) for line in out.read_text().splitlines()], args.out_dir / "scale_sim.png"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
