"""raggedfsdp.state_dict: torch's state-dict helpers with RaggedTensors gathered (full state
dicts, e.g. a Hugging Face export) and cut (loading one, streamed from rank 0), checked by
resuming training bitwise and across world sizes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict

from raggedfsdp.sharding import RaggedTensor
from raggedfsdp.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from tests.support.fsdp_training import shard_blocks, train
from tests.support.tiny_models import make_model


def _trained(seed: int = 0, steps: int = 2, optimizer: str = "torch"):
    """A fully_shard model trained ``steps`` steps with torch's AdamW, or ours (8-bit)."""
    if optimizer == "torch":
        model = shard_blocks(make_model(seed=seed))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        from raggedfsdp.optim import AdamW8bit

        model = shard_blocks(make_model(seed=seed), shard_policy=AdamW8bit.shard_policy())
        opt = AdamW8bit(model.parameters(), lr=1e-2)
    train(model, opt, steps)
    return model, opt


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if torch.is_tensor(t)]


def _equal_trees(a, b) -> bool:
    flat_a, flat_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(flat_a) == len(flat_b) and all(
        torch.equal(x, y) if torch.is_tensor(x) else x == y
        for x, y in zip(flat_a, flat_b, strict=True)
    )


def _full_of(model, opt) -> tuple[dict, dict]:
    """The expected full state dicts: torch's sharded ones with each piece gathered."""
    model_sd, optim_sd = torch_get_state_dict(model, opt)
    return torch.utils._pytree.tree_map_only(
        RaggedTensor, lambda t: t.full_tensor(), (model_sd, optim_sd)
    )


def _full_round_trip(flatten: bool) -> dict:
    model, opt = _trained()
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=flatten)
    full_model, full_optim = get_state_dict(model, opt, options=options)
    expected = _full_of(model, opt)
    offloaded = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    fresh, fresh_opt = _trained(seed=9, steps=1)
    mine = dist.get_rank() == 0  # only rank 0 has the files' contents
    # as read from a file: state dicts alias live tensors (AdamW's ``step``), as torch's do
    on_disk = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, (full_model, full_optim))
    set_state_dict(
        fresh,
        fresh_opt,
        model_state_dict=on_disk[0] if mine else {},
        optim_state_dict=on_disk[1] if mine else {},
        options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, flatten_optimizer_state_dict=flatten
        ),
    )
    states_sharded = all(
        isinstance(value, RaggedTensor)
        for state in fresh_opt.state.values()
        for key, value in state.items()
        if key != "step"
    )
    after_load = _equal_trees(_full_of(fresh, fresh_opt), _full_of(model, opt))
    train(model, opt, 2, start=2)
    train(fresh, fresh_opt, 2, start=2)
    return {
        "plain_tensors": not any(isinstance(t, RaggedTensor) for t in _tensors(full_optim))
        and not any(isinstance(t, RaggedTensor) for t in _tensors(full_model)),
        "gathered_equal": _equal_trees(full_model, expected[0])
        and (flatten or _equal_trees(full_optim, expected[1])),
        "offload_rank0_only": (
            all(t.device.type == "cpu" for t in offloaded.values())
            and _equal_trees(offloaded, expected[0])
            if mine
            else offloaded == {}
        ),
        "states_sharded": states_sharded,
        "loaded_equal": after_load,
        "resumed_bitwise": _equal_trees(_full_of(fresh, fresh_opt), _full_of(model, opt)),
    }


def test_full_state_dicts_gather_and_load_streamed_from_rank0(pool):
    for res in pool.run(_full_round_trip, False):
        assert all(res.values()), res


@pytest.mark.parametrize("world_size", [3])
def test_flattened_optimizer_state_round_trips(pool):
    for res in pool.run(_full_round_trip, True):
        assert all(res.values()), res


def _export(path: str, optimizer: str) -> dict:
    model, opt = _trained(steps=3, optimizer=optimizer)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_state_dict(model, opt, options=options)
    if dist.get_rank() == 0:
        torch.save(full, path)
    return {}


def _import(path: str, optimizer: str) -> bool:
    model, opt = _trained(seed=5, steps=1, optimizer=optimizer)
    saved = torch.load(path, weights_only=True) if dist.get_rank() == 0 else ({}, {})
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_state_dict(
        model, opt, model_state_dict=saved[0], optim_state_dict=saved[1], options=options
    )
    reloaded = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    mine = torch.load(path, weights_only=True)
    return _equal_trees(reloaded, mine)


@pytest.mark.parametrize("optimizer", ["torch", "adamw8bit"])
def test_full_state_saved_at_3_loads_at_2_and_1(dist_pool, tmp_path, optimizer):
    path = str(tmp_path / "full.pt")
    dist_pool(3).run(_export, path, optimizer)
    for world in (2, 1):
        assert all(dist_pool(world).run(_import, path, optimizer)), world


def _async_checkpoint(path: str) -> dict:
    """torchtitan's checkpointing: torch's sharded state dicts, ``dcp.async_save`` (which
    stages a deep copy on the CPU), then load and resume."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict as sharded_get
    from torch.distributed.checkpoint.state_dict import set_state_dict as sharded_set

    model, opt = _trained()
    model_sd, optim_sd = sharded_get(model, opt)
    dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path).result()
    fresh, fresh_opt = _trained(seed=9, steps=1)
    model_sd, optim_sd = sharded_get(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    sharded_set(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _equal_trees(_full_of(fresh, fresh_opt), _full_of(model, opt))
    train(model, opt, 2, start=2)
    train(fresh, fresh_opt, 2, start=2)
    return {
        "loaded": loaded,
        "resumed": _equal_trees(_full_of(fresh, fresh_opt), _full_of(model, opt)),
    }


@pytest.mark.parametrize("world_size", [3])
def test_async_save_then_load_resumes_bitwise(pool, tmp_path):
    for res in pool.run(_async_checkpoint, str(tmp_path / "ckpt")):
        assert all(res.values()), res
