"""Long run: the tiny recipe for many steps, twice with the same seed.

Checks what a weeks-long job needs: memory that does not creep (each rank's resident set sampled
once a second from /proc; growth after warm-up must stay within noise) and determinism (the two
runs' per-step losses must be bitwise identical).

    python benchmarks/long_run.py [--steps 1000] [--nproc 2] [--out runs/long]

Prints one JSON line and a short report; exits non-zero if either check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _workers(parent: int) -> list[int]:
    """The training processes: children of the torchrun agent."""
    try:
        out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True)
    except OSError:
        return []
    return [int(p) for p in out.stdout.split()]


def run_once(run_dir: Path, steps: int, nproc: int) -> tuple[list[float], list[list[float]]]:
    """One training run; returns (losses per step, RSS samples per rank in MiB)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    launch = f"--nnodes 1 --nproc-per-node {nproc} --rdzv-backend c10d --local-addr 127.0.0.1"
    launch += " --rdzv-endpoint 127.0.0.1:0"  # the agent binds a free port itself: no race
    train = f"--steps {steps} --wandb-mode disabled --checkpoint-every 0 --resume never"
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", *launch.split()),
        *("-m", "recipes.llama.train", *train.split(), "--run-dir", str(run_dir)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    samples: dict[int, list[float]] = {}
    while agent.poll() is None:
        for pid in _workers(agent.pid):
            rss = _rss_mib(pid)
            if rss is not None:
                samples.setdefault(pid, []).append(rss)
        time.sleep(1.0)
    if agent.returncode != 0:
        raise SystemExit(f"training run failed with exit code {agent.returncode}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    return losses, list(samples.values())


def growth_after_warmup(series: list[float], warmup_fraction: float = 0.2) -> float:
    """MiB between the median of the samples just after warm-up and of the last ones."""
    if len(series) < 10:
        return 0.0
    start = int(len(series) * warmup_fraction)
    window = max(3, len(series) // 10)
    first = sorted(series[start : start + window])[window // 2]
    last = sorted(series[-window:])[window // 2]
    return last - first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "long")
    parser.add_argument("--max-growth-mib", type=float, default=8.0)
    args = parser.parse_args()
    t0 = time.time()
    a_losses, a_rss = run_once(args.out / "a", args.steps, args.nproc)
    b_losses, b_rss = run_once(args.out / "b", args.steps, args.nproc)
    growth = [growth_after_warmup(s) for s in a_rss + b_rss]
    identical = a_losses == b_losses and len(a_losses) == args.steps
    result = {
        "benchmark": "long_run",
        "steps": args.steps,
        "nproc": args.nproc,
        "losses_bitwise_identical": identical,
        "final_loss": a_losses[-1] if a_losses else None,
        "rss_growth_after_warmup_mib": growth,
        "rss_final_mib": [s[-1] for s in a_rss + b_rss if s],
        "wall_s": time.time() - t0,
    }
    print(json.dumps(result))
    ok = identical and max(growth, default=0.0) <= args.max_growth_mib
    print(
        f"{args.steps} steps x 2 runs at {args.nproc} processes: losses bitwise identical: "
        f"{identical}; RSS growth after warm-up per rank: "
        f"{', '.join(f'{g:+.1f}' for g in growth)} MiB (limit {args.max_growth_mib}); "
        f"{'OK' if ok else 'FAILED'}"
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
