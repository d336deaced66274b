"""Saving and loading at the edges: every optimizer on a real ``fully_shard`` model saved at one
world size and resumed at another (DCP and full state dicts, HSDP to FSDP), torch's AdamW state
dicts in both directions, frozen / never-stepped / empty-rank / bf16 parameters, and bad
checkpoints refused in one line before anything changes.

Gradients are set directly (small integers times 2^-8, the same on every rank, see
``tests.support.optim_helpers``): the optimizers are bitwise W-invariant on them, so a resumed
run must equal the uninterrupted one bitwise whatever the two world sizes.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from raggedfsdp.fsdp import fully_shard
from raggedfsdp.optim import SOAP, AdamW, AdamW8bit, Muon, Shampoo, split_muon_params
from raggedfsdp.sharding import RaggedTensor
from raggedfsdp.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from tests.support.optim_helpers import exact_grads

STEPS, AT = 4, 2  # train STEPS steps; the checkpoint is taken before step AT
LATE = AT + 1
B = 4  # Shampoo / SOAP block size: several blocks per matrix, cut edges


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "AdamW":
        return AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    if name == "AdamW8bit":
        return AdamW8bit(model.parameters(), lr=0.01, min_8bit_size=64)
    if name == "Muon":
        return Muon(split_muon_params(model, lr=0.01), lr=0.02)
    if name == "Shampoo":
        return Shampoo(model.parameters(), lr=0.05, epsilon=1e-6, max_preconditioner_dim=B)
    return SOAP(model.parameters(), lr=0.01, max_preconditioner_dim=B, precondition_frequency=2)


def _policy(name: str):
    return {
        "AdamW": AdamW.shard_policy(),
        "AdamW8bit": AdamW8bit.shard_policy(min_8bit_size=64),
        "Muon": Muon.shard_policy(),
        "Shampoo": Shampoo.shard_policy(B),
        "SOAP": SOAP.shard_policy(B),
    }[name]


def _model(name: str, seed: int, mesh=None) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 10), nn.GELU(), nn.Linear(10, 7), nn.Linear(7, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, shard_policy=_policy(name))
    fully_shard(model, mesh=mesh, shard_policy=_policy(name))
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One optimizer step on exact gradients; frozen parameters get none, and those named
    ``late`` none before step ``LATE`` (after the checkpoint: saved without any state)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    grads = exact_grads(shapes, step, 1, same=True)
    for n, p in model.named_parameters():
        if not p.requires_grad or (n.startswith("late") and step < LATE):
            continue
        full = grads[n][0].to(p.dtype)
        if isinstance(p, RaggedTensor):
            start, stop = p.local_range
            p.grad = RaggedTensor(full.reshape(-1)[start:stop].clone(), p.ragged_shard, p.rank)
        else:
            p.grad = full.clone()
    opt.step()
    opt.zero_grad()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _save(name: str, path: str, via: str, hsdp: bool = False) -> dict[str, torch.Tensor]:
    """Train STEPS steps, checkpointing before step AT; the final full parameters."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = _model(name, 0, mesh)
    opt = _optimizer(name, model)
    for step in range(STEPS):
        if step == AT and via == "dcp":
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        elif step == AT:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full = get_state_dict(model, opt, options=options)
            if dist.get_rank() == 0:
                torch.save(full, path)
        _step(model, opt, step)
    return _full(model)


