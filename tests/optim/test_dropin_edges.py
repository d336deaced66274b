"""Drop-in (ZeRO-2) mode and torch's own way of zeroing gradients.

``model.zero_grad(set_to_none=False)`` zeroes each ``p.grad`` in place, which is valid torch
code and must step exactly as ``torch.optim.AdamW`` does; reusing a gradient the last step
reduced (stepping again, or a backward onto it, without zeroing) must still be refused. Every
rank sees the same batch, so the reference averages identical gradients with the same
collective and the comparison is bitwise at any world size.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raggedfsdp.optim import AdamW


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) if self.use_b else h[:, :3]


def _backward(model: Net, step: int) -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()


def _model_zero_grad_vs_torch() -> list[str]:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    opt = AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(5):
        for m in (model, reference):
            m.use_b = step != 2  # b keeps its zeroed gradient for a step: torch steps it
            _backward(m, step)
        for p in reference.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        ref_opt.step()
        model.zero_grad(set_to_none=False)
        reference.zero_grad(set_to_none=False)
    return [
        name
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True)
        if not torch.equal(p, q)
    ]


@pytest.mark.parametrize("world_size", [2, 3])
def test_model_zero_grad_in_place_steps_as_torch(pool):
    for differ in pool.run(_model_zero_grad_vs_torch):
        assert not differ, differ


def _refusals() -> list[str]:
    """Each way of reusing a reduced gradient, then the fix; returns what went wrong."""
    problems = []
    torch.manual_seed(0)
    model = Net()
    opt = AdamW(model.parameters(), lr=0.05)
    cases = {
        "step again": lambda: None,
        "backward onto it": lambda: _backward(model, 1),
        "only a zeroed": lambda: (model.a.zero_grad(set_to_none=False), _backward(model, 1)),
    }
    for case, between in cases.items():
        _backward(model, 0)
        opt.step()
        between()
        try:
            opt.step()
            problems.append(f"{case}: not refused")
        except RuntimeError as e:
            if "still the one the last step() reduced" not in str(e):
                problems.append(f"{case}: {e}")
        opt.zero_grad()
    for zero in (lambda: model.zero_grad(), lambda: opt.zero_grad(set_to_none=False)):
        _backward(model, 0)
        opt.step()
        zero()
        _backward(model, 1)
        opt.step()  # the fixes are accepted
        opt.zero_grad()
    return problems


@pytest.mark.parametrize("world_size", [2])
def test_reusing_a_reduced_gradient_is_still_refused(pool):
    for problems in pool.run(_refusals):
        assert not problems, problems


def _load_error() -> str:
    from raggedfsdp.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = Net()
    opt = AdamW(model.parameters(), lr=0.05)
    _backward(model, 0)
    opt.step()
    bad = get_optimizer_state_dict(model, opt)
    bad["state"]["a.bias"]["exp_avg"] = torch.zeros(5)
    try:
        set_optimizer_state_dict(model, opt, bad)
    except ValueError as e:
        return str(e)
    return "not refused"


@pytest.mark.parametrize("world_size", [2])
def test_a_load_error_names_the_parameter_by_its_name_in_the_model(pool):
    for message in pool.run(_load_error):
        assert message.startswith("'a.bias' (param_groups[0][1]) state 'exp_avg'"), message
