"""Optimizer choice, parameter groups and the learning-rate schedule.

``CHOICES`` is the one place that maps ``--optimizer`` to a class of ``raggedfsdp.optim``: an
optimizer that lands there later is picked up with no change here, and one with another
constructor needs one line (its ``kwargs``). The class must exist when the run starts; only
``adamw`` falls back to ``torch.optim.AdamW`` (identical math), everything else fails with a
message that names what is missing. The class's ``shard_policy()``, when it has one, is passed
to ``fully_shard`` so that the blocks its math needs (8-bit quantization blocks, whole Muon
matrices) are never cut between ranks.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from raggedfsdp.optim import split_muon_params
from raggedfsdp.sharding import DEFAULT_POLICY, ShardPolicy, combine
from raggedfsdp.sharding.units import expert_matrix
from recipes.llama.config import Config, ConfigError

__all__ = ["CHOICES", "Schedule", "build_optimizer", "lr_factor", "optimizer_class"]


def adam_kwargs(cfg: Config) -> dict[str, Any]:
    return {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}


@dataclass(frozen=True)
class Choice:
    """How to build one ``--optimizer``.

    Attributes:
        attr: the class's name in ``raggedfsdp.optim``.
        split_matrices: give the hidden matrices their own group (``use_muon=True``, lr
            ``muon_lr``) and the rest (embeddings, head, norms) ``use_muon=False`` groups that
            the optimizer updates with AdamW, as Muon needs.
        kwargs: constructor keywords besides the parameter groups.
        torch_fallback: used when ``raggedfsdp.optim`` does not have ``attr``.
        layout: the keywords of both the constructor and ``shard_policy`` (the block structure
            the math needs and the shards must keep whole).
    """

    attr: str
    split_matrices: bool = False
    kwargs: Callable[[Config], dict[str, Any]] = adam_kwargs
    torch_fallback: type[torch.optim.Optimizer] | None = None
    layout: Callable[[Config], dict[str, Any]] = lambda cfg: {}


def preconditioner_layout(cfg: Config) -> dict[str, Any]:
    """Shampoo's and SOAP's blocks (under ``--tp`` a side that divides every TP block)."""
    return {"max_preconditioner_dim": cfg.preconditioner_dim}


def muon_kwargs(cfg: Config) -> dict[str, Any]:
    """Muon's own lr comes with its group (``muon_lr``); the AdamW groups use these."""
    return {"lr": cfg.lr, "adamw_betas": (cfg.beta1, cfg.beta2), "adamw_eps": cfg.eps}


def shampoo_kwargs(cfg: Config) -> dict[str, Any]:
    """Adam grafting sets the step size, so Adam's lr and betas carry over; a well-conditioned
    epsilon for the factors' inverse roots."""
    return {"lr": cfg.lr, "betas": (cfg.beta1, 1.0), "epsilon": 1e-8, "grafting_beta2": cfg.beta2}


def soap_kwargs(cfg: Config) -> dict[str, Any]:
    """SOAP is Adam in Shampoo's eigenbasis: Adam's lr, betas and epsilon carry over (its
    factors' EMA and preconditioning frequency keep SOAP's defaults: beta2, and every 10 steps)."""
    return {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}


CHOICES: dict[str, Choice] = {
    "adamw": Choice("AdamW", torch_fallback=torch.optim.AdamW),
    "adamw8bit": Choice("AdamW8bit"),
    "muon": Choice("Muon", split_matrices=True, kwargs=muon_kwargs),
    "shampoo": Choice("Shampoo", kwargs=shampoo_kwargs, layout=preconditioner_layout),
    "soap": Choice("SOAP", kwargs=soap_kwargs, layout=preconditioner_layout),
}


def library() -> ModuleType:
    """``raggedfsdp.optim`` as installed now (looked up when a run starts, not at import)."""
    return importlib.import_module("raggedfsdp.optim")


def optimizer_class(name: str, fsdp: str) -> type[torch.optim.Optimizer]:
    """The class for ``--optimizer name`` under ``--fsdp fsdp``, or a ConfigError saying why
    there is none."""
    if fsdp == "fsdp2":  # the baseline: DTensor parameters and torch's own optimizer
        if name != "adamw":
            raise ConfigError(f"--fsdp fsdp2 runs with --optimizer adamw only, not {name!r}")
        return torch.optim.AdamW
    choice = CHOICES[name]
    module = library()
    cls = getattr(module, choice.attr, None) or choice.torch_fallback
    if cls is None:
        have = [n for n, c in CHOICES.items() if hasattr(module, c.attr) or c.torch_fallback]
        raise ConfigError(
            f"--optimizer {name} needs raggedfsdp.optim.{choice.attr}, which this raggedfsdp "
            f"does not have yet; available here: {', '.join(have)}"
        )
    return cls


