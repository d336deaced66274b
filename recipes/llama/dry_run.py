"""``--dry-run RANK/WORLD``: the recipe as one rank of a W-rank job, on one CPU.

Before booking a cluster, check that a preset fits: this process becomes rank ``RANK`` of a
``WORLD``-rank job on torch's fake process group (``raggedfsdp.dry_run``), builds the
recipe's model on the meta device, wraps it exactly as a real run does (``--fsdp``,
``--dp-replicate``, ``--tp``, ``--ep``, mixed precision, the optimizer's shard policy), makes
the optimizer and trains two micro-batches of ``--micro-batch-size`` sequences, then prints
that rank's memory, collective bytes per step and set-up time. Tensors are fake (shapes and
storage sizes, no data), so Llama-3-70B at 1,024 ranks runs on a laptop; ``--dry-run-tensors
real`` allocates them (small models; the figures are the same). Nothing is read or written:
no data, checkpoints or logs.

    python -m recipes.llama.train --config gpt_oss_120b --mixed-precision bf16 --dry-run 3/256
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from raggedfsdp.dry_run import StepReport, check_rank, fake_world, measure, table, tensor_mode
from recipes.llama import parallel
from recipes.llama.config import USAGE_ERROR, Config, ConfigError, parse_args
from recipes.llama.model_config import MoEConfig
from recipes.llama.moe import model_class
from recipes.llama.optimizers import CHOICES, build_optimizer, optimizer_class, shard_policy
from recipes.llama.tensor_parallel import loss_context

__all__ = ["DryRun", "expert_impl_for", "main", "parse_dry_run", "run", "split_argv"]

FLAGS = ("--dry-run", "--dry-run-tensors")


class DryRun(tuple):
    """``(rank, world_size, tensors)`` from the command line."""

    __slots__ = ()

    def __new__(cls, rank: int, world_size: int, tensors: str) -> DryRun:
        return super().__new__(cls, (rank, world_size, tensors))


def parse_dry_run(value: str, tensors: str = "fake") -> DryRun:
    """``"R/W"`` -> ``DryRun(R, W, tensors)``; a malformed value or rank is one line."""
    rank, sep, world = value.partition("/")
    if not sep or not rank.strip().isdigit() or not world.strip().isdigit():
        raise ConfigError(f"--dry-run {value!r}: give RANK/WORLD, e.g. --dry-run 0/1024")
    try:
        check_rank(int(rank), int(world))
    except ValueError as err:
        raise ConfigError(f"--dry-run {value}: {err}") from None
    if tensors not in ("fake", "real"):
        raise ConfigError(f"--dry-run-tensors {tensors!r}: use fake or real")
    return DryRun(int(rank), int(world), tensors)


def split_argv(argv: list[str]) -> tuple[DryRun | None, list[str]]:
    """The dry-run options out of ``argv`` (``--flag value`` or ``--flag=value``), and the
    rest for the recipe's own parser; None when ``--dry-run`` is not given."""
    found: dict[str, str] = {}
    rest, items = [], iter(argv)
    for arg in items:
        name, eq, value = arg.partition("=")
        if name in FLAGS:
            found[name] = value if eq else next(items, "")
        else:
            rest.append(arg)
    if "--dry-run" not in found:
        if "--dry-run-tensors" in found:
            raise ConfigError("--dry-run-tensors needs --dry-run RANK/WORLD")
        return None, rest
    return parse_dry_run(found["--dry-run"], found.get("--dry-run-tensors", "fake")), rest


