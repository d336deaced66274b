"""The capacity planner cannot drift from the runtime: units, Muon owners and state bytes.

For every optimizer and a sample of shapes (a dense matrix, fused experts ``(E, m, n)``, one
expert ``experts.3.w1``, vectors, another 3-D tensor, an embedding, a head), the planner's
answers are compared with what the runtime does on the same layout:

(a) each tensor's unit is the one ``fully_shard(..., shard_policy=combine(user,
    Opt.shard_policy()))`` resolves;
(b) Muon's owners are ``assign_owners``' on the same layout, and a real ``Muon`` step on that
    layout reports the same matrices, local matrices, Newton–Schulz loads and bytes moved;
(c) the optimizer-state bytes of every rank are what a real optimizer's ``state_bytes()``
    reports on that rank's pieces, at W = 1..4.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raggedfsdp.capacity import (
    Group,
    Mesh,
    ModelShapes,
    OptimizerSpec,
    Settings,
    UnitPolicy,
    estimate,
)
from raggedfsdp.capacity.optimizer_state import counter_bytes
from raggedfsdp.optim import SOAP, AdamW, AdamW8bit, Muon, Shampoo
from raggedfsdp.sharding import FlatBuffer, RaggedTensor
from raggedfsdp.sharding.owners import Job, assign_owners, ns_flops
from raggedfsdp.sharding.units import (
    DEFAULT_POLICY,
    ExpertShardPolicy,
    combine,
    is_muon_matrix,
    resolve_units,
    row_units,
)

MODEL = ModelShapes(
    "drift",
    "test",
    (
        Group("embed", 1, (("tok_embeddings.weight", (96, 64)),)),
        Group(
            "layer",
            2,
            (
                ("attn.wq.weight", (64, 64)),
                ("mlp.experts.w1", (4, 48, 64)),
                ("mlp.experts.3.w1", (48, 64)),
                ("attn.norm.weight", (64,)),
                ("conv.weight", (3, 40, 36)),
                ("attn.bias", (4500,)),
            ),
        ),
        Group("head", 1, (("norm.weight", (64,)), ("output.weight", (96, 64)))),
    ),
)

#: name -> (the planner's optimizer, the optimizer class, its shard_policy / constructor options)
OPTIMIZERS: dict[str, tuple[OptimizerSpec, type, dict[str, Any]]] = {
    "adamw": (OptimizerSpec("adamw"), AdamW, {}),
    "adamw8bit": (
        OptimizerSpec("adamw8bit", block_size=64, min_8bit_size=1024),
        AdamW8bit,
        {"block_size": 64, "min_8bit_size": 1024},
    ),
    "adamw8bit-tile": (
        OptimizerSpec("adamw8bit", block_size=64, tile=(8, 16), min_8bit_size=1024),
        AdamW8bit,
        {"block_size": 64, "tile": (8, 16), "min_8bit_size": 1024},
    ),
    "muon": (OptimizerSpec("muon"), Muon, {"whole_matrices": "auto"}),
    "muon-cut": (OptimizerSpec("muon", whole_matrices=False), Muon, {"whole_matrices": False}),
    "shampoo": (
        OptimizerSpec("shampoo", preconditioner_dim=32),
        Shampoo,
        {"max_preconditioner_dim": 32},
    ),
    "soap": (OptimizerSpec("soap", preconditioner_dim=32), SOAP, {"max_preconditioner_dim": 32}),
}
#: the planner's unit setting -> the policy a user passes to fully_shard for it
USER_UNITS = {
    "elements": (UnitPolicy("elements"), DEFAULT_POLICY),
    "elements-budget": (
        UnitPolicy("elements", max_extra_padding=0.05),
        ExpertShardPolicy(max_extra_padding=0.05),
    ),
    "rows": (UnitPolicy("rows", 2), row_units(2)),
}


def _estimate(world: int, opt: str, units: str = "elements"):
    return estimate(MODEL, Settings(Mesh(1, world), USER_UNITS[units][0], OPTIMIZERS[opt][0]))


def _plan_of(est, group: Group):
    return next(p for p in est.plans if p.group.tensors == group.tensors)


@pytest.mark.parametrize("units", sorted(USER_UNITS))
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_units_are_the_ones_fully_shard_resolves(world: int, opt: str, units: str) -> None:
    _, cls, options = OPTIMIZERS[opt]
    policy = combine(USER_UNITS[units][1], cls.shard_policy(**options))
    est = _estimate(world, opt, units)
    for group in MODEL.groups:
        tensors = [(name, shape, "float32") for name, shape in group.tensors]
        planned = {t.name: t.unit for t in _plan_of(est, group).layout.tensors}
        assert planned == resolve_units(policy, tensors, world), group.name


# ----------------------------------------------------------------------------- real pieces
def _named_params(est, rank: int) -> list[tuple[str, nn.Parameter]]:
    """This rank's RaggedTensor parameters of every group instance, in model order, as
    ``fully_shard`` lays them out (views of one flat segment per instance)."""
    out = []
    for gi, group in enumerate(MODEL.groups):
        layout = _plan_of(est, group).layout
        for k in range(group.repeat):
            buf = FlatBuffer(layout, rank, torch.float32)
            for name, _ in group.tensors:
                local = buf.shard_view(name)
                local.copy_(torch.linspace(-1, 1, local.numel()))
                param = RaggedTensor(local, layout.shards[name], rank)
                out.append((f"g{gi}.{k}.{name}", nn.Parameter(param)))
    return out


def _optimizer(opt: str, params: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    _, cls, options = OPTIMIZERS[opt]
    if cls is not Muon:
        return cls(params, **options)
    muon = [(n, p) for n, p in params if is_muon_matrix(n, p.shape)]
    other = [(n, p) for n, p in params if not is_muon_matrix(n, p.shape)]
    return Muon([{"params": muon}, {"params": other, "use_muon": False}], **options)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_state_bytes_are_the_optimizers_on_every_rank(world: int, opt: str) -> None:
    est = _estimate(world, opt)
    tensors = [t for g in MODEL.groups for t in g.tensors]
    predicted = sum(p.instances * p.state for p in est.plans) + counter_bytes(
        OPTIMIZERS[opt][0], tensors
    )
    assert est.memory["optimizer"] == predicted.max()
    for rank in range(world):
        real = _optimizer(opt, _named_params(est, rank)).state_bytes().state_bytes
        assert predicted[rank] == real, (opt, world, rank)


# ----------------------------------------------------------------------------- Muon owners
def _jobs_from_shards(est, world: int) -> list[Job]:
    """Every Muon matrix as a job, in model order, from the parameters' RaggedShards."""
    jobs = []
    for group in MODEL.groups:
        layout = _plan_of(est, group).layout
        for _ in range(group.repeat):
            for name, shape in group.tensors:
                if not is_muon_matrix(name, shape):
                    continue
                spec = layout.shards[name]
                count, (m, n) = (shape[0], shape[1:]) if len(shape) == 3 else (1, shape)
                for e in range(count):
                    a, b = e * m * n, (e + 1) * m * n
                    ranges = [spec.local_range(r) for r in range(world)]
                    pieces = tuple(
                        (r, min(b, hi) - max(a, lo))
                        for r, (lo, hi) in enumerate(ranges)
                        if min(b, hi) > max(a, lo)
                    )
                    jobs.append(Job(pieces, float(ns_flops(m, n, 5))))
    return jobs


