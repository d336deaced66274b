"""The optimizer step pre-hook that guards sharded parameters is installed by the first
``fully_shard``, not by importing raggedfsdp: torch runs global pre-hooks before every optimizer's
step in the process, so merely importing the package must leave torch's optimizers alone. It
refuses an optimizer built before ``fully_shard`` (which would silently update nothing)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch.optim.optimizer import _global_optimizer_pre_hooks as hooks

    import raggedfsdp
    import raggedfsdp.checkpoint
    import raggedfsdp.fsdp
    import raggedfsdp.optim
    import raggedfsdp.state_dict

    assert len(hooks) == 0, f"import registered {len(hooks)} optimizer step pre-hook(s)"
    first = raggedfsdp.fsdp.fully_shard(torch.nn.Linear(4, 4))
    assert len(hooks) == 1, f"after the first fully_shard: {len(hooks)} hooks"
    second = raggedfsdp.fsdp.fully_shard(torch.nn.Linear(4, 4))
    assert len(hooks) == 1, f"after the second fully_shard: {len(hooks)} hooks"

    # the guard lets ordinary steps through, ours and plain torch's
    for model, opt in (
        (first, raggedfsdp.optim.AdamW(first.parameters())),
        (second, torch.optim.SGD(second.parameters(), lr=0.1)),
    ):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    print("ok")
    """
)


def test_fully_shard_installs_the_step_guard_once_and_import_does_not() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# ----------------------------------------------------------------------------- stale optimizers
def _step_error(opt: torch.optim.Optimizer) -> str:
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _optimizers_built_before_wrapping() -> dict:
    """An optimizer built before fully_shard holds the tensors it replaced: ours (named) and
    torch's SGD (unnamed, and already stepped once before the wrap, so the guard's cached check
    must be redone). Each step is refused before touching anything; one built afterwards
    trains."""
    from raggedfsdp import fully_shard
    from raggedfsdp.optim import AdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    ours = AdamW(model.named_parameters(), lr=0.1)
    theirs = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard(torch.nn.Linear(2, 2))  # another model: the guard is in place, model is not
    model(torch.ones(2, 4)).sum().backward()
    theirs.step()  # still model's own parameters: allowed (and the check is cached)
    theirs.zero_grad()
    ours_state = {k: v.clone() for k, v in ours.state[model[0].weight].items()}
    fully_shard(model[0])
    fully_shard(model)
    model(torch.ones(2, 4)).sum().backward()
    before = {n: p.full_tensor() for n, p in model.named_parameters()}
    errors = [_step_error(ours), _step_error(theirs)]
    unchanged = all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    ours_kept = all(
        torch.equal(ours.state[ours.param_groups[0]["params"][0]][k], v)
        for k, v in ours_state.items()
    )
    fresh = AdamW(model.parameters(), lr=0.1)
    fresh.step()
    trained = not any(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    return {
        "errors": errors,
        "unchanged": unchanged,
        "ours_kept": ours_kept,
        "theirs_state": len(theirs.state),
        "trained": trained,
    }


@pytest.mark.parametrize("world_size", [1, 3])
def test_an_optimizer_built_before_fully_shard_is_refused_at_its_step(pool) -> None:
    for result in pool.run(_optimizers_built_before_wrapping):
        ours, theirs = result["errors"]
        assert ours.startswith("AdamW.step(): parameter '0.weight' is the tensor that"), ours
        assert "fully_shard (on Linear) replaced with a sharded parameter as 'weight'" in ours
        assert theirs.startswith("SGD.step(): parameter param_groups[0][0] is the tensor"), theirs
        for message in (ours, theirs):
            assert "Build the optimizer after fully_shard" in message
        assert result["unchanged"] and result["ours_kept"] and result["theirs_state"] == 0
        assert result["trained"]