def whole_expert_units(fqn: str, param: Any) -> int:
    """One whole expert matrix for a fused expert tensor, elements for everything else."""
    matrix = expert_matrix(fqn, tuple(param.shape))
    return matrix[1] * matrix[2] if matrix is not None else 1


def shard_policy(
    cls: type[torch.optim.Optimizer], whole_experts: bool = False, **layout: Any
) -> ShardPolicy | None:
    """The unit rule the optimizer's math needs (with its ``layout`` keywords, see ``Choice``),
    or None (``fully_shard``'s default: whole experts within a 0.1 % padding budget) for
    torch's own optimizers. ``whole_experts`` keeps every expert matrix whole on a rank even
    where that pads, on top of the optimizer's rule."""
    policy = getattr(cls, "shard_policy", None)
    chosen = policy(**layout) if policy is not None else None
    if not whole_experts:
        return chosen
    return combine(chosen if chosen is not None else DEFAULT_POLICY, whole_expert_units)


def param_groups(model: nn.Module, cfg: Config, split_matrices: bool) -> list[dict[str, Any]]:
    """Weight decay on matrices (embeddings included, as nanoGPT), none on norm weights; with
    ``split_matrices`` the Muon matrices (``split_muon_params``' rule: hidden 2-D matrices and
    stacked experts, not embeddings or the head) form a group of their own (see ``Choice``)."""
    muon = set()
    if split_matrices:
        muon = {id(p) for g in split_muon_params(model) if g["use_muon"] for _, p in g["params"]}
    matrices, decay, no_decay = [], [], []
    for param in model.parameters():
        if id(param) in muon:
            matrices.append(param)
        else:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if split_matrices:
        groups = [
            {"params": matrices, "weight_decay": cfg.weight_decay, "lr": cfg.muon_lr},
            *groups,
        ]
        for i, group in enumerate(groups):
            group["use_muon"] = i == 0
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: Config, mesh: Any = None) -> torch.optim.Optimizer:
    """The optimizer of ``--optimizer``; one that refuses these parameters (e.g. blocks a
    tensor-parallel split cuts) is a ConfigError naming the option, before anything trains.
    ``mesh``: the ranks that hold the same parameters (a pipeline stage's data-parallel
    ranks), which raggedfsdp's optimizers check agree; None: every rank."""
    cls = optimizer_class(cfg.optimizer, cfg.fsdp)
    choice = CHOICES[cfg.optimizer]
    kwargs = choice.kwargs(cfg) | choice.layout(cfg)
    if mesh is not None and cls.__module__.startswith("raggedfsdp."):
        kwargs["mesh"] = mesh
    try:
        return cls(param_groups(model, cfg, choice.split_matrices), **kwargs)
    except ValueError as err:
        raise ConfigError(f"--optimizer {cfg.optimizer}: {err}") from err


def lr_factor(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine to ``min_lr_ratio`` or, for WSD, flat then a linear decay to
    it over the last ``decay_fraction`` of the steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    low = cfg.min_lr_ratio
    if cfg.lr_schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    decay_start = max(cfg.warmup_steps, cfg.steps - round(cfg.decay_fraction * cfg.steps))
    if step < decay_start:
        return 1.0
    progress = (step + 1 - decay_start) / max(1, cfg.steps - decay_start)
    return 1 - (1 - low) * min(progress, 1.0)


class Schedule:
    """Sets every group's lr to its peak (as built) times ``lr_factor``; the lr is a function
    of the step alone, so a resumed run needs nothing but the step."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: Config) -> None:
        self.optimizer, self.cfg = optimizer, cfg
        self.peaks = [group["lr"] for group in optimizer.param_groups]

    def apply(self, step: int) -> float:
        """Set the lrs for ``step``; returns the lr of the AdamW-updated groups (``lr``)."""
        factor = lr_factor(step, self.cfg)
        for group, peak in zip(self.optimizer.param_groups, self.peaks, strict=True):
            group["lr"] = peak * factor
        return self.cfg.lr * factor