@pytest.mark.parametrize("opt", ["muon", "muon-cut"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_muon_owners_are_assign_owners_on_the_layout(world: int, opt: str) -> None:
    est = _estimate(world, opt)
    jobs = _jobs_from_shards(est, world)
    owners = assign_owners(jobs, world)
    loads = [0.0] * world
    for job, owner in zip(jobs, owners, strict=True):
        loads[owner] += job.cost
    mu = est.muon
    assert mu.matrices == len(jobs) == 2 * (1 + 4 + 1 + 3)  # embedding and head: AdamW
    assert mu.local_matrices == sum(j.sole_holder == o for j, o in zip(jobs, owners, strict=True))
    assert mu.max_cost == max(loads)
    assert mu.mean_cost == pytest.approx(sum(loads) / world, rel=1e-12)


def _muon_step(opt: str) -> dict[str, float]:
    """In every rank: one real Muon step on the planner's layout."""
    world, rank = dist.get_world_size(), dist.get_rank()
    est = _estimate(world, opt)
    params = _named_params(est, rank)
    for _, p in params:
        local = torch.linspace(0.5, -0.25, p.local.numel())
        p.grad = RaggedTensor(local, p.ragged_shard, rank)
    optimizer = _optimizer(opt, params)
    optimizer.step()
    stats = optimizer.last_step_stats
    keys = ("matrices", "matrices_local", "ns_flops_max", "ns_flops_mean", "bytes_sent")
    return {key: stats[key] for key in keys}


@pytest.mark.parametrize("opt", ["muon", "muon-cut"])
def test_muon_balance_is_what_a_real_muon_step_reports(pool, opt: str) -> None:
    ranks = pool.run(_muon_step, opt, timeout=120)
    mu = _estimate(pool.world_size, opt).muon
    first = ranks[0]
    assert first["matrices"] == mu.matrices
    assert first["matrices_local"] == mu.local_matrices
    assert first["ns_flops_max"] == mu.max_cost
    assert first["ns_flops_mean"] == pytest.approx(mu.mean_cost, rel=1e-12)
    sent = [r["bytes_sent"] for r in ranks]
    assert max(sent) == mu.moved_bytes_max
    assert math.isclose(sum(sent) / len(sent), mu.moved_bytes_mean)


def test_the_default_unit_keeps_experts_whole_where_free_as_fully_shard_does() -> None:
    # at W=2 whole experts (and whole slices of the 3-D conv) cost no padding over elements
    layer = MODEL.groups[1]
    est = _estimate(2, "adamw")
    planned = {t.name: t.unit for t in _plan_of(est, layer).layout.tensors}
    assert planned["mlp.experts.w1"] == planned["mlp.experts.3.w1"] == 48 * 64
    assert planned["conv.weight"] == 40 * 36 and planned["attn.wq.weight"] == 1
    assert "layer: mlp.experts.w1 (4, 48, 64): whole experts on ranks" in est.notes
