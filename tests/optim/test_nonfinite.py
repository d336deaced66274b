"""Non-finite gradients: with ``skip_nonfinite_steps`` every rank skips the same step, leaves
parameters and state untouched, and counts it."""

import pytest
import torch
import torch.distributed as dist

from raggedfsdp import fully_shard
from raggedfsdp.optim import AdamW
from tests.support.tiny_models import batch, loss_fn, make_model


def _snapshot(model, opt):
    params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    state = {
        (n, k): v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
        for n, p in model.named_parameters()
        for k, v in opt.state[p].items()
    }
    return params, state


def _skip_on_nan(drop_in: bool) -> dict:
    model = make_model()
    if not drop_in:
        for layer in model.layers:
            fully_shard(layer, shard_policy=AdamW.shard_policy())
        fully_shard(model, shard_policy=AdamW.shard_policy())
    opt = AdamW(model.parameters(), lr=1e-2)
    opt.skip_nonfinite_steps = True
    loss_fn(model, *batch(0, 2)).backward()
    opt.step()
    opt.zero_grad()
    before = _snapshot(model, opt) if not drop_in else None
    loss_fn(model, *batch(1, 2)).backward()
    if dist.get_rank() == 1:  # one rank's gradient goes bad
        grad = model.layers[0].w1.weight.grad
        (grad.local if hasattr(grad, "local") else grad).view(-1)[0] = float("nan")
    opt.step()
    opt.zero_grad()
    unchanged = before is None or all(
        torch.equal(a, b)
        for old, new in zip(before, _snapshot(model, opt), strict=True)
        for a, b in zip(old.values(), new.values(), strict=True)
    )
    loss_fn(model, *batch(2, 2)).backward()
    opt.step()
    finite = all(
        bool(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all())
        for p in model.parameters()
    )
    return {"skipped": opt.skipped_steps, "unchanged": unchanged, "finite_after": finite}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("drop_in", [False, True], ids=["fsdp", "drop-in"])
def test_a_nan_on_one_rank_skips_the_step_everywhere(pool, drop_in):
    for res in pool.run(_skip_on_nan, drop_in):
        assert res == {"skipped": 1, "unchanged": True, "finite_after": True}, res
