"""The rules of ``--pp``, torch-free: which runs pipeline parallelism can take, how many
microbatches a step has, and the one-line refusals (naming the flag and the fix) for the rest.

They live apart from ``pipeline`` (the stages and the step) so that ``config`` can check the
command line and ``parallel`` the world size before any process group or model exists, with
no import cycle.
"""

from __future__ import annotations

from typing import Protocol

from recipes.llama.model_config import ConfigError, ModelConfig, MoEConfig

__all__ = ["check_pp", "check_pp_world", "microbatches", "stage_count"]


class Config(Protocol):
    """The fields of ``config.Config`` these rules read (a protocol: ``config`` imports this
    module, so it cannot import ``config``)."""

    model: ModelConfig
    batch_size: int
    micro_batch_size: int
    tp: int
    ep: int
    pp: int
    pp_schedule: str
    pp_stages_per_rank: int
    microbatches: int
    export_weights: bool


def _listing(values: list[int]) -> str:
    """``1, 2 or 4``: the values a fix may choose from."""
    text = [str(v) for v in values]
    return f"{', '.join(text[:-1])} or {text[-1]}" if len(text) > 1 else "".join(text)


def stage_count(cfg: Config) -> int:
    """Pipeline stages in all: ``--pp`` ranks, times ``--pp-stages-per-rank`` (virtual stages)
    for the interleaved schedule."""
    per_rank = cfg.pp_stages_per_rank if cfg.pp_schedule == "interleaved" else 1
    return cfg.pp * per_rank


def check_pp(cfg: Config) -> None:
    """Refuse a ``--pp`` this recipe cannot run, while the command line is parsed: the layers
    must split evenly into the stages, and the combinations not built yet say so."""
    pp = cfg.pp
    if cfg.microbatches < 0:
        raise ConfigError(f"microbatches={cfg.microbatches} must be >= 0 (0: derived)")
    if pp == 1:
        if cfg.microbatches:
            raise ConfigError(
                f"--microbatches {cfg.microbatches} without --pp: it sets a pipeline's "
                "microbatches; use --micro-batch-size (or --pp 2 or more)"
            )
        return
    unsupported = [
        (cfg.tp > 1, f"--tp {cfg.tp}", "PP x TP is not supported yet; use --tp 1"),
        (cfg.ep > 1, f"--ep {cfg.ep}", "PP x EP is not supported yet; use --ep 1"),
        (
            isinstance(cfg.model, MoEConfig),
            "a MoE model",
            "the routers' balancing is not split over stages yet; use a dense model",
        ),
        (
            cfg.model.tie_embeddings,
            "--model.tie-embeddings",
            "the embedding (first stage) and the head (last stage) live on different ranks; "
            "drop --model.tie-embeddings",
        ),
        (
            cfg.export_weights,
            "--export-weights",
            "each rank holds one stage; load the DCP checkpoint (full-model names) at --pp 1 "
            "and export there",
        ),
    ]
    for bad, option, fix in unsupported:
        if bad:
            raise ConfigError(f"--pp {pp} with {option}: {fix} (or --pp 1)")
    stages, layers = stage_count(cfg), cfg.model.n_layers
    if layers % stages:
        per_rank = stages // pp
        fits = [d for d in range(1, layers + 1) if layers % (d * per_rank) == 0]
        interleaved = f" x --pp-stages-per-rank {per_rank}" if per_rank > 1 else ""
        raise ConfigError(
            f"--pp {pp}{interleaved} makes {stages} stages, which do not divide "
            f"model.n_layers={layers}: use --pp {_listing(fits)}, or a layer count that "
            f"{stages} divides"
        )


def check_pp_world(pp: int, replicate: int, world_size: int) -> None:
    """Refuse a ``--pp`` (with ``--dp-replicate``) that does not divide the processes (the mesh
    is ``(pp, [dp_replicate,] dp_shard)``), before the process group is touched."""
    if pp == 1 or world_size % (pp * replicate) == 0:
        return
    fits = [d for d in range(1, world_size + 1) if world_size % (d * replicate) == 0]
    with_replicas = f" x --dp-replicate {replicate}" if replicate > 1 else ""
    raise ConfigError(
        f"--pp {pp}{with_replicas} does not divide the {world_size} processes: use --pp "
        f"{_listing(fits) or 1}, or launch a multiple of {pp * replicate} processes"
    )


def microbatches(cfg: Config, dp_size: int) -> int:
    """Microbatches per step: ``--microbatches``, or (0) each data-parallel rank's sequences
    over ``--micro-batch-size``; they must split that rank's rows evenly (every microbatch the
    same size, so their mean loss is the global batch's) and fit the schedule."""
    per_rank, rest = divmod(cfg.batch_size, dp_size)
    where = f"{dp_size} data-parallel rank{'s' if dp_size > 1 else ''} (--pp {cfg.pp})"
    if rest:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} cannot be split over {where}: use a multiple of "
            f"{dp_size}, or another number of processes"
        )
    divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    if cfg.microbatches == 0 and per_rank % cfg.micro_batch_size:
        raise ConfigError(
            f"--micro-batch-size {cfg.micro_batch_size} does not divide the {per_rank} "
            f"sequences each data-parallel rank gets per step (--batch-size {cfg.batch_size} "
            f"over {where}): use --microbatches {_listing(divisors)} (it wins over "
            "--micro-batch-size)"
        )
    count = cfg.microbatches or per_rank // cfg.micro_batch_size
    if per_rank % count:
        raise ConfigError(
            f"--microbatches {count} does not divide the {per_rank} sequences each "
            f"data-parallel rank gets per step (--batch-size {cfg.batch_size} over {where}): "
            f"use --microbatches {_listing(divisors)}"
        )
    if cfg.pp_schedule == "1f1b" and count < cfg.pp:
        raise ConfigError(
            f"--microbatches {count} is fewer than --pp {cfg.pp}: --pp-schedule 1f1b needs at "
            f"least one microbatch per stage; use --microbatches "
            f"{_listing([d for d in divisors if d >= cfg.pp]) or cfg.pp} (raising --batch-size "
            "if none fits), or --pp-schedule gpipe"
        )
    if cfg.pp_schedule == "interleaved" and count % max(1, count // cfg.pp):
        fits = [d for d in divisors if d % max(1, d // cfg.pp) == 0]
        raise ConfigError(
            f"--microbatches {count} with --pp-schedule interleaved must be a multiple of its "
            f"rounds (microbatches // --pp {cfg.pp} = {count // cfg.pp}): use --microbatches "
            f"{_listing(fits)}"
        )
    return count
