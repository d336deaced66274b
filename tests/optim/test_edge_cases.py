"""The optimizers at the edges a port from torch.optim relies on, bitwise against torch: in
drop-in mode, parameters frozen when the optimizer is built and unfrozen later (also after a
gradient assigned by hand), frozen later, unused for some steps (no gradient: no step, no
weight decay) or kept at zero gradients (``zero_grad(set_to_none=False)``), with 0-d and
1-element parameters, per-group lr and weight decay, in fp32, fp64 and bf16; Muon with
fully_shard on a matrix used twice and one unused; and a refused ``load_state_dict`` that
leaves the optimizer as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from raggedfsdp.optim import AdamW, Muon


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.tensor(1.25))
        self.shift = nn.Parameter(torch.full((1,), 0.5))
        self.use_c = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h)) * self.scale + self.shift
        return self.c(h) if self.use_c else h[:, :3]


def _groups(model: Net) -> list[dict]:
    decay = [model.a.weight, model.b.weight, model.c.weight]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    return [{"params": decay, "lr": 0.02}, {"params": rest, "weight_decay": 0.0}]


def _dropin_vs_torch(case: str, dtype: torch.dtype) -> list[str]:
    """Every rank sees the same batch, so the average is the local gradient exactly at W=2;
    returns the parameters that differ from torch.optim.AdamW's."""
    torch.manual_seed(0)
    model = Net().to(dtype)
    if case in ("unfreeze", "set_then_unfreeze"):
        model.b.requires_grad_(False)  # frozen while the optimizer is built
    reference = copy.deepcopy(model)
    opt = AdamW(_groups(model), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(_groups(reference), lr=0.05, weight_decay=0.1)
    for step in range(4):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).to(dtype)
        for m, o in ((model, opt), (reference, ref_opt)):
            if step == 2 and case in ("unfreeze", "set_then_unfreeze"):
                m.b.requires_grad_(True)
            if step == 2 and case == "freeze":
                m.a.requires_grad_(False)
            m.use_c = not (case in ("unused", "keep_zeros") and step in (1, 2))
            m(x).square().mean().backward()
            if step == 0 and case == "set_then_unfreeze":  # a gradient the user assigns
                m.b.bias.grad = torch.full_like(m.b.bias, 0.25)
            o.step()
            o.zero_grad(set_to_none=case != "keep_zeros")
    return [
        name
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True)
        if not torch.equal(p, q)
    ]


@pytest.mark.parametrize("world_size", [2])
def test_dropin_freezing_unfreezing_and_unused_parameters_step_as_torch(pool):
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for case in ("unfreeze", "set_then_unfreeze", "freeze", "unused", "keep_zeros"):
            for differ in pool.run(_dropin_vs_torch, case, dtype):
                assert not differ, (case, dtype, differ)


class Reuse(nn.Module):
    """``b`` runs twice per forward, ``head`` only when ``use_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 10, bias=False)
        self.b = nn.Linear(10, 10, bias=False)
        self.head = nn.Linear(10, 3)
        self.use_head = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.b(self.a(x)))))
        return self.head(h) if self.use_head else h[:, :3]


def _muon_fsdp_vs_torch() -> list[str]:
    from raggedfsdp import fully_shard

    torch.manual_seed(0)
    model = Reuse()
    reference = copy.deepcopy(model)
    fully_shard(model, shard_policy=Muon.shard_policy(whole_matrices=False))  # NS on owners
    head = {"params": list(model.head.parameters()), "use_muon": False, "lr": 0.01}
    mats = [reference.a.weight, reference.b.weight]
    opts = {
        id(model): [Muon([{"params": [model.a.weight, model.b.weight]}, head], lr=0.02)],
        id(reference): [
            torch.optim.Muon(mats, lr=0.02),
            torch.optim.AdamW(  # Muon's AdamW groups take Muon's weight_decay (0.1)
                reference.head.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1
            ),
        ],
    }
    for step in range(4):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        for m in (model, reference):
            m.use_head = step not in (1, 2)
            m(x).square().mean().backward()
            for o in opts[id(m)]:
                o.step()
                o.zero_grad()
    return [
        name
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True)
        if not torch.equal(p.full_tensor(), q)
    ]


@pytest.mark.parametrize("world_size", [2])
def test_muon_on_fully_shard_with_a_reused_and_an_unused_layer_steps_as_torch(pool):
    for differ in pool.run(_muon_fsdp_vs_torch):
        assert not differ, differ


def test_a_refused_load_state_dict_changes_nothing():
    a, b = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(5))
    fresh = AdamW([a, b], lr=0.1)
    opt = AdamW([a, b], lr=0.1)
    a.grad, b.grad = torch.ones(3), torch.ones(5)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    bad_shape = copy.deepcopy(saved)
    bad_shape["state"][0]["exp_avg"].fill_(7.0)  # fine, but the next entry is not
    bad_shape["state"][1]["exp_avg"] = torch.zeros(4)
    bad_shape["param_groups"][0]["lr"] = 0.5
    bad_keys = copy.deepcopy(bad_shape)
    bad_keys["state"][1]["exp_avg"] = torch.zeros(5)
    del bad_keys["state"][1]["exp_avg_sq"]
    for bad, match in ((bad_shape, r"state 'exp_avg': shape \(4,\)"), (bad_keys, "has keys")):
        for target in (opt, fresh):  # with state, and single mode's lazily created state
            before = copy.deepcopy(target.state_dict())
            with pytest.raises(ValueError, match=match):
                target.load_state_dict(bad)
            after = target.state_dict()
            assert after["param_groups"] == before["param_groups"]
            assert after["state"].keys() == before["state"].keys()
            for i, state in before["state"].items():
                assert all(torch.equal(v, after["state"][i][k]) for k, v in state.items())
    opt.load_state_dict(saved)  # still loads a good one
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.state[a]["exp_avg"], opt.state[a]["exp_avg"])


def test_an_optimizer_over_meta_parameters_is_refused_with_the_fix():
    """The sharded modes allocate state at construction: on the meta device it would stay
    there after ``to_empty`` (the step then failed deep in torch)."""
    from raggedfsdp import fully_shard

    with torch.device("meta"):
        model = Net()
    fully_shard(model)
    for build in (AdamW, Muon):
        with pytest.raises(ValueError, match=r"on the meta device.*after model\.to_empty"):
            build([model.a.weight])
    model.to_empty(device="cpu")
    opt = AdamW(model.parameters())  # the fix works
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