@contextmanager
def _meta_model_outside_fake() -> Iterator[None]:
    """Construct the meta model outside the fake tensor mode, as plain meta tensors.

    ``build_model`` makes the model on the meta device, then ``to_empty`` gives each block its
    memory. Parameters *created* under ``FakeTensorMode`` cannot be swapped by ``to_empty``
    (torch 2.13: "Cannot swap ... weakref"), but plain meta ones are replaced by fake ones,
    which is all a dry run needs."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = parallel.model_class

    def model_class(cfg: Any) -> Callable[..., nn.Module]:
        cls = original(cfg)

        def make(*args: Any, **kwargs: Any) -> nn.Module:
            with unset_fake_temporarily():
                return cls(*args, **kwargs)

        return make

    with mock.patch.object(parallel, "model_class", model_class):
        yield


@contextmanager
def _eager_step(cfg: Config) -> Iterator[None]:
    """Ask an optimizer with a ``fused`` choice (AdamW8bit) for its eager step: its native
    CPU kernel would read memory a fake tensor does not have; the state is the same."""
    choice = CHOICES[cfg.optimizer]
    cls = optimizer_class(cfg.optimizer, cfg.fsdp)
    if "fused" not in inspect.signature(cls).parameters:
        yield
        return
    eager = dataclasses.replace(choice, kwargs=lambda c: choice.kwargs(c) | {"fused": False})
    with mock.patch.dict(CHOICES, {cfg.optimizer: eager}):
        yield


def _device(cfg: Config) -> torch.device:
    """Fake CUDA tensors where the run would use CUDA (nothing is allocated there)."""
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if cuda else "cpu")


def _build(cfg: Config, env: parallel.Env) -> Callable[[Callable[..., Any]], tuple]:
    """``raggedfsdp.dry_run``'s build: the recipe's model and optimizer (the runtime comes
    from ``cfg.fsdp``, as in a real run)."""

    def build(_: Callable[..., Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
        cls = optimizer_class(cfg.optimizer, cfg.fsdp)
        layout = CHOICES[cfg.optimizer].layout(cfg) if cfg.fsdp == "raggedfsdp" else {}
        policy = shard_policy(cls, cfg.whole_experts, **layout)
        with _meta_model_outside_fake():
            model = parallel.build_model(cfg, env, policy)
        with _eager_step(cfg):
            return model, build_optimizer(model, cfg)

    return build


def _loss(cfg: Config) -> Callable[[nn.Module], torch.Tensor]:
    """The recipe's loss on one micro-batch of ``micro_batch_size`` x ``seq_len`` tokens (with
    ``--loss-parallel``, on vocabulary-sharded logits: ``run`` measures under ``loss_context``)."""

    def loss(model: nn.Module) -> torch.Tensor:
        device = _device(cfg)
        shape = (cfg.micro_batch_size, cfg.seq_len)
        tokens = torch.randint(0, cfg.model.vocab_size, shape, device=device)
        logits = model(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())

    return loss


def free_bytes() -> int:
    """Physical memory free on this machine now (what real tensors can use)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_real_fits(cfg: Config) -> None:
    """Refuse ``--dry-run-tensors real`` where one block, whole as it is made before sharding,
    does not fit this machine's free memory: the run would fail or swap partway through."""
    with torch.device("meta"):
        model = model_class(cfg.model)(cfg.model, 1)
    block = max(sum(p.nbytes for p in b.parameters()) for b in model.layers)
    if block > free_bytes():
        raise ConfigError(
            f"--dry-run-tensors real: one block of this model is {block / 2**30:.1f} GiB whole "
            f"(made before it is sharded), more than the {free_bytes() / 2**30:.1f} GiB free "
            "here: use --dry-run-tensors fake (the default)"
        )


def expert_impl_for(cfg: Config) -> str:
    """The expert path a dry run takes for ``expert_impl="auto"``.

    bf16 compute (``--mixed-precision bf16``): ``grouped_mm``, the path a CUDA job takes.
    Otherwise the per-expert loop: torch's meta (so fake) ``grouped_mm`` accepts bf16 inputs
    only (torch 2.13), and the loop is what ``auto`` runs on CPU. The loop reads the routing
    counts, which ``ZeroValues`` answers as zeros: every token goes to expert 0, so the loop's
    per-expert temporaries are the whole routed batch's, the most a real, unbalanced routing
    could make them; the saved activations are the same in total either way."""
    return "grouped_mm" if cfg.mixed_precision == "bf16" else "loop"


def run(cfg: Config, request: DryRun, steps: int = 2) -> StepReport:
    """The dry run of ``cfg`` as ``request``'s rank (see the module docstring); ``steps=0``
    measures the set-up alone.

    MoE models with ``expert_impl="auto"`` run their experts as ``expert_impl_for`` says."""
    rank, world_size, tensors = request
    if cfg.pp > 1:
        raise ConfigError(
            f"--dry-run with --pp {cfg.pp}: the dry run builds the whole model on one rank, not "
            "a pipeline stage; use --pp 1 (a stage holds about 1/pp of the layers' memory)"
        )
    if isinstance(cfg.model, MoEConfig) and cfg.model.expert_impl == "auto":
        impl = expert_impl_for(cfg)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, expert_impl=impl))
    if isinstance(cfg.model, MoEConfig):
        parallel.check_ep_world(cfg.ep, world_size, cfg.model.n_experts)
    parallel.check_world(cfg.tp, cfg.dp_replicate, world_size)
    if world_size % cfg.dp_replicate:
        raise ConfigError(
            f"dp_replicate={cfg.dp_replicate} must divide the dry run's world ({world_size}): "
            "change --dp-replicate or the WORLD of --dry-run"
        )
    parallel.check_expert_split(cfg, world_size)
    if tensors == "real":
        check_real_fits(cfg)
    with fake_world(rank, world_size):
        # the mesh first, with real tensors: it holds rank numbers that fake ones would lose
        env = parallel.make_env(_device(cfg), 0, cfg.dp_replicate, cfg.tp, cfg.ep)
        with tensor_mode(tensors), loss_context(cfg.loss_parallel):  # forward and backward
            return measure(_build(cfg, env), _loss(cfg), cfg.fsdp, steps, tensors)


def describe(cfg: Config, report: StepReport) -> str:
    """The banner line and the table."""
    shape = f"{cfg.micro_batch_size} x {cfg.seq_len} tokens"
    head = (
        f"dry run: rank {report.rank} of {report.world_size}, --fsdp {cfg.fsdp}, "
        f"--optimizer {cfg.optimizer}, mixed precision {cfg.mixed_precision}, micro-batch "
        f"{shape}, {report.tensors} tensors (fake process group)"
    )
    return f"{head}\n{table([report])}"


def main(argv: list[str]) -> int:
    """``recipes.llama.train``'s entry for a command line with ``--dry-run``."""
    try:
        request, rest = split_argv(argv)
        if request is None:
            raise ConfigError("give --dry-run RANK/WORLD, e.g. --dry-run 0/1024")
        cfg = parse_args(rest)
        report = run(cfg, request)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_ERROR
    print(describe(cfg, report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
