"""Pretrain a LLaMA-style model with raggedfsdp. Run it with torchrun (see recipes/README.md):

    torchrun --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \\
        --local-addr 127.0.0.1 -m recipes.llama.train --steps 200 --wandb-mode offline

Every rank builds the same model from the same seed, wraps each block with ``fully_shard``
(then the root), and trains on its slice of each global batch; rank 0 logs. The loop below is
the whole recipe: schedule, gradient accumulation without communication on all micro-batches
but the last, clipping, the optimizer step (then, for a MoE model, the routers' bias update),
one all-reduce that both averages the loss for the log and agrees on whether a signal asked to
stop, periodic validation and checkpoints.

Read it as nanoGPT: ``find_start`` decides where the launch starts (a finished run, the
checks, the data, the checkpoint to resume), ``set_up`` builds everything once (model,
optimizer, schedule, resumed checkpoint, logger), ``train`` is the loop (``train_step``,
``agree``, ``step_metrics``, ``evaluate``, checkpoints), and ``finish`` writes the summary and,
when the run reached ``--steps``, the marker that makes the next launch train nothing
(``run_record``).
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
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp import all_gather_bytes
from recipes.llama.checkpoint import Checkpointer, CheckpointError, GracefulStop, TrainState
from recipes.llama.checkpoint_files import step_of
from recipes.llama.config import USAGE_ERROR, Config, ConfigError, parse_args, usage
from recipes.llama.data import (
    DEFAULT_DATA_DIR,
    TRAIN,
    VAL,
    Batches,
    DataError,
    TokenData,
)
from recipes.llama.expert_parallel import take_all_to_all_bytes
from recipes.llama.metrics import (
    RunLogger,
    ep_metrics,
    peak_flops,
    peak_memory_bytes,
    router_metrics,
)
from recipes.llama.model import flops_per_token, matmul_params
from recipes.llama.model_config import MoEConfig
from recipes.llama.moe import balance_routers
from recipes.llama.optimizers import (
    CHOICES,
    Schedule,
    build_optimizer,
    optimizer_class,
    shard_policy,
)
from recipes.llama.parallel import (
    Env,
    build_model,
    clip_gradients,
    distributed,
    failing_together,
    full_weights,
    set_threads,
)
from recipes.llama.pipeline import Pipeline, build_pipeline, pipeline_evaluate, pipeline_step
from recipes.llama.pipeline_checks import microbatches
from recipes.llama.prepare import prepare_default
from recipes.llama.run_record import Finished, clear_finished, mark_finished, read_finished
from recipes.llama.tensor_parallel import loss_context

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


def grad_accumulation(cfg: Config, dp_size: int, tp: int = 1) -> int:
    """Micro-batches per step so that ``batch_size`` sequences are split evenly over the
    ``dp_size`` data-parallel ranks (the processes, or processes / ``tp`` under tensor
    parallelism, whose TP ranks share their rows); the error names the values that would work."""
    per_rank, rest = divmod(cfg.batch_size, dp_size)
    processes = f"{dp_size} process{'es' if dp_size > 1 else ''}"
    if tp > 1:
        processes = f"{dp_size} data-parallel rank{'s' if dp_size > 1 else ''} (--tp {tp})"
    if rest:
        lower, upper = cfg.batch_size - rest, cfg.batch_size - rest + dp_size
        sizes = f"{lower} or {upper}" if lower else str(upper)
        raise ConfigError(
            f"--batch-size {cfg.batch_size} cannot be split over {processes}: use a "
            f"multiple of {dp_size} (e.g. --batch-size {sizes}) or another number of processes"
        )
    if per_rank % cfg.micro_batch_size:
        fits = [str(d) for d in range(1, per_rank + 1) if per_rank % d == 0]
        choices = f"{', '.join(fits[:-1])} or {fits[-1]}" if len(fits) > 1 else fits[0]
        raise ConfigError(
            f"--micro-batch-size {cfg.micro_batch_size} does not divide the {per_rank} "
            f"sequences each {'data-parallel rank' if tp > 1 else 'process'} gets per step "
            f"(--batch-size {cfg.batch_size} over {processes}): use --micro-batch-size {choices}"
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
    """The mean cross-entropy over the tokens, a plain tensor. With ``--loss-parallel`` the
    logits are vocabulary-sharded DTensors: call it, and the loss's backward, under
    ``loss_context``; the replicated DTensor loss comes back as its local value (the same on
    every TP rank), whose backward hands DTensor the replicated gradient it expects."""
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return loss.to_local() if isinstance(loss, DTensor) else loss


@torch.no_grad()
def evaluate(model: nn.Module, batches: Batches, cfg: Config, env: Env, accum: int) -> float:
    """Mean loss over ``eval_batches`` fixed validation batches (the same ones every time), in
    eval mode so that MoE routers do not count validation tokens towards balancing."""
    model.eval()
    total = torch.zeros((), device=env.device)
    for index in range(cfg.eval_batches):
        for micro in range(accum):
            x, y = batches.local(index, env.dp_rank, env.dp_size, micro, accum)
            with loss_context(cfg.loss_parallel):
                total += loss_fn(model, x.to(env.device), y.to(env.device))
    if cfg.fsdp == "fsdp2":  # FSDP2 keeps its root (and [norm, output]) gathered for a backward
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    model.train()
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
) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """One optimizer step over this rank's micro-batches; returns (this rank's mean loss, the
    global gradient norm before clipping, the MoE blocks' global tokens per expert). Gradients
    are reduced once, on the last micro-batch: the others accumulate locally with no
    communication.

    A MoE model's routers are balanced after the optimizer step (DeepSeek-V3's auxiliary-loss-
    free bias, ``moe.balance_routers``): the bias is a buffer, not a parameter, so no optimizer
    or gradient reduction touches it; it stays identical on every rank because the update is
    computed from the token counts summed over all ranks (one all-reduce per step)."""
    loss_sum = torch.zeros((), device=env.device)
    for micro in range(accum):
        x, y = batches.local(step, env.dp_rank, env.dp_size, micro, accum)
        model.set_requires_gradient_sync(micro == accum - 1)
        with loss_context(cfg.loss_parallel):  # forward and backward, as torchtitan's
            loss = loss_fn(model, x.to(env.device), y.to(env.device)) / accum
            loss.backward()
        loss_sum += loss.detach()
    grad_norm = clip_gradients(model, cfg)
    try:
        optimizer.step()
    except NotImplementedError as err:  # it refuses these parameters (e.g. tensor-parallel ones)
        raise ConfigError(f"--optimizer {cfg.optimizer}: {err}") from err
    optimizer.zero_grad(set_to_none=True)
    rate = cfg.model.bias_update_rate if isinstance(cfg.model, MoEConfig) else 0.0
    loads = balance_routers(model, rate)  # {} for a dense model: no communication
    return loss_sum, grad_norm, loads


@dataclass
class Start:
    """Where a launch starts, decided before the model is built (so a launch that has nothing
    to train, or may not continue, builds and loads nothing): the micro-batches per step, the
    checked data, the optimizer class, and the checkpoint to resume, verified but not loaded."""

    accum: int
    data: TokenData
    optimizer_cls: type[torch.optim.Optimizer]
    checkpointer: Checkpointer
    checkpoint: Path | None
    meta: dict[str, Any] | None  # the checkpoint's marker
    warnings: list[str]

    @property
    def step(self) -> int:
        return int(self.meta["step"]) if self.meta else 0


def find_start(cfg: Config, env: Env) -> Start | str:
    """Where this launch starts, or the one line saying it has nothing to train; collective.

    A finished run (``run_record``) of this model and optimizer answers before anything is
    read; otherwise the configuration checks, the data, and the checkpoint ``--resume`` names
    (refused if it is of another model or optimizer), in that order. A finished run continues
    past its last step only from a checkpoint of that step (CheckpointError otherwise)."""
    finished = read_finished(Path(cfg.run_dir)) if cfg.resume == "auto" else None
    if finished is not None and finished.same_run(cfg) and finished.step >= cfg.steps:
        return finished.nothing_to_train(cfg.run_dir, cfg.steps)
    if cfg.pp > 1:  # the schedule's microbatches per step
        accum = microbatches(cfg, env.dp_size)
    else:
        accum = grad_accumulation(cfg, env.dp_size, cfg.tp)
    data = open_data(cfg, env)
    optimizer_cls = optimizer_class(cfg.optimizer, cfg.fsdp)  # fail before building anything
    data_position = {"seed": cfg.seed, "train_sha256": data.meta["sha256"]["train"]}
    checkpointer = Checkpointer(
        Path(cfg.run_dir) / "checkpoints", env, cfg.keep_checkpoints, data_position
    )
    path, meta, warnings = checkpointer.find(cfg.resume)
    if path is not None and meta is not None:
        checkpointer.check_compatible(path, meta, cfg)
    start = Start(accum, data, optimizer_cls, checkpointer, path, meta, warnings)
    if finished is not None:
        damaged = any(step_of(bad) == finished.step for bad in checkpointer.bad)
        finished.check_continues(cfg.run_dir, cfg.steps, path, start.step, damaged)
    if start.step >= cfg.steps:
        return (
            f"{path} is at step {start.step} (--steps {cfg.steps}): nothing to train. Raise "
            "--steps to continue, or --resume never (or another --run-dir) to start over."
        )
    return start


@dataclass
class Run:
    """Everything the loop needs, built once by ``set_up`` (the nanoGPT preamble as a value)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    checkpointer: Checkpointer
    logger: RunLogger
    train_batches: Batches
    val_batches: Batches
    accum: int  # micro-batches per step
    state: TrainState  # where this launch starts (0, or the resumed checkpoint's step)
    resumed_from: str | None
    tokens_per_step: int
    flops_per_token: float
    peak_flops: float | None  # per device; None when unknown (no MFU then)
    pipeline: Pipeline | None = None  # --pp above 1: this rank's stages and the schedule


