"""Pretrain a LLaMA-style model with raggedfsdp. Run it with torchrun (see recipes/README.md):

    torchrun --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \\
        --local-addr 127.0.0.1 -m recipes.llama.train --steps 200 --wandb-mode offline

Every rank builds the same model from the same seed, wraps each block with ``fully_shard``
(then the root), and trains on its slice of each global batch; rank 0 logs. The loop below is
the whole recipe: schedule, gradient accumulation without communication on all micro-batches
but the last, clipping, the optimizer step, one all-reduce that both averages the loss for the
log and agrees on whether a signal asked to stop, periodic validation and checkpoints.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from recipes.llama.checkpoint import Checkpointer, CheckpointError, GracefulStop, TrainState
from recipes.llama.config import USAGE_ERROR, Config, ConfigError, parse_args, usage
from recipes.llama.data import (
    DEFAULT_DATA_DIR,
    TRAIN,
    VAL,
    Batches,
    DataError,
    TokenData,
    prepare_default,
)
from recipes.llama.metrics import RunLogger, peak_flops, peak_memory_bytes
from recipes.llama.model import flops_per_token, matmul_params
from recipes.llama.optimizers import Schedule, build_optimizer, optimizer_class, shard_policy
from recipes.llama.parallel import (
    Env,
    build_model,
    clip_gradients,
    distributed,
    failing_together,
    full_weights,
)

__all__ = ["RunResult", "main", "train", "train_step"]


@dataclass
class RunResult:
    """What ``train`` returns on every rank (the logged metrics are rank 0's files)."""

    losses: dict[int, float] = field(default_factory=dict)  # step -> mean training loss
    val_losses: dict[int, float] = field(default_factory=dict)
    resumed_from: str | None = None
    stopped_by: str | None = None  # the signal's name when a signal ended the run
    checkpoint: str | None = None  # the last checkpoint written
    wall_time_s: float = 0.0
    tokens_per_s: list[float] = field(default_factory=list)  # per step of this launch


def grad_accumulation(cfg: Config, world_size: int) -> int:
    """Micro-batches per step so that ``batch_size`` sequences are split evenly; the error
    names the values that would work."""
    per_rank, rest = divmod(cfg.batch_size, world_size)
    processes = f"{world_size} process{'es' if world_size > 1 else ''}"
    if rest:
        lower, upper = cfg.batch_size - rest, cfg.batch_size - rest + world_size
        sizes = f"{lower} or {upper}" if lower else str(upper)
        raise ConfigError(
            f"--batch-size {cfg.batch_size} cannot be split over {processes}: use a "
            f"multiple of {world_size} (e.g. --batch-size {sizes}) or another number of processes"
        )
    if per_rank % cfg.micro_batch_size:
        fits = [str(d) for d in range(1, per_rank + 1) if per_rank % d == 0]
        choices = f"{', '.join(fits[:-1])} or {fits[-1]}" if len(fits) > 1 else fits[0]
        raise ConfigError(
            f"--micro-batch-size {cfg.micro_batch_size} does not divide the {per_rank} "
            f"sequences each process gets per step (--batch-size {cfg.batch_size} over "
            f"{processes}): use --micro-batch-size {choices}"
        )
    return per_rank // cfg.micro_batch_size


def open_data(cfg: Config, env: Env) -> TokenData:
    """The token files; the default directory is prepared from the embedded corpus on first use
    (by each node's first process, while the others wait). A check that fails on any rank
    fails on all (a node may not see the files the others do)."""
    default = Path(cfg.data_dir) == Path(DEFAULT_DATA_DIR)
    with failing_together(DataError):
        if default and env.local_rank == 0 and not (Path(cfg.data_dir) / "meta.json").is_file():
            prepare_default(cfg.data_dir)
    with failing_together(DataError):
        data = TokenData.open(cfg.data_dir, cfg.model.vocab_size, cfg.seq_len)
    return data


def loss_fn(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def evaluate(model: nn.Module, batches: Batches, cfg: Config, env: Env, accum: int) -> float:
    """Mean loss over ``eval_batches`` fixed validation batches (the same ones every time)."""
    total = torch.zeros((), device=env.device)
    for index in range(cfg.eval_batches):
        for micro in range(accum):
            x, y = batches.local(index, env.rank, env.world_size, micro, accum)
            total += loss_fn(model, x.to(env.device), y.to(env.device))
    if cfg.fsdp == "fsdp2":  # FSDP2 keeps its root (and [norm, output]) gathered for a backward
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    dist.all_reduce(total)
    return total.item() / (cfg.eval_batches * accum * env.world_size)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Batches,
    step: int,
    cfg: Config,
    env: Env,
    accum: int,
) -> tuple[torch.Tensor, float]:
    """One optimizer step over this rank's micro-batches; returns (this rank's mean loss, the
    global gradient norm before clipping). Gradients are reduced once, on the last micro-batch:
    the others accumulate locally with no communication."""
    loss_sum = torch.zeros((), device=env.device)
    for micro in range(accum):
        x, y = batches.local(step, env.rank, env.world_size, micro, accum)
        model.set_requires_gradient_sync(micro == accum - 1)
        loss = loss_fn(model, x.to(env.device), y.to(env.device)) / accum
        loss.backward()
        loss_sum += loss.detach()
    grad_norm = clip_gradients(model, cfg)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


def train(
    cfg: Config, env: Env, on_step: Callable[[int, dict[str, Any]], None] | None = None
) -> RunResult:
    """Train to ``cfg.steps`` (from the latest checkpoint, if any); ``on_step(step, metrics)``
    runs after every step on every rank (custom logging, tests)."""
    start_time = time.perf_counter()
    accum = grad_accumulation(cfg, env.world_size)
    data = open_data(cfg, env)
    optimizer_cls = optimizer_class(cfg.optimizer, cfg.fsdp)  # fail before building anything

    # The same weights on every rank (seeded by name), sharded block by block as they are made.
    model = build_model(cfg, env, shard_policy(optimizer_cls))
    n_params = sum(p.numel() for p in model.parameters())
    n_matmul = matmul_params(model)
    optimizer = build_optimizer(model, cfg)
    schedule = Schedule(optimizer, cfg)

    data_position = {"seed": cfg.seed, "train_sha256": data.meta["sha256"]["train"]}
    checkpointer = Checkpointer(
        Path(cfg.run_dir) / "checkpoints", env, cfg.keep_checkpoints, data_position
    )
    state, resumed_from, warnings = checkpointer.resume(model, optimizer, cfg)
    result = RunResult(resumed_from=resumed_from)

    flops_token = flops_per_token(cfg.model, n_matmul, cfg.seq_len)
    peak, peak_source = peak_flops(cfg, env.device)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    info = {
        "world_size": env.world_size,
        "mesh": dict(zip(env.mesh.mesh_dim_names, env.mesh.shape, strict=True)),
        "grad_accumulation": accum,
        "n_params": n_params,
        "flops_per_token": flops_token,
        "peak_flops_per_device": peak,
        "peak_flops_source": peak_source,
        "optimizer_class": f"{optimizer_cls.__module__}.{optimizer_cls.__qualname__}",
        "train_tokens": len(data.train),
    }
    if hasattr(optimizer, "state_bytes"):  # raggedfsdp's optimizers: this rank's state memory
        info["optimizer_state_mib_rank0"] = optimizer.state_bytes().state_bytes / 2**20
    logger = RunLogger(cfg, env.is_main, state.step, info)
    for line in warnings:
        logger.write(f"warning: {line}")
    header = [
        f"{n_params / 1e6:.2f}M parameters",
        f"{env.world_size} processes {info['mesh']}",
        f"{accum} micro-batch(es) of {cfg.micro_batch_size}",
        f"{tokens_per_step} tokens/step",
        str(info["optimizer_class"]),
    ]
    if "optimizer_state_mib_rank0" in info:
        header.append(f"optimizer state {info['optimizer_state_mib_rank0']:.2f} MiB on rank 0")
    if resumed_from:
        header.append(f"resumed from {resumed_from}")
    logger.write(", ".join(header))
    if state.step >= cfg.steps:
        logger.write(
            f"{cfg.run_dir} already reached {state.step} steps (--steps {cfg.steps}): nothing to "
            "train. Raise --steps to continue, or --resume never (or another --run-dir) to start "
            "over."
        )
        logger.close(None)
        return result
    train_batches = Batches(data.train, cfg.seq_len, cfg.batch_size, cfg.seed, TRAIN)
    val_batches = Batches(data.val, cfg.seq_len, cfg.batch_size, cfg.seed, VAL)

    with GracefulStop() as stop:
        for step in range(state.step, cfg.steps):
            step_start = time.perf_counter()
            lr = schedule.apply(step)
            local_loss, grad_norm = train_step(
                model, optimizer, train_batches, step, cfg, env, accum
            )

            # One all-reduce: the loss over all ranks, and whether any rank was signalled.
            flag = torch.tensor(float(stop.requested is not None), device=env.device)
            agreed = torch.stack([local_loss, flag])
            dist.all_reduce(agreed)
            loss_value, stop_now = agreed[0].item() / env.world_size, agreed[1].item() > 0
            elapsed = time.perf_counter() - step_start
            state = TrainState(step + 1, state.tokens_seen + tokens_per_step)

            tokens_per_s = tokens_per_step / elapsed
            metrics: dict[str, Any] = {
                "step": state.step,
                "loss": loss_value,
                "grad_norm": grad_norm,
                "lr": lr,
                "tokens_per_s": tokens_per_s,
                "tokens_seen": state.tokens_seen,
                "step_time_s": elapsed,
                "peak_memory_mib": peak_memory_bytes(env.device) / 2**20,
            }
            if peak:
                metrics["mfu"] = flops_token * tokens_per_s / (peak * env.world_size)
            stats = getattr(optimizer, "last_step_stats", None) or {}  # Muon, Shampoo
            metrics.update(
                {f"optim/{k}": v for k, v in stats.items() if isinstance(v, int | float)}
            )
            last = state.step == cfg.steps
            if cfg.eval_every and (state.step % cfg.eval_every == 0 or last):
                metrics["val_loss"] = evaluate(model, val_batches, cfg, env, accum)
                result.val_losses[state.step] = metrics["val_loss"]
            logger.log(metrics)
            result.losses[state.step] = loss_value
            result.tokens_per_s.append(tokens_per_s)

            periodic = cfg.checkpoint_every and (state.step % cfg.checkpoint_every == 0 or last)
            if periodic or stop_now:
                result.checkpoint = str(checkpointer.save(model, optimizer, state, cfg))
            if on_step is not None:
                on_step(state.step, metrics)
            if stop_now:
                result.stopped_by = stop.requested or "a signal on another rank"
                logger.write(
                    f"stopped by {result.stopped_by} after step {state.step}; checkpoint "
                    f"{result.checkpoint}. Run the same command again to resume."
                )
                break

    if cfg.export_weights:
        weights = full_weights(model)  # a collective: every rank takes part
        if env.is_main:
            torch.save(weights, Path(cfg.run_dir) / "model.pt")
    result.wall_time_s = time.perf_counter() - start_time
    speeds = result.tokens_per_s[1:]  # the first step of a launch warms up
    summary = {
        "steps": state.step,
        "final_loss": result.losses.get(state.step),
        "final_val_loss": result.val_losses.get(state.step),
        "wall_time_s": result.wall_time_s,
        "mean_tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
        "stopped_by": result.stopped_by,
        "checkpoint": result.checkpoint,
        "world_size": env.world_size,
        "fsdp": cfg.fsdp,
        "optimizer": cfg.optimizer,
    }
    plot = logger.close(summary)
    if plot is not None:
        print(f"loss curve: {plot}, metrics: {logger.records_path}, summary: {summary}")
    return result


def _report(err: Exception, joined: bool) -> None:
    """Print an error that ends the run once, not once per process.

    Once the ranks have joined, every error that ends the run is raised on every rank (rank 0
    decides about checkpoints, ``failing_together`` spreads data errors), so rank 0 prints it.
    Before that (bad arguments, no CUDA device) each node's first process prints it, since a
    node may lack a file the others have.
    """
    if os.environ.get("RANK" if joined else "LOCAL_RANK", "0") == "0":
        print(f"error: {err}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(
            "usage: torchrun [launcher options] -m recipes.llama.train [--config NAME|PATH] "
            "[--key value | --key=value ...]\n(or python -m recipes.llama.launch with the same "
            "options, quiet on Ctrl-C; or python -m recipes.llama.train ... for one process)"
            "\n\n" + usage()
        )
        return 0
    joined = False
    try:
        cfg = parse_args(argv)
        with distributed(cfg, agreed=(ConfigError, DataError, CheckpointError)) as env:
            joined = True
            train(cfg, env)
    except (ConfigError, DataError, CheckpointError) as err:
        _report(err, joined)
        return USAGE_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
