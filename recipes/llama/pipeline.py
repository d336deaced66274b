"""``--pp N``: the layers split into pipeline stages, each ``fully_shard``ed over its
data-parallel ranks, driven by ``torch.distributed.pipelining``'s schedules.

The mesh is ``(pp, dp_shard)`` (``(pp, dp_replicate, dp_shard)`` with ``--dp-replicate``,
``parallel.pipeline_env``). Stage ``s`` of ``S`` holds layers ``[s·L/S, (s+1)·L/S)``, stage 0
the embedding too and the last stage the final norm and the head; pp rank ``r`` holds stages
``r, r + N, ...`` (one, or ``--pp-stages-per-rank`` for the interleaved schedule). Each stage is
an ``nn.Module`` whose attribute names are the full model's, so its parameters keep their
full-model names (``layers.5.attention.wq.weight``): DCP checkpoints are keyed by them and
load at any other (pp, dp). raggedfsdp stages go through ``raggedfsdp.fsdp.pipelining``'s
``PipelineStage`` (gradients reduced once per step, not per microbatch), ``--fsdp fsdp2`` ones
through torch's.

The step's math is the single-process step's: every microbatch the same size, the schedule
averages their gradients (``scale_grads``), the data-parallel reduction averages over ranks;
the loss is known on the last stage only and reaches every rank through the step's one
all-reduce (``train.agree``); gradient clipping reduces the norm over the stages too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.utils.checkpoint import checkpoint

import raggedfsdp
from raggedfsdp.fsdp.pipelining import PipelineStage
from raggedfsdp.sharding import RaggedTensor, ShardPolicy
from recipes.llama.config import Config
from recipes.llama.data import Batches
from recipes.llama.model import Transformer, init_parameter, matmul_params, rope_table
from recipes.llama.moe import model_class
from recipes.llama.parallel import Env, fsdp_wrapper
from recipes.llama.pipeline_checks import stage_count

__all__ = [
    "Pipeline",
    "StagePart",
    "build_pipeline",
    "clip_over_stages",
    "pipeline_evaluate",
    "pipeline_step",
]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


class StagePart(nn.Module):
    """One stage of the Transformer under the full model's names: ``tok_embeddings`` (first
    stage), ``layers`` (a ``ModuleDict`` keyed by the layers' global indices), ``norm`` and
    ``output`` (last stage). Token ids or hidden states in; hidden states or logits out."""

    def __init__(self, model: Transformer, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        if first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        if last:
            self.norm, self.output = model.norm, model.output
        self.activation_checkpointing = model.activation_checkpointing
        self.register_buffer("rope", model.rope, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "tok_embeddings"):
            h = self.tok_embeddings(h)
        for block in self.layers.values():
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(block, h, self.rope, use_reentrant=False)
            else:
                h = block(h, self.rope)
        return self.output(self.norm(h)) if hasattr(self, "output") else h


class RankStages(nn.Module):
    """This rank's stages as one module with the full model's names (the optimizer's
    parameter groups, checkpoints, clipping, metrics): the same submodules as the stages,
    never run itself."""

    def __init__(self, parts: list[StagePart]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for part in parts:
            for name in ("tok_embeddings", "norm", "output"):
                if hasattr(part, name):
                    setattr(self, name, getattr(part, name))
            self.layers.update(part.layers)


@dataclass
class Pipeline:
    """What the loop needs of ``--pp``: the rank's stages as one module, the schedule, and
    whether this rank feeds the token ids (stage 0) or computes the loss (the last stage)."""

    model: RankStages
    parts: list[StagePart]
    schedule: Any  # a torch.distributed.pipelining schedule
    first: bool
    last: bool
    microbatches: int
    pp_group: dist.ProcessGroup
    n_params: int  # of the whole model (every stage), for the banner and MFU
    n_matmul: int


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``train.loss_fn`` on a microbatch's logits: the mean over its tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _materialize_root_parts(part: StagePart, model: Transformer, cfg: Config, env: Env) -> None:
    """Allocate and initialise the embedding, norm and head this stage holds (by their
    full-model names, so the weights are those of any other layout) and the RoPE table."""
    for name in ("tok_embeddings", "norm", "output"):
        if hasattr(part, name):
            getattr(part, name).to_empty(device=env.device)
    for name, param in part.named_parameters():
        if not name.startswith("layers."):
            init_parameter(name, param, cfg.seed, cfg.model.n_layers)
    part.rope = rope_table(model.cfg.head_dim, cfg.seq_len, model.cfg.rope_theta).to(env.device)


def _build_part(
    model: Transformer, stage: int, stages: int, cfg: Config, env: Env, policy: ShardPolicy | None
) -> StagePart:
    """Stage ``stage``'s module, materialized block by block and wrapped as ``build_model``
    wraps the whole model: each block, the embedding alone (not gathered for backward), the
    norm with the head (kept gathered after forward), then the stage as the root."""
    per_stage = cfg.model.n_layers // stages
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    wrap = fsdp_wrapper(cfg, env.mesh, policy)
    for index in layers:
        model.materialize_block(index, env.device, cfg.seed)
        if cfg.compile:
            model.layers[index].compile()
        wrap(model.layers[index])
    part = StagePart(model, layers, first=stage == 0, last=stage == stages - 1)
    _materialize_root_parts(part, model, cfg, env)
    if hasattr(part, "tok_embeddings"):
        wrap(part.tok_embeddings).set_unshard_in_backward(False)
    if hasattr(part, "output"):
        wrap([part.norm, part.output], reshard_after_forward=False)
    wrap(part)
    return part


def build_pipeline(
    cfg: Config, env: Env, policy: ShardPolicy | None, microbatches: int
) -> Pipeline:
    """This rank's stages (``fully_shard``ed over ``env.mesh``) and the ``--pp-schedule`` over
    them; the whole model exists on the meta device only, for its names and sizes."""
    with torch.device("meta"):
        model = model_class(cfg.model)(cfg.model, cfg.seq_len, cfg.activation_checkpointing)
    n_params, n_matmul = sum(p.numel() for p in model.parameters()), matmul_params(model)
    stages, pp_rank = stage_count(cfg), env.pp_mesh.get_local_rank()
    group = env.pp_mesh.get_group()
    stage_cls = PipelineStage if cfg.fsdp == "raggedfsdp" else TorchPipelineStage
    mine = list(range(pp_rank, stages, cfg.pp))
    parts = [_build_part(model, s, stages, cfg, env, policy) for s in mine]
    torch_stages = [
        stage_cls(part, s, stages, env.device, group=group)
        for part, s in zip(parts, mine, strict=True)
    ]
    runner = SCHEDULES[cfg.pp_schedule]
    schedule = runner(
        torch_stages if cfg.pp_schedule == "interleaved" else torch_stages[0],
        microbatches,
        loss_fn=loss_fn,
    )
    return Pipeline(
        model=RankStages(parts),
        parts=parts,
        schedule=schedule,
        first=0 in mine,
        last=stages - 1 in mine,
        microbatches=microbatches,
        pp_group=group,
        n_params=n_params,
        n_matmul=n_matmul,
    )


def run_schedule(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor, train: bool) -> torch.Tensor:
    """One pass of the schedule over this data-parallel rank's rows (split into the
    microbatches); returns the mean microbatch loss on the last stage, 0 elsewhere."""
    losses: list[torch.Tensor] = []
    inputs = (x,) if pipe.first else ()
    target = {"target": y, "losses": losses} if pipe.last else {}
    (pipe.schedule.step if train else pipe.schedule.eval)(*inputs, **target)
    if not pipe.last:
        return torch.zeros((), device=x.device)
    return torch.stack([loss.detach() for loss in losses]).mean()


def _rows(batches: Batches, index: int, env: Env) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batches.local(index, env.dp_rank, env.dp_size)
    return x.to(env.device), y.to(env.device)


def pipeline_step(
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    batches: Batches,
    step: int,
    cfg: Config,
    env: Env,
) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """``train.train_step`` under ``--pp``: (this rank's share of the loss, the global gradient
    norm before clipping, {} for the routers). The share is the last stage's mean loss times
    ``--pp`` and 0 on the other stages, so ``train.agree``'s all-reduce over every rank,
    divided by the world size, is the mean over the data-parallel ranks: the loss reaches
    every rank (for the log) without a collective of its own."""
    x, y = _rows(batches, step, env)
    loss = run_schedule(pipe, x, y, train=True) * cfg.pp
    grad_norm = clip_over_stages(pipe.model, cfg, pipe.pp_group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, {}


@torch.no_grad()
def pipeline_evaluate(pipe: Pipeline, batches: Batches, cfg: Config, env: Env) -> float:
    """``train.evaluate`` under ``--pp``: the mean loss over ``eval_batches`` fixed batches, the
    last stage's sums reduced over every rank (the other stages add 0)."""
    for part in pipe.parts:
        part.eval()
    total = torch.zeros((), device=env.device)
    for index in range(cfg.eval_batches):
        total += run_schedule(pipe, *_rows(batches, index, env), train=False)
    if cfg.fsdp == "fsdp2":  # FSDP2 keeps [norm, output] gathered for a backward
        for module in pipe.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    for part in pipe.parts:
        part.train()
    dist.all_reduce(total)
    return total.item() / (cfg.eval_batches * env.dp_size)


def clip_over_stages(model: nn.Module, cfg: Config, pp_group: dist.ProcessGroup) -> float:
    """Clip to ``cfg.grad_clip`` (0: measure only) by the norm over every stage, and return it:
    each stage's norm over its data-parallel ranks (``parallel.clip_gradients``' rules), its
    square summed over the pipeline, then one scale for all (torchtitan's PP clipping)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if cfg.fsdp == "raggedfsdp":
        stage = raggedfsdp.clip_grad_norm_(params, math.inf)
    else:
        stage = torch.nn.utils.clip_grad_norm_(params, math.inf)
        stage = stage.full_tensor() if hasattr(stage, "full_tensor") else stage
    squared = stage.to(torch.float32).pow(2)
    dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    if cfg.grad_clip > 0 and cfg.fsdp == "fsdp2":
        torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, total)
    elif cfg.grad_clip > 0:  # raggedfsdp.clip_grad_norm_'s scale, on the local pieces
        coef = torch.clamp(cfg.grad_clip / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for p in params:
                grad = p.grad
                (grad.local if isinstance(grad, RaggedTensor) else grad).mul_(coef.to(grad.dtype))
    return total.item()