def _dcp_load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """Load a DCP checkpoint of ``{"model", "optim"}`` into ``model`` and ``opt`` in place."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _resume(name: str, path: str, via: str) -> dict[str, torch.Tensor]:
    """A model built from another seed loads the checkpoint and runs steps AT.."""
    model = _model(name, 5)
    opt = _optimizer(name, model)
    if via == "dcp":
        _dcp_load(model, opt, path)
    else:
        saved = torch.load(path, weights_only=True) if dist.get_rank() == 0 else ({}, {})
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, saved[0], options=options)
        set_optimizer_state_dict(model, opt, saved[1], options=options)
    for step in range(AT, STEPS):
        _step(model, opt, step)
    return _full(model)


# Each optimizer once per route, the world-size pairs spread over them (all 40 combinations and
# HSDP for all pass; this subset keeps the file fast).
RESUMES = [
    ("AdamW", "dcp", 2, 3, False),
    ("AdamW", "full", 3, 2, False),
    ("AdamW8bit", "dcp", 3, 2, False),
    ("AdamW8bit", "full", 4, 1, False),
    ("Muon", "dcp", 4, 1, False),
    ("Muon", "full", 1, 3, False),
    ("Shampoo", "dcp", 1, 3, False),
    ("Shampoo", "full", 2, 3, False),
    ("SOAP", "dcp", 3, 2, False),
    ("SOAP", "full", 4, 1, False),
    ("Muon", "dcp", 4, 3, True),  # HSDP 2x2 saves, plain FSDP at 3 loads
    ("AdamW8bit", "full", 4, 3, True),
]


@pytest.mark.parametrize(("name", "via", "a", "b", "hsdp"), RESUMES)
def test_saved_at_one_world_size_resumes_bitwise_at_another(
    dist_pool, tmp_path, name, via, a, b, hsdp
):
    path = str(tmp_path / "ckpt")
    expected = dist_pool(a).run(_save, name, path, via, hsdp)[0]
    for rank, resumed in enumerate(dist_pool(b).run(_resume, name, path, via)):
        for n, value in expected.items():
            assert torch.equal(resumed[n], value), (rank, n)


def _plain(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 10), nn.GELU(), nn.Linear(10, 7), nn.Linear(7, 3))


def _torch_adamw_interchange() -> dict[str, bool]:
    """torch.optim.AdamW (one process) -> our AdamW on fully_shard, and back, mid-run."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict as torch_set

    plain, ours = _plain(), _model("AdamW", 5)
    torch_opt = torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.1)
    opt = _optimizer("AdamW", ours)
    for step in range(AT):
        _step(plain, torch_opt, step)
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(ours, plain.state_dict(), options=full)
    opt.load_state_dict(torch_opt.state_dict())  # torch's format, full tensors
    _step(plain, torch_opt, AT)
    _step(ours, opt, AT)
    into_ours = all(torch.equal(v, plain.state_dict()[n]) for n, v in _full(ours).items())
    back, back_opt = _plain(7), torch.optim.AdamW(_plain(7).parameters())
    back_opt = torch.optim.AdamW(back.parameters(), lr=0.5)
    back.load_state_dict(get_model_state_dict(ours, options=full))
    torch_set(back, back_opt, get_optimizer_state_dict(ours, opt, options=full), options=full)
    for step in range(AT + 1, STEPS):
        for m, o in ((plain, torch_opt), (back, back_opt), (ours, opt)):
            _step(m, o, step)
    expected = plain.state_dict()
    return {
        "into_ours": into_ours,
        "ours_continued": all(torch.equal(v, expected[n]) for n, v in _full(ours).items()),
        "back_in_torch": all(torch.equal(v, expected[n]) for n, v in back.state_dict().items()),
    }


