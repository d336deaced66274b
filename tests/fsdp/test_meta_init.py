"""FSDP2's meta-device initialisation and module conversions on fully_shard-ed models.

Build under ``torch.device("meta")`` (no memory), wrap, ``to_empty(device=...)``, initialise:
the weights must be exactly those of the unsharded model initialised with the same seed, at
every world size, and training must then match one process. ``to()`` / ``to_empty()`` keep the
parameters (the same objects) views of new flat buffers; conversions a group cannot follow are
refused before anything changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from raggedfsdp import fully_shard
from raggedfsdp.sharding import RaggedShard, RaggedTensor
from tests.support.fsdp_training import full_params, max_diff, shard_blocks, train
from tests.support.tiny_models import TinyTransformer, batch, loss_fn, make_model


def _init_weights(model: nn.Module, seed: int) -> None:
    """torchtitan-style: normal embedding, truncated-normal matrices (rejection sampling with a
    global ``any()``), uniform biases, unit norms."""
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if name == "embed.weight":
            nn.init.normal_(param)
        elif param.dim() > 1:
            nn.init.trunc_normal_(param, std=0.02)
        elif name.endswith("bias"):
            nn.init.uniform_(param, -0.1, 0.1)
        else:
            nn.init.ones_(param)


def _views_of_flat_buffers(model: nn.Module) -> bool:
    states = {getattr(m, "_raggedfsdp_state", None) for m in model.modules()} - {None}
    groups = {id(s.group): s.group for s in states if s.group is not None}
    return bool(groups) and all(
        mp.sharded is loc_module._parameters[name]
        and mp.sharded.local.untyped_storage().data_ptr()
        == g.master.shard.untyped_storage().data_ptr()
        for g in groups.values()
        for mp in g.params
        for loc_module, name in mp.locations
    )


def _equal(a: nn.Module, b: nn.Module) -> bool:
    full_a, full_b = full_params(a), full_params(b)
    return full_a.keys() == full_b.keys() and all(torch.equal(full_a[n], full_b[n]) for n in full_a)


def _meta_init_then_train(steps: int, hsdp: bool = False) -> dict:
    reference = TinyTransformer()
    _init_weights(reference, seed=3)
    reference_next_draw = torch.rand(4)
    with torch.device("meta"):
        model = TinyTransformer()
    if hsdp:  # 2 replicas x 2 shards: each replica draws the same weights
        shard_blocks(model, mesh=init_device_mesh("cpu", (2, 2)))
    else:
        shard_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before: must stay valid
    before = [id(p) for p in model.parameters()]
    model.to_empty(device="cpu")
    _init_weights(model, seed=3)
    result = {
        "same_parameter_objects": before == [id(p) for p in model.parameters()],
        "views_of_flat_buffers": _views_of_flat_buffers(model),
        "generator_advanced_as_one_process": torch.equal(torch.rand(4), reference_next_draw),
        "init_diff": max_diff(model, reference),
    }
    train(model, opt, steps)
    train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), steps, sharded=False)
    return result | {"train_diff": max_diff(model, reference)}


def test_meta_device_init_equals_one_process_init_and_trains_the_same(pool):
    for res in pool.run(_meta_init_then_train, 3):
        assert res["same_parameter_objects"] and res["views_of_flat_buffers"], res
        assert res["generator_advanced_as_one_process"], res
        assert res["init_diff"] == 0.0, res  # bitwise, at every world size
        assert res["train_diff"] < 2e-5, res


@pytest.mark.parametrize("world_size", [4])
def test_meta_device_init_with_hsdp(pool):
    for res in pool.run(_meta_init_then_train, 2, True):
        assert res["init_diff"] == 0.0 and res["views_of_flat_buffers"], res
        assert res["train_diff"] < 2e-5, res


def _round_trip_through_meta(steps: int) -> dict:
    """Train, save the full weights, move to meta (memory gone), to_empty, load, train on:
    identical to a model that never moved, and a forward on meta says what to do."""
    moved, stayed = shard_blocks(make_model()), shard_blocks(make_model())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (moved, stayed)]
    for model, opt in zip((moved, stayed), opts, strict=True):
        train(model, opt, steps)
    saved = full_params(moved)
    same_device = moved.to("cpu")  # nothing to convert: the same buffers
    kept = _views_of_flat_buffers(moved) and _equal(moved, stayed)
    moved.to("meta")
    on_meta = all(p.device.type == "meta" for p in moved.parameters())
    try:
        loss_fn(moved, *batch(0, 2))
        meta_error = ""
    except RuntimeError as error:
        meta_error = str(error)
    moved.to_empty(device="cpu")
    moved.load_state_dict(saved)
    for model, opt in zip((moved, stayed), opts, strict=True):
        train(model, opt, steps, start=steps)
    return {
        "returns_module": same_device is moved,
        "same_device_kept": kept,
        "on_meta": on_meta,
        "meta_error": meta_error,
        "views_after": _views_of_flat_buffers(moved),
        "identical": _equal(moved, stayed),
    }


@pytest.mark.parametrize("world_size", [2])
def test_moving_to_meta_and_back_keeps_training_identical(pool):
    for res in pool.run(_round_trip_through_meta, 2):
        assert res["returns_module"] and res["same_device_kept"] and res["on_meta"], res
        assert "on the meta device: call module.to_empty(device=...)" in res["meta_error"], res
        assert res["views_after"] and res["identical"], res


def _refused_conversions() -> dict:
    model = shard_blocks(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    before = full_params(model)
    errors = {}
    try:
        model._apply(lambda t: t.int())  # Module.to() takes float dtypes only; _apply does not
    except TypeError as error:
        errors["int"] = str(error)
    model.layers[1].unshard()
    try:
        model.to_empty(device="cpu")
    except RuntimeError as error:
        errors["gathered"] = str(error)
    model.layers[1].reshard()
    unchanged = all(p.dtype == torch.float32 for p in model.parameters()) and all(
        torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters()
    )
    losses = train(model, opt, 2, start=1)  # still trains: nothing was half converted
    return {"errors": errors, "unchanged": unchanged, "views": _views_of_flat_buffers(model)} | {
        "trains": losses[-1] < losses[0]
    }


@pytest.mark.parametrize("world_size", [2])
def test_conversions_a_group_cannot_follow_are_refused_without_changes(pool):
    for res in pool.run(_refused_conversions):
        errors = res["errors"]
        assert "holds torch.float32 parameters and cannot become torch.int32" in errors["int"]
        assert "(not a float)" in errors["int"]
        assert "'layers.1' is gathered" in errors["gathered"]
        assert res["unchanged"] and res["views"] and res["trains"], res


def _global_any_all() -> dict:
    """``any()`` / ``all()`` of a RaggedTensor answer for the whole tensor on every rank."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    spec = RaggedShard.even((world * 2 + 1, 3), world, 3, "w")
    last = world - 1
    values = torch.zeros(spec.length(rank), dtype=torch.bool)
    if rank == last:
        values[-1] = True  # one True element, on the last rank only
    flags = RaggedTensor(values, spec, rank)
    ones = RaggedTensor(torch.ones(spec.length(rank), dtype=torch.bool), spec, rank)
    return {"any": flags.any().item(), "all": flags.all().item(), "all_ones": ones.all().item()}


@pytest.mark.parametrize("world_size", [3])
def test_any_and_all_are_global(pool):
    for res in pool.run(_global_any_all):
        assert res == {"any": True, "all": False, "all_ones": True}


def test_wrapping_on_meta_with_a_list_group_and_tied_weights_keeps_ties():
    """One process: a list-form group and a tied head survive to_empty as one parameter."""
    with torch.device("meta"):
        model = TinyTransformer(dim=16, vocab=16)
    model.head.weight = model.embed.weight
    fully_shard([model.layers[0], model.layers[1]])  # one group for two modules
    fully_shard(model)  # the tied embedding and head
    model.to_empty(device="cpu")
    _init_weights(model, seed=1)
    assert model.head.weight is model.embed.weight
    assert all(p.device.type == "cpu" for p in model.parameters())
    loss_fn(model, *batch(0, 2, vocab=16)).backward()
    assert model.embed.weight.grad is not None