def set_up(cfg: Config, env: Env, start: Start, threads: str) -> Run:
    """Model, optimizer, schedule, the resumed checkpoint (if any) and the logger, in that
    order, from ``start``; ``threads`` is the banner's note on the thread count."""
    # The same weights on every rank (seeded by name), sharded block by block as they are made.
    layout = CHOICES[cfg.optimizer].layout(cfg) if cfg.fsdp == "raggedfsdp" else {}
    policy = shard_policy(start.optimizer_cls, cfg.whole_experts, **layout)
    pipeline = build_pipeline(cfg, env, policy, start.accum) if cfg.pp > 1 else None
    if pipeline is not None:  # this rank's stages, under the full model's names
        model, n_params, n_matmul = pipeline.model, pipeline.n_params, pipeline.n_matmul
    else:
        model = build_model(cfg, env, policy)
        n_params = sum(p.numel() for p in model.parameters())
        n_matmul = matmul_params(model)
    optimizer = build_optimizer(model, cfg, env.mesh if pipeline is not None else None)
    schedule = Schedule(optimizer, cfg)

    state, warnings = TrainState(), list(start.warnings)
    if start.checkpoint is not None and start.meta is not None:
        state, more = start.checkpointer.load(start.checkpoint, start.meta, model, optimizer, cfg)
        warnings += more
    resumed_from = None if start.checkpoint is None else str(start.checkpoint)

    flops_token = flops_per_token(cfg.model, n_matmul, cfg.seq_len)
    peak, peak_source = peak_flops(cfg, env.device)
    cls = start.optimizer_cls
    info = {
        "world_size": env.world_size,
        "mesh": env.mesh_shape(),
        "grad_accumulation": start.accum,
        "micro_batch_size": cfg.batch_size // (env.dp_size * start.accum),
        "n_params": n_params,
        "flops_per_token": flops_token,
        "peak_flops_per_device": peak,
        "peak_flops_source": peak_source,
        "optimizer_class": f"{cls.__module__}.{cls.__qualname__}",
        "all_gather": all_gather_format(cfg),
        "threads": threads,
        "train_tokens": len(start.data.train),
    }
    if hasattr(optimizer, "state_bytes"):  # raggedfsdp's optimizers: this rank's state memory
        info["optimizer_state_mib_rank0"] = optimizer.state_bytes().state_bytes / 2**20
    logger = RunLogger(cfg, env.is_main, state.step, info)
    for line in warnings:
        logger.write(f"warning: {line}")
    logger.write(_header(cfg, info, resumed_from))
    data = start.data
    return Run(
        model=model,
        optimizer=optimizer,
        schedule=schedule,
        checkpointer=start.checkpointer,
        logger=logger,
        train_batches=Batches(data.train, cfg.seq_len, cfg.batch_size, cfg.seed, TRAIN),
        val_batches=Batches(data.val, cfg.seq_len, cfg.batch_size, cfg.seed, VAL),
        accum=start.accum,
        state=state,
        resumed_from=resumed_from,
        tokens_per_step=cfg.batch_size * cfg.seq_len,
        flops_per_token=flops_token,
        peak_flops=peak,
        pipeline=pipeline,
    )


