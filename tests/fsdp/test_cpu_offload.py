"""CPU offload (FSDP2's ``CPUOffloadPolicy``, issue 31) on gloo: the sharded parameters and
gradients (and so the optimizer state) in host memory, the gathers from a device copy of the
local segment. On this CPU-only machine host and device are one, so the copies are plain ones,
but every offload code path runs; training must equal the run without offload, bitwise."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

import raggedfsdp
from tests.support.fsdp_training import full_params, shard_blocks, train
from tests.support.tiny_models import make_model


def _trained(offload: bool, pin: bool = False, accumulate: bool = False, hsdp: bool = False):
    kwargs = {"offload_policy": CPUOffloadPolicy(pin_memory=pin)} if offload else {}
    if hsdp:
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard_blocks(make_model(), **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if accumulate:  # one micro-batch without sync, then the synced one
        model.set_requires_gradient_sync(False)
        train(model, opt, 0)
        from tests.support.fsdp_training import ROWS, my_rows
        from tests.support.tiny_models import batch, loss_fn

        inputs, targets = batch(5, ROWS)
        loss_fn(model, my_rows(inputs), my_rows(targets)).backward()
        model.set_requires_gradient_sync(True)
    losses = train(model, opt, 3)
    groups = [
        m._fsdp_state().group for m in model.modules() if isinstance(m, raggedfsdp.FSDPModule)
    ]
    return {
        "losses": losses,
        "params": full_params(model),
        "separate_compute": all(g.compute is not g.master for g in groups if g is not None),
        "on_host": all(p.local.device.type == "cpu" and p.grad is None for p in model.parameters()),
        "state_on_host": all(
            t.local.device.type == "cpu"
            for s in opt.state.values()
            for t in s.values()
            if hasattr(t, "local")
        ),
    }


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("pin", [False, True])
def test_offload_trains_as_without_it(dist_pool, world, pin):
    pool = dist_pool(world)
    control = pool.run(_trained, False)[0]
    for result in pool.run(_trained, True, pin):
        assert result["separate_compute"] and result["on_host"] and result["state_on_host"]
        assert result["losses"] == control["losses"]
        for n, value in control["params"].items():
            assert torch.equal(result["params"][n], value), n


def test_offload_with_gradient_accumulation_and_hsdp(dist_pool):
    pool = dist_pool(4)
    for kwargs in ({"accumulate": True}, {"hsdp": True}):
        control = pool.run(_trained, False, **kwargs)[0]
        for result in pool.run(_trained, True, **kwargs):
            assert result["losses"] == control["losses"], kwargs
            for n, value in control["params"].items():
                assert torch.equal(result["params"][n], value), (kwargs, n)


def test_offload_bad_input_is_one_line():
    model = make_model()
    with pytest.raises(TypeError, match=r"offload_policy='cpu'.*CPUOffloadPolicy"):
        raggedfsdp.fully_shard(model, offload_policy="cpu")
    assert not isinstance(model, raggedfsdp.FSDPModule)
    raggedfsdp.fully_shard(model.layers[0])  # without offload
    with pytest.raises(ValueError, match=r"submodule 'layers.0' was wrapped without CPU offload"):
        raggedfsdp.fully_shard(model, offload_policy=CPUOffloadPolicy())
    raggedfsdp.fully_shard(model.layers[1], offload_policy=OffloadPolicy())  # FSDP2's "none"
