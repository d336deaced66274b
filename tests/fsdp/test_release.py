"""A fully_shard-ed model its user drops is freed, buffers and all (one process)."""

from __future__ import annotations

import gc
import weakref

import torch

from raggedfsdp import fully_shard
from tests.support.tiny_models import batch, loss_fn, make_model


def test_a_deleted_model_frees_its_flat_buffers():
    """Before, every unsharded parameter's gradient hook held its group strongly: a cycle
    through a tensor's hooks that the garbage collector does not traverse, so the model and
    its buffers lived until the process ended."""
    model = make_model()
    for block in model.layers:
        fully_shard(block)
    del block  # the loop's name would keep the last block (and through it the rest) alive
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn(model, *batch(0, 2)).backward()
    opt.step()
    refs = [weakref.ref(model), weakref.ref(model._fsdp_state().group.master.shard)]
    del model, opt
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
