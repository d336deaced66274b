"""What a run reports: MFU, peak memory, and rank 0's logger (tqdm, metrics.jsonl, wandb, plot).

``metrics.jsonl`` in the run directory is the record of the run: one JSON object per step of the
line its checkpoints continue, kept across resumes (a resumed run appends). A launch that starts
before the file's last row (a crash after the last checkpoint, a fallback past a corrupt one,
``--resume never`` or ``--resume PATH`` of an earlier step) trains those steps again: their old
rows move to ``metrics.superseded.jsonl`` (appended, never deleted) and the launch says so. wandb
gets the same dicts, and the loss-curve PNG is drawn from the file at the end, so it shows the
whole run.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

from recipes.llama.config import Config

__all__ = [
    "SUPERSEDED",
    "RunLogger",
    "peak_flops",
    "peak_memory_bytes",
    "plot_losses",
    "router_metrics",
]

SUPERSEDED = "metrics.superseded.jsonl"  # rows of steps a later launch trained again

# Dense bf16 tensor-core peaks (TFLOP/s) by device name; anything else: set --peak-tflops.
GPU_PEAK_TFLOPS = {"B200": 2250.0, "H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0}


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the caching allocator's peak. CPU: the process's peak resident set (VmHWM), which
    also counts the allocator's cached free memory and the torch runtime. For a tighter number,
    start the ranks with glibc's ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` at
    65536 and ``MALLOC_ARENA_MAX=1`` (freed memory then goes back to the OS) and reset VmHWM
    per step, as ``benchmarks/measure.py`` does."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS


def peak_flops(cfg: Config, device: torch.device) -> tuple[float, str]:
    """(per-device peak FLOP/s, where it came from); 0 when unknown (MFU is then not logged).

    On CPU there is no datasheet number that means anything for one process of many, so the
    peak is *measured*: dense matmuls in the compute dtype for ~0.2 s, run by every rank at
    once so the cores are shared as during training. MFU on CPU is thus relative to what this
    process can actually get out of a matmul.
    """
    if cfg.peak_tflops > 0:
        return cfg.peak_tflops * 1e12, "configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = next((v for k, v in GPU_PEAK_TFLOPS.items() if k in name), 0.0)
        return tflops * 1e12, f"{name} bf16 datasheet" if tflops else f"unknown GPU {name}"
    dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
    a = torch.randn(256, 256, dtype=dtype)
    a @ a  # warm-up
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < 0.2:
        a @ a
        count += 1
    return 2 * 256**3 * count / elapsed, f"measured {dtype} matmul on this process"


def router_metrics(loads: dict[str, torch.Tensor]) -> dict[str, float]:
    """A MoE step's load balance, from each MoE block's tokens per expert summed over ranks
    (``moe.balance_routers``' result; ``{}`` for a dense model, which logs none of these).

    ``moe/max_load``: the worst block's busiest expert over the mean load (1: every expert got
    the same tokens; E / top_k: all tokens to the same top_k experts); ``moe/mean_max_load``:
    that ratio averaged over blocks; ``moe/min_load``: the worst block's idlest expert over the
    mean (0: an expert got no token). ``moe/dropped_tokens`` is always 0: routing has no
    capacity limit, so every token reaches its top_k experts, however unbalanced.
    """
    if not loads:
        return {}
    ratios = torch.stack([load / load.mean().clamp_min(1e-12) for load in loads.values()])
    peaks = ratios.amax(dim=1)
    return {
        "moe/max_load": peaks.max().item(),
        "moe/mean_max_load": peaks.mean().item(),
        "moe/min_load": ratios.amin().item(),
        "moe/dropped_tokens": 0,
    }


def ep_metrics(loads: dict[str, torch.Tensor], ep: int, sent_bytes: int) -> dict[str, float]:
    """What ``--ep`` adds to a MoE step's record (``{}`` at ep 1 or for a dense model): the
    per-EP-rank expert load, from the same loads as ``router_metrics`` (EP rank ``r`` holds
    experts ``r * E / ep`` to ``(r + 1) * E / ep - 1``), and this rank's all-to-all traffic.

    ``moe/ep_tokens_max`` and ``moe/ep_tokens_mean``: the tokens (token-expert pairs, over all
    ranks; doubled by activation checkpointing, as the loads are) an EP rank's experts got, the
    busiest EP rank of any block and the mean over ranks and blocks; ``moe/ep_max_load``: the
    worst block's busiest EP rank over its mean (1: balanced; ``ep``: one EP rank got every
    token), the imbalance that sets the slowest EP rank's expert compute. ``all_to_all_mib``:
    the MiB this rank sent to other EP ranks in the step's dispatch and combine all-to-alls,
    forward and backward (``expert_parallel.take_all_to_all_bytes``), beside ``all_gather_mib``.
    """
    if ep == 1 or not loads:
        return {}
    per_rank = torch.stack([load.view(ep, -1).sum(1) for load in loads.values()])  # (blocks, ep)
    peaks = per_rank.amax(dim=1) / per_rank.mean(dim=1).clamp_min(1e-12)
    return {
        "moe/ep_tokens_max": per_rank.max().item(),
        "moe/ep_tokens_mean": per_rank.mean().item(),
        "moe/ep_max_load": peaks.max().item(),
        "all_to_all_mib": sent_bytes / 2**20,
    }


def plot_losses(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Training loss per step and validation loss where measured, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed (and none on a cluster node)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train")
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    # Fixed margins that fit the labels of a 7 x 4 in figure: tight_layout measured every
    # tick label's extent first, 0.2-0.3 s of a 2 s debug run.
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.92)
    fig.savefig(path, dpi=120)
    plt.close(fig)


class RunLogger:
    """Rank 0's outputs for a launch that trains from ``start_step``; on the other ranks
    (``enabled=False``) every method does nothing."""

    def __init__(self, cfg: Config, enabled: bool, start_step: int, info: dict[str, Any]) -> None:
        self.enabled, self.cfg = enabled, cfg
        self.run_dir = Path(cfg.run_dir)
        self.records_path = self.run_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        self.wandb_run = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        moved = self._continue_records(start_step)
        if cfg.wandb_mode != "disabled":
            try:
                import wandb
            except ImportError:
                raise RuntimeError(
                    "wandb is not installed: pip install wandb, or --wandb-mode disabled"
                ) from None
            self.wandb_run = wandb.init(
                project=cfg.wandb_project,
                group=self.run_dir.name,
                name=f"{self.run_dir.name}-from-{start_step}",
                dir=str(self.run_dir),
                mode=cfg.wandb_mode,
                config={**cfg.to_dict(), **info},
            )
        from tqdm import tqdm

        self.bar = tqdm(total=cfg.steps, initial=start_step, disable=not cfg.progress, unit="step")
        if moved:
            self.write(moved)

    def _continue_records(self, start_step: int) -> str | None:
        """Keep the rows up to ``start_step`` in ``metrics.jsonl``; rows past it are of steps
        this launch trains again, so they move to ``SUPERSEDED`` (appended first, then the
        file is replaced, so a crash loses no row). Returns the line saying so, or None."""
        old: list[dict[str, Any]] = []
        if self.records_path.is_file():
            old = [json.loads(line) for line in self.records_path.read_text().splitlines()]
        self.records = [r for r in old if r["step"] <= start_step]
        later = [r for r in old if r["step"] > start_step]
        if later:
            with (self.run_dir / SUPERSEDED).open("a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in later))
        tmp = self.records_path.with_name(self.records_path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        os.replace(tmp, self.records_path)
        if not later:
            return None
        first, last = later[0]["step"], later[-1]["step"]
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        return (
            f"{self.records_path}: the rows of {steps}, which this launch trains again from step "
            f"{start_step}, moved to {self.run_dir / SUPERSEDED}"
        )

    def write(self, text: str) -> None:
        """A line on the terminal that does not break the progress bar."""
        if self.enabled:
            self.bar.write(text)

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(metrics)
        with self.records_path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=metrics["step"])
        self.bar.update(1)
        self.bar.set_postfix(
            loss=f"{metrics['loss']:.3f}",
            lr=f"{metrics['lr']:.2e}",
            tok_s=f"{metrics['tokens_per_s']:.0f}",
        )

    def close(self, summary: dict[str, Any]) -> Path | None:
        """Finish wandb, write ``summary.json`` and the plot; returns the plot's path (None on
        the other ranks)."""
        if not self.enabled:
            return None
        self.bar.close()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if self.wandb_run is not None:
            self.wandb_run.summary.update(summary)
            self.wandb_run.finish()
        path = self.run_dir / "loss.png"
        title = f"{self.run_dir.name}: {self.cfg.optimizer}, {self.cfg.fsdp}"
        plot_losses(self.records, path, title)
        return path