class _Edges(nn.Module):
    """A frozen weight, a layer without gradients until after the checkpoint, and a tiny one
    that leaves ranks empty at W=4 (the module is never run: gradients are set directly)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(12, 10)
        self.frozen.weight.requires_grad_(False)
        self.late = nn.Linear(10, 7)
        self.tiny = nn.Linear(3, 1)


def _edges(name: str, seed: int, dtype: torch.dtype, wrap: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    model = _Edges().to(dtype)
    if wrap:
        for layer in model.children():
            fully_shard(layer, shard_policy=_policy(name))
        fully_shard(model, shard_policy=_policy(name))
    return model


def _edges_run(name: str, path: str, dtype: torch.dtype, save: bool) -> dict[str, torch.Tensor]:
    """As ``_save`` / ``_resume`` (DCP) on ``_Edges``; with AdamW, torch.optim.AdamW on the
    unsharded model runs alongside and must agree bitwise."""
    model = _edges(name, 0 if save else 5, dtype)
    opt = _optimizer(name, model)
    if not save:
        _dcp_load(model, opt, path)
    for step in range(0 if save else AT, STEPS):
        if save and step == AT:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        _step(model, opt, step)
    result = _full(model)
    if name == "AdamW":
        plain = _edges(name, 0, dtype, wrap=False)
        torch_opt = torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.1)
        for step in range(STEPS):
            _step(plain, torch_opt, step)
        result["torch"] = all(torch.equal(v, plain.state_dict()[n]) for n, v in result.items())
    return result


@pytest.mark.parametrize("world_size", [3])
def test_torch_adamw_state_dicts_load_into_ours_and_back(pool):
    for res in pool.run(_torch_adamw_interchange):
        assert all(res.values()), res


# Muon on bf16 parameters is not W-invariant (W=2, 4 differ from torch.optim.Muon by a bf16 ulp,
# W=1, 3 do not, without any checkpoint), so Muon runs here in fp32.
EDGES = [("AdamW", torch.float32), ("AdamW", torch.bfloat16), ("AdamW8bit", torch.bfloat16)]
EDGES += [("Muon", torch.float32), ("Shampoo", torch.float32), ("SOAP", torch.bfloat16)]


@pytest.mark.parametrize(("name", "dtype"), EDGES)
def test_frozen_late_and_empty_rank_parameters_resume_bitwise(dist_pool, tmp_path, name, dtype):
    path = str(tmp_path / "ckpt")
    expected = dist_pool(4).run(_edges_run, name, path, dtype, True)[0]
    assert expected.pop("torch", True)
    for rank, resumed in enumerate(dist_pool(3).run(_edges_run, name, path, dtype, False)):
        assert resumed.pop("torch", True), rank
        for n, value in expected.items():
            assert torch.equal(resumed[n], value), (rank, n)


# ----------------------------------------------------------------------------- bad input
def _other(kind: str) -> nn.Module:
    """A model with an extra layer, one layer fewer, or another width."""
    torch.manual_seed(1)
    widths = {"extra": (12, 10, 7, 3, 2), "missing": (12, 10, 7), "shape": (12, 10, 8, 3)}[kind]
    layers = [nn.Linear(i, o) for i, o in itertools.pairwise(widths)]
    model = nn.Sequential(layers[0], nn.GELU(), *layers[1:])
    for layer in layers:
        fully_shard(layer)
    return fully_shard(model)


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The full parameters and optimizer state tensors (``step`` aside)."""
    states = {
        f"{i}.{key}": value.full_tensor()
        for i, state in enumerate(opt.state.values())
        for key, value in state.items()
        if key != "step"
    }
    return {**_full(model), **states}


def _refusals() -> dict[str, tuple[str, bool]]:
    """Each bad load: (the error's first line, model and optimizer unchanged and usable)."""
    full = StateDictOptions(full_state_dict=True)
    streamed = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    bad = {
        kind: get_model_state_dict(_other(kind), options=full)
        for kind in ("extra", "missing", "shape")
    }
    muon = _model("Muon", 1)
    bad["optimizer class"] = get_optimizer_state_dict(muon, _optimizer("Muon", muon), options=full)
    model = _model("AdamW", 5)
    opt = _optimizer("AdamW", model)
    _step(model, opt, 0)
    groups = opt.state_dict()  # torch's index-keyed form: the groups must match
    groups["param_groups"] = [
        dict(groups["param_groups"][0], params=[i]) for i in groups["param_groups"][0]["params"]
    ]
    bad["groups"] = groups
    before = _snapshot(model, opt)
    out = {}
    for kind, state in bad.items():
        try:
            if kind in ("extra", "missing", "shape"):
                set_model_state_dict(model, state if dist.get_rank() == 0 else {}, options=streamed)
            elif kind == "groups":
                opt.load_state_dict(state)
            else:
                set_optimizer_state_dict(model, opt, state, options=full)
            message = "no error"
        except ValueError as e:
            message = str(e)
        after = _snapshot(model, opt)
        out[kind] = (message, all(torch.equal(before[k], after[k]) for k in before))
    _step(model, opt, 1)  # still usable
    return out


@pytest.mark.parametrize("world_size", [3])
def test_bad_checkpoints_are_refused_in_one_line_before_anything_changes(pool):
    expected = {
        "extra": r"unexpected keys \['4.bias', '4.weight'\].*strict=False",
        "missing": r"missing keys \['3.bias', '3.weight'\]",
        "shape": r"'2.weight' has shape \(8, 10\) in the state dict but \(7, 10\)",
        "optimizer class": (
            r"'0\.weight' \(param_groups\[0\]\[0\]\).*keeps \['exp_avg', 'exp_avg_sq', 'step'\]"
        ),
        "groups": r"6 parameter groups, this optimizer 1",
    }
    for res in pool.run(_refusals):
        for kind, (message, unchanged) in res.items():
            assert re.search(expected[kind], message) and "\n" not in message, (kind, message)
            assert unchanged, kind
