"""FSDP2 behaviours a ported training loop relies on (issue 31), each against a reference that
does not shard: state dicts taken mid-step are the sharded ones, and training goes on as if
none had been taken."""

from __future__ import annotations

import pytest
import torch

from raggedfsdp.sharding import RaggedTensor
from tests.support.fsdp_training import full_params, my_rows, shard_blocks, train
from tests.support.tiny_models import batch, loss_fn, make_model

ROWS = 12  # divisible by every world size tested


def _mid_step_state_dicts(reshard_after_forward: bool, take: bool) -> dict:
    """Two steps; with ``take``, a state dict between forward and backward (loaded back into
    the model) and another after backward, in the first."""
    model = shard_blocks(make_model(), reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = batch(0, ROWS)
    loss = loss_fn(model, my_rows(inputs), my_rows(targets))
    result = {}
    if take:
        mid = model.state_dict()
        sharded = dict(model.named_parameters())
        result["types"] = {n: type(t).__name__ for n, t in mid.items()}
        result["same"] = all(
            mid[n].local.data_ptr() == p.local.data_ptr() for n, p in sharded.items()
        )
        model.load_state_dict(mid)  # loads into the sharded parameters too
    loss.backward()
    if take:
        result["after_backward"] = {n: type(t).__name__ for n, t in model.state_dict().items()}
    opt.step()
    opt.zero_grad()
    train(model, opt, 1, start=1)
    return result | {"params": full_params(model)}


@pytest.mark.parametrize("reshard_after_forward", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_between_forward_and_backward_is_sharded(
    dist_pool, world, reshard_after_forward
):
    """FSDP2's rule: the sharded parameters, whatever ``reshard_after_forward``; training
    then goes on bitwise as without the state dicts."""
    pool = dist_pool(world)
    control = pool.run(_mid_step_state_dicts, reshard_after_forward, False)[0]["params"]
    for result in pool.run(_mid_step_state_dicts, reshard_after_forward, True):
        assert set(result["types"].values()) == {"RaggedTensor"}, result["types"]
        assert result["same"]
        assert set(result["after_backward"].values()) == {"RaggedTensor"}
        for n, value in control.items():
            assert torch.equal(result["params"][n], value), n


def _forward_after_state_dict() -> tuple[float, float]:
    """``reshard_after_forward=False`` keeps the gathered memory: a state dict between two
    forwards, and the second forward still computes with the gathered parameters."""
    model = shard_blocks(make_model(), reshard_after_forward=False)
    inputs, targets = batch(0, ROWS)
    with torch.no_grad():
        first = loss_fn(model, my_rows(inputs), my_rows(targets))
        state = model.state_dict()
        second = loss_fn(model, my_rows(inputs), my_rows(targets))
    assert all(isinstance(t, RaggedTensor) for t in state.values())
    return first.item(), second.item()


def test_forward_after_a_mid_step_state_dict(dist_pool):
    for first, second in dist_pool(2).run(_forward_after_state_dict):
        assert first == second


def _cast_after_wrapping(cast: str, before: bool) -> dict[str, torch.Tensor]:
    """Two steps of a model cast to ``cast`` before or after ``fully_shard``."""
    model = make_model()
    if before:
        model = getattr(model, cast)()
    shard_blocks(model)
    if not before:
        model = getattr(model, cast)()  # FSDP2: the sharded storage is cast
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 2)
    params = full_params(model)
    assert all(isinstance(p, RaggedTensor) for p in model.parameters())
    return {n: p for n, p in params.items()}


@pytest.mark.parametrize("cast", ["double", "bfloat16"])
def test_casting_after_wrapping_is_casting_before(dist_pool, cast):
    for world in (2, 3):
        pool = dist_pool(world)
        before = pool.run(_cast_after_wrapping, cast, True)[0]
        for after in pool.run(_cast_after_wrapping, cast, False):
            for n, value in before.items():
                assert (
                    after[n].dtype
                    == value.dtype
                    == getattr(torch, {"double": "float64", "half": "float16"}.get(cast, cast))
                )
                assert torch.equal(after[n], value), n
