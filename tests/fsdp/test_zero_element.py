"""Zero-element parameters (``nn.Linear(0, 4)``'s ``(4, 0)`` weight) under ``fully_shard``:
every built-in policy gives them a unit, and DCP saves and reloads them at another world size
(with their optimizer state), as it does for plain modules."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from raggedfsdp import fully_shard
from raggedfsdp.optim import AdamW, AdamW8bit, Muon, Shampoo
from raggedfsdp.sharding import Box, RaggedShard, row_units, slice_units
from raggedfsdp.state_dict import get_state_dict, set_state_dict

# torch warns that initialising the empty weight does nothing: that is the point here
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")


class _WithEmpty(nn.Module):
    """A tiny model with a zero-width input projection (as a model with an optional feature
    switched off has) beside ordinary layers."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.extra = nn.Linear(0, 4)  # weight (4, 0): no elements; bias (4,)
        self.body = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.extra(x[:, :0])


def _trained(seed: int, optimizer: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _WithEmpty(seed)
    fully_shard(model)
    kind = torch.optim.AdamW if optimizer == "torch" else AdamW
    opt = kind(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, opt)
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        flat |= {f"optim.{fqn}.{k}": v for k, v in state.items()}
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in flat.items()}


def _save(path: str, optimizer: str) -> dict:
    model, opt = _trained(0, optimizer)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _full(model, opt)


def _load(path: str, optimizer: str) -> dict:
    model, opt = _trained(1, optimizer)  # other values everywhere: all must come from disk
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(model, opt)


@pytest.mark.parametrize("optimizer", ["torch", "ours"])
def test_zero_element_parameters_save_at_3_and_load_at_2(dist_pool, tmp_path, optimizer):
    path = str(tmp_path / "ckpt")
    saved = dist_pool(3).run(_save, path, optimizer)[0]
    assert saved["model.extra.weight"].shape == (4, 0)
    assert saved["optim.extra.weight.exp_avg"].shape == (4, 0)
    for loaded in dist_pool(2).run(_load, path, optimizer):
        assert saved.keys() == loaded.keys()
        for name in saved:
            assert torch.equal(saved[name], loaded[name]), name


def test_an_empty_tensor_is_one_empty_chunk_on_rank_0():
    """DCP records a tensor only if some rank writes a chunk of it: rank 0 writes the empty
    box (a plain empty tensor is one chunk too), the other ranks none."""
    spec = RaggedShard.even((4, 0), 3, 1)
    assert spec.boxes(0) == [Box((0, 0), (4, 0))]
    assert spec.boxes(1) == spec.boxes(2) == []


@pytest.mark.parametrize(
    "policy",
    [
        row_units(32),
        slice_units(),
        Muon.shard_policy(),
        Shampoo.shard_policy(),
        AdamW8bit.shard_policy(),
        AdamW8bit.shard_policy(tile=(32, 32), min_8bit_size=0),
    ],
    ids=["row_units", "slice_units", "muon", "shampoo", "adamw8bit", "adamw8bit_tiles"],
)
def test_every_builtin_policy_shards_a_zero_width_parameter(policy):
    """The unit-0 error recommends ``row_units(32)``: that and every built-in policy must give
    a zero-width parameter a unit of at least one element."""
    model = _WithEmpty(0)
    fully_shard(model, shard_policy=policy)
    assert model.extra.weight.shape == (4, 0)
    assert model.extra.weight.ragged_shard.unit >= 1


def test_a_policy_returning_0_names_the_parameter_its_shape_and_a_fix_that_works():
    model = _WithEmpty(0)
    with pytest.raises(ValueError, match=r"'extra\.weight' \(shape \(4, 0\)\).*row_units\(32\)"):
        fully_shard(model, shard_policy=lambda fqn, p: 32 * p.shape[-1] if p.dim() > 1 else 1)
    fully_shard(model, shard_policy=row_units(32))  # the suggested fix
