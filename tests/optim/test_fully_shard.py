"""The optimizers on parameters from the real ``raggedfsdp.fully_shard``, sharded with their own
``shard_policy()``: training matches one process bitwise.

Every rank sees the same batch, so the averaged gradient equals the local one exactly at W=2
(``(g + g) / 2``); at other world sizes the gloo sum may round, which is the reduction's doing,
not the optimizer's (the other optimizer tests feed exact gradients for that).
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

from raggedfsdp.optim import AdamW, AdamW8bit
from raggedfsdp.sharding import RaggedTensor

OPTIMIZERS = {  # name: (sharded optimizer, one-process reference, shard policy)
    "AdamW": (AdamW, torch.optim.AdamW, AdamW.shard_policy()),
    "AdamW8bit": (AdamW8bit, AdamW8bit, AdamW8bit.shard_policy()),
    # torch's own optimizers on RaggedTensor parameters, on their foreach and fused kernels
    "torch AdamW foreach": (*[partial(torch.optim.AdamW, foreach=True)] * 2, None),
    "torch AdamW fused": (*[partial(torch.optim.AdamW, fused=True)] * 2, None),
    "torch SGD fused": (*[partial(torch.optim.SGD, momentum=0.9, fused=True)] * 2, None),
}


def _train(name: str) -> list[tuple[str, bool, bool]]:
    from raggedfsdp.fsdp import fully_shard

    sharded_cls, reference_cls, policy = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 96), torch.nn.Linear(96, 5)
    )
    reference = copy.deepcopy(model)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, shard_policy=policy)
    fully_shard(model, shard_policy=policy)
    opt = sharded_cls(model.parameters(), lr=0.01)
    ref_opt = reference_cls(reference.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (reference, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    return [
        (n, isinstance(p, RaggedTensor), torch.equal(p.full_tensor(), q.detach()))
        for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True)
    ]


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fully_shard_training_equals_one_process_bitwise(pool, name):
    for rank, result in enumerate(pool.run(_train, name)):
        for param, ragged, equal in result:
            assert ragged and equal, (rank, param)
