"""Pipeline parallelism x fully_shard at W=4 (pp 2 x dp 2): torch's schedules (GPipe, 1F1B,
interleaved 1F1B) over ``raggedfsdp.fsdp.pipelining.PipelineStage``, each stage sharded over
its data-parallel ranks, against one process on the whole batch; gradients reduced once per
step, not once per microbatch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage as TorchPipelineStage,
)
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

import raggedfsdp
from raggedfsdp.fsdp.pipelining import PipelineStage
from tests.support.fsdp_training import counting, full_params

DIM, ROWS, MICROBATCHES, STEPS, LR = 12, 16, 4, 3, 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mlp(self.norm(x)))


class Part(nn.Module):
    """``blocks`` blocks, and for the last part a head."""

    def __init__(self, blocks: int, head: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(DIM, 1) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x if self.head is None else self.head(x)


def _parts(stages: int) -> list[Part]:
    """The whole model, cut into ``stages`` parts (4 blocks in all), from one seed."""
    torch.manual_seed(0)
    per = 4 // stages
    return [Part(per, head=i == stages - 1) for i in range(stages)]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, DIM, generator=gen), torch.randn(ROWS, 1, generator=gen)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _reference(stages: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    parts = _parts(stages)
    model = nn.Sequential(*parts)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [{n: p.detach() for n, p in part.named_parameters()} for part in parts]


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def _pipelined(schedule: str, stage_cls: type = PipelineStage) -> dict:
    """Three steps at pp 2 x dp 2 (two stages per rank for the interleaved schedule)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    per_rank = 2 if schedule == "interleaved" else 1
    stages_total = 2 * per_rank
    parts = _parts(stages_total)
    mine = list(range(pp, stages_total, 2))  # interleaved: stage pp, then pp + 2
    stages, modules = [], []
    for index in mine:
        part = parts[index]
        for layer in part.layers:
            raggedfsdp.fully_shard(layer, mesh=mesh["dp"])
        raggedfsdp.fully_shard(part, mesh=mesh["dp"])
        modules.append(part)
        stages.append(
            stage_cls(part, index, stages_total, torch.device("cpu"), group=mesh["pp"].get_group())
        )
    cls = SCHEDULES[schedule]
    runner = cls(stages if per_rank > 1 else stages[0], MICROBATCHES, loss_fn=_mse)
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=LR)
    losses, reduces = [], []
    rows = slice(dp * ROWS // 2, (dp + 1) * ROWS // 2)
    for step in range(STEPS):
        x, y = _batch(step)
        micro: list[torch.Tensor] = []
        with counting("reduce_scatter_flat") as calls:
            if 0 in mine:
                runner.step(x[rows])
            elif stages_total - 1 in mine:
                runner.step(target=y[rows], losses=micro)
        if stages_total - 1 in mine:
            runner_losses = micro
            loss = torch.stack(runner_losses).mean()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            losses.append(loss.item())
        reduces.append(sum(calls.values()))
        opt.step()
        opt.zero_grad()
    groups = sum(
        1
        for m in modules
        for sub in m.modules()
        if isinstance(sub, raggedfsdp.FSDPModule) and sub._fsdp_state().group is not None
    )
    return {
        "stages": mine,
        "losses": losses,
        "params": [full_params(m) for m in modules],
        "reduces": reduces,
        "groups": groups,
    }


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_schedules_train_as_one_process(dist_pool, schedule):
    stages = 4 if schedule == "interleaved" else 2
    expected_losses, expected_params = _reference(stages)
    results = dist_pool(4).run(_pipelined, schedule)
    for result in results:
        for index, params in zip(result["stages"], result["params"], strict=True):
            for n, value in expected_params[index].items():
                assert torch.allclose(params[n], value, atol=2e-6), (index, n)
        if result["losses"]:
            assert (
                max(abs(a - b) for a, b in zip(result["losses"], expected_losses, strict=True))
                < 1e-5
            )
        # one reduce-scatter per group per step, not one per microbatch
        assert result["reduces"] == [result["groups"]] * STEPS, result


def test_torchs_own_stage_reduces_every_microbatch(dist_pool):
    """Why the subclass exists: torch's stage treats a raggedfsdp module as a plain one, so
    each microbatch's backward reduce-scatters (still correct, ``MICROBATCHES`` times the
    traffic)."""
    _, expected_params = _reference(2)
    for result in dist_pool(4).run(_pipelined, "gpipe", TorchPipelineStage):
        assert result["reduces"] == [result["groups"] * MICROBATCHES] * STEPS
        for index, params in zip(result["stages"], result["params"], strict=True):
            for n, value in expected_params[index].items():
                assert torch.allclose(params[n], value, atol=2e-6), (index, n)


def _stage_roots() -> dict[str, str]:
    """What ``PipelineStage`` says of a stage with its blocks wrapped but not its root, and
    that the same stage with the root wrapped too, and one with no FSDP at all, are taken."""
    part = Part(2, head=True)
    for block in part.layers:
        raggedfsdp.fully_shard(block)
    device = torch.device("cpu")
    try:
        PipelineStage(part, 0, 1, device)
        refused = ""
    except ValueError as err:
        refused = str(err)
    raggedfsdp.fully_shard(part)
    PipelineStage(part, 0, 1, device)
    PipelineStage(Part(2, head=True), 0, 1, device)
    return {"refused": refused}


def test_a_stage_whose_root_is_not_fully_shard_is_refused_with_the_fix(dist_pool):
    """Left alone, such a stage would reduce-scatter every microbatch without a word."""
    (result,) = dist_pool(1).run(_stage_roots)
    assert "raggedfsdp.fully_shard(submodule)" in result["refused"], result
    assert "'layers.0'" in result["refused"], result