def all_gather_format(cfg: Config) -> str:
    """What the weights travel as in the all-gathers: ``--all-gather fp8|mxfp8``, else the
    compute dtype of ``--mixed-precision`` (bf16, or fp32 without it)."""
    if cfg.all_gather != "param":
        return cfg.all_gather
    return "bf16" if cfg.mixed_precision == "bf16" else "fp32"


def _header(cfg: Config, info: dict[str, Any], resumed_from: str | None) -> str:
    """The one line that says what this launch trains, before the progress bar starts."""
    header = [
        f"{info['n_params'] / 1e6:.2f}M parameters",
        f"{info['world_size']} processes {info['mesh']}",
        f"{info['grad_accumulation']} micro-batch(es) of {info['micro_batch_size']}",
        f"{cfg.batch_size * cfg.seq_len} tokens/step",
        str(info["optimizer_class"]),
        f"all-gather {info['all_gather']}",
    ]
    if "optimizer_state_mib_rank0" in info:
        header.append(f"optimizer state {info['optimizer_state_mib_rank0']:.2f} MiB on rank 0")
    header.append(str(info["threads"]))
    if resumed_from:
        header.append(f"resumed from {resumed_from}")
    return ", ".join(header)


def agree(local_loss: torch.Tensor, stop_requested: str | None, env: Env) -> tuple[float, bool]:
    """One all-reduce for two answers: the loss averaged over all ranks (for the log), and
    whether any rank was signalled to stop (so that all ranks save and stop together)."""
    flag = torch.tensor(float(stop_requested is not None), device=env.device)
    agreed = torch.stack([local_loss, flag])
    dist.all_reduce(agreed)
    return agreed[0].item() / env.world_size, agreed[1].item() > 0


