"""AdamW's merged runs are planned once (``optim.runs.RunPlan``) and stay right when things move.

One process, ``RaggedTensor`` parameters viewing one planned flat shard (fully_shard's layout at
W=1). Each step's gradients lie somewhere else: in a fresh flat buffer (fully_shard's
reduce-scatter output), in separate tensors, missing for one parameter; between steps the
state dict is reloaded and the parameters are moved to new storage (fully_shard's
``Module._apply`` support swaps them). Every step must equal torch's AdamW bitwise, and runs
are searched for only when something moved.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import raggedfsdp.optim.adamw as adamw_module
import raggedfsdp.optim.runs as runs_module
from raggedfsdp.optim import AdamW
from raggedfsdp.sharding import FlatBuffer, RaggedTensor
from tests.support.optim_helpers import init_tensors, ragged_params, set_ragged_grads

SHAPES = {"w": (7, 5), "b": (13,), "cube": (3, 4, 5), "big": (16, 9)}

# How each step's gradients are given, and what happens after the step
SCHEDULE = [
    ("fresh", None),
    ("fresh", None),
    ("fresh", None),
    ("separate", None),  # each its own tensor: not the plan's runs, merged on the spot
    ("reversed", None),  # one tensor, the pieces in the other order: not the plan's runs
    ("fresh", "load"),  # a state dict round trip: new step counters
    ("fresh", None),
    ("skip b", None),  # 'b' misses a step: two step counters from now on
    ("fresh", "move"),  # the parameters move to new storage
    ("fresh", None),
    ("fresh", None),
]


def _grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _reversed_grads(params: dict[str, nn.Parameter], grads: dict[str, torch.Tensor]) -> None:
    """Every gradient a view of one tensor, laid out in the reverse order of the parameters."""
    flat = torch.cat([grads[n].reshape(-1) for n in reversed(list(params))])
    offset = flat.numel()
    for n, p in params.items():
        offset -= grads[n].numel()
        p.grad = RaggedTensor(flat[offset : offset + grads[n].numel()], p.ragged_shard, 0)


def _move(params: dict[str, nn.Parameter], layout) -> FlatBuffer:
    """New storage for every parameter, as ``ParamGroup.convert`` makes it (same objects)."""
    moved = FlatBuffer(layout, 0, torch.float32)
    for n, p in params.items():
        local = moved.shard_view(n)
        local.copy_(p.local)
        torch.utils.swap_tensors(p, nn.Parameter(RaggedTensor(local, p.ragged_shard, 0)))
    return moved


@pytest.mark.parametrize(
    "config", [{}, {"foreach": True, "amsgrad": True}], ids=["loop", "foreach"]
)
def test_planned_runs_equal_torch_bitwise_while_things_move(monkeypatch, config):
    searches = []
    for module in (adamw_module, runs_module):
        original = module.merge_runs
        monkeypatch.setattr(
            module, "merge_runs", lambda e, f=original: searches.append(len(e)) or f(e)
        )
    init = init_tensors(SHAPES)
    params, grad_buf = ragged_params(init, AdamW.shard_policy(), 1, 0)
    layout, kept = grad_buf.layout, []
    ref = {n: nn.Parameter(t.clone()) for n, t in init.items()}
    opt = AdamW(list(params.values()), lr=0.01, weight_decay=0.1, **config)
    ref_opt = torch.optim.AdamW(list(ref.values()), lr=0.01, weight_decay=0.1, **config)
    searched_at = []
    for step, (given, after) in enumerate(SCHEDULE):
        grads = _grads(step)
        skip = "b" if given == "skip b" else None
        for n, q in ref.items():
            q.grad = None if n == skip else grads[n].clone()
        if given == "reversed":
            _reversed_grads(params, grads)
        else:
            kept.append(None if given == "separate" else FlatBuffer(layout, 0, torch.float32))
            set_ragged_grads({n: p for n, p in params.items() if n != skip}, grads, kept[-1])
        before = len(searches)
        opt.step()
        ref_opt.step()
        searched_at += [step] * (len(searches) > before)
        opt.zero_grad()
        ref_opt.zero_grad()
        for n in SHAPES:
            assert torch.equal(params[n].local.view(SHAPES[n]), ref[n].detach()), (step, n)
        if after == "load":
            opt.load_state_dict(opt.state_dict())
        elif after == "move":
            kept.append(_move(params, layout))
    # planned at the first step, after the load (plans drop with state changes), for the
    # pieces that step without 'b' and for 'b' on its own counter the step after, and after
    # the move; separate or reordered gradients are merged on the spot (the plan kept for the
    # next step); a fresh gradient buffer alone searches nothing
    assert searched_at == [0, 3, 4, 6, 7, 8, 9], searched_at
    mine, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    for i in theirs:
        for key, value in theirs[i].items():
            got = mine[i][key]
            got = got.local.view(value.shape) if isinstance(got, RaggedTensor) else got
            assert torch.equal(got, value), (i, key)