def step_metrics(
    run: Run,
    cfg: Config,
    env: Env,
    state: TrainState,
    elapsed: float,
    loss: float,
    grad_norm: float,
    lr: float,
    gathered: int,
    loads: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """The logged record of one step (``val_loss`` is added on evaluation steps). ``gathered``
    is the bytes this rank all-gathered in the step (raggedfsdp counts them; FSDP2 does not),
    ``loads`` the MoE blocks' tokens per expert ({} for a dense model)."""
    tokens_per_s = run.tokens_per_step / elapsed
    metrics: dict[str, Any] = {
        "step": state.step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "tokens_per_s": tokens_per_s,
        "tokens_seen": state.tokens_seen,
        "step_time_s": elapsed,
        "peak_memory_mib": peak_memory_bytes(env.device) / 2**20,
    }
    if cfg.fsdp == "raggedfsdp":
        metrics["all_gather_mib"] = gathered / 2**20
    if run.peak_flops:
        metrics["mfu"] = run.flops_per_token * tokens_per_s / (run.peak_flops * env.world_size)
    metrics.update(router_metrics(loads))  # MoE: load balance, dropped tokens
    metrics.update(ep_metrics(loads, cfg.ep, take_all_to_all_bytes(run.model)))  # --ep
    stats = getattr(run.optimizer, "last_step_stats", None) or {}  # Muon, Shampoo
    metrics.update({f"optim/{k}": v for k, v in stats.items() if isinstance(v, int | float)})
    return metrics


def _due(every: int, step: int, last: bool) -> bool:
    """Whether a periodic action (``--eval-every``, ``--checkpoint-every``; 0 turns it off)
    runs after ``step``: on its multiples, and after the last step so the run ends measured
    and saved."""
    return bool(every) and (step % every == 0 or last)


def train(
    cfg: Config,
    env: Env,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    threads: str | None = None,
) -> RunResult:
    """Train to ``cfg.steps`` (from the latest checkpoint, if any); ``on_step(step, metrics)``
    runs after every step on every rank (custom logging, tests). ``threads`` is
    ``parallel.set_threads``' note for the banner; None: the caller set the thread count.

    A run directory whose run finished (``run_record``) trains nothing with the same
    ``--steps`` and continues past them only from a checkpoint of its last step
    (``find_start``)."""
    start_time = time.perf_counter()
    start = find_start(cfg, env)
    if isinstance(start, str):  # nothing to train: one line, and no file is touched
        if env.is_main:
            print(start)
        return RunResult()
    threads = threads or f"threads: {torch.get_num_threads()} (set by the caller of train)"
    run = set_up(cfg, env, start, threads)
    if env.is_main:
        clear_finished(Path(cfg.run_dir))  # until this launch reaches --steps
    result = RunResult(resumed_from=run.resumed_from)
    state = run.state

    with GracefulStop() as stop:
        for step in range(state.step, cfg.steps):
            step_start = time.perf_counter()
            lr = run.schedule.apply(step)
            gathered = all_gather_bytes(run.model)
            if run.pipeline is not None:
                local_loss, grad_norm, loads = pipeline_step(
                    run.pipeline, run.optimizer, run.train_batches, step, cfg, env
                )
            else:
                local_loss, grad_norm, loads = train_step(
                    run.model, run.optimizer, run.train_batches, step, cfg, env, run.accum
                )
            gathered = all_gather_bytes(run.model) - gathered  # 0 for FSDP2 (no counter)
            loss, stop_now = agree(local_loss, stop.requested, env)
            elapsed = time.perf_counter() - step_start
            state = TrainState(step + 1, state.tokens_seen + run.tokens_per_step)
            metrics = step_metrics(
                run, cfg, env, state, elapsed, loss, grad_norm, lr, gathered, loads
            )

            last = state.step == cfg.steps
            if _due(cfg.eval_every, state.step, last):
                if run.pipeline is not None:
                    metrics["val_loss"] = pipeline_evaluate(run.pipeline, run.val_batches, cfg, env)
                else:
                    metrics["val_loss"] = evaluate(run.model, run.val_batches, cfg, env, run.accum)
                result.val_losses[state.step] = metrics["val_loss"]
            run.logger.log(metrics)
            result.losses[state.step] = loss
            result.tokens_per_s.append(metrics["tokens_per_s"])
            if _due(cfg.checkpoint_every, state.step, last) or stop_now:
                saved = run.checkpointer.save(run.model, run.optimizer, state, cfg)
                result.checkpoint = str(saved)
            if on_step is not None:
                on_step(state.step, metrics)
            if stop_now:
                result.stopped_by = stop.requested or "a signal on another rank"
                run.logger.write(
                    f"stopped by {result.stopped_by} after step {state.step}; checkpoint "
                    f"{result.checkpoint}. Run the same command again to resume."
                )
                break

    finish(run, cfg, env, state, result, start_time)
    return result


def finish(
    run: Run, cfg: Config, env: Env, state: TrainState, result: RunResult, start_time: float
) -> None:
    """After the loop: export the full weights if asked, write the summary and the loss plot."""
    if cfg.export_weights:
        weights = full_weights(run.model)  # a collective: every rank takes part
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
    plot = run.logger.close(summary)
    if env.is_main and state.step >= cfg.steps:  # the next launch trains nothing (run_record)
        mark_finished(Path(cfg.run_dir), Finished.of(cfg, state.step, result.checkpoint))
    if plot is not None:
        print(f"loss curve: {plot}, metrics: {run.logger.records_path}, summary: {summary}")


def _report(err: Exception, joined: bool) -> None:
    """Print an error that ends the run once, not once per process.

    Once the ranks have joined, every error that ends the run is raised on every rank (rank 0
    decides about checkpoints, ``failing_together`` spreads data errors), so rank 0 prints it.
    Before that (bad arguments, no CUDA device) each node's first process prints it, since a
    node may lack a file the others have.
    """
    if os.environ.get("RANK" if joined else "LOCAL_RANK", "0") == "0":
        print(f"error: {err}", file=sys.stderr)


def main(argv: list[str] | None = None, threads: str | None = None) -> int:
    """The command line (``argv``, default this process's); returns the exit status.
    ``threads``: the note of ``parallel.set_threads`` when it set this process's threads."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(
            "usage: torchrun [launcher options] -m recipes.llama.train [--config NAME|PATH] "
            "[--key value | --key=value ...]\n(or python -m recipes.llama.launch with the same "
            "options, quiet on Ctrl-C; or python -m recipes.llama.train ... for one process)"
            "\n\n" + usage()
        )
        return 0
    if any(arg.partition("=")[0].startswith("--dry-run") for arg in argv):
        from recipes.llama.dry_run import main as dry_run_main  # one rank on a fake group

        return dry_run_main(argv)
    joined = False
    try:
        cfg = parse_args(argv)
        with distributed(cfg, agreed=(ConfigError, DataError, CheckpointError)) as env:
            joined = True
            train(cfg, env, threads=threads)
    except (ConfigError, DataError, CheckpointError) as err:
        _report(err, joined)
        return USAGE_ERROR
    return 0


if __name__ == "__main__":  # this process is the recipe's: it picks the thread count
    sys.exit(main(threads=set_threads()))
