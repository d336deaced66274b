"""The optimizer contract: the hooks a subclass must write, and the units the runtime plans with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from raggedfsdp.optim import AdamW, ShardedOptimizer
from raggedfsdp.sharding import GroupShardPolicy, ShardPolicy
from tests.support.optim_helpers import init_tensors

SHAPES = {"w": (8, 6), "b": (6,), "v": (5, 7)}


def test_a_subclass_without_its_math_cannot_be_built() -> None:
    class NoUpdate(ShardedOptimizer):
        @classmethod
        def shard_policy(cls, **config: Any) -> ShardPolicy:
            return lambda fqn, param: 1

        def _policy(self) -> ShardPolicy:
            return self.shard_policy()

    with pytest.raises(TypeError, match=r"_new_step.*_state_specs.*_update"):
        NoUpdate([torch.nn.Parameter(torch.zeros(3))], {})


class _WholeMatrices(GroupShardPolicy):
    """A group policy that keeps 2-D tensors whole and records the groups it was shown."""

    def __init__(self) -> None:
        self.groups: list[tuple[list[str], int]] = []

    def __call__(self, fqn: str, param: Any) -> int:
        return 1  # what a per-parameter caller would get: it must not be used for buckets

    def units_for_group(self, tensors: Sequence[Any], world_size: int) -> dict[str, int]:
        self.groups.append(([name for name, _, _ in tensors], world_size))
        return {n: shape[0] * shape[1] if len(shape) == 2 else 1 for n, shape, _ in tensors}


class _GroupPolicyAdamW(AdamW):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.policy = _WholeMatrices()
        super().__init__(*args, **kwargs)

    def _policy(self) -> ShardPolicy:
        return self.policy


def _dropin_units() -> tuple[list, dict[str, int]]:
    params = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    opt = _GroupPolicyAdamW(list(params.items()))
    (bucket,) = opt._buckets
    return opt.policy.groups, {n: bucket.layout.shards[n].unit for n in SHAPES}


def test_dropin_buckets_let_a_group_policy_decide_for_the_bucket(dist_pool) -> None:
    for groups, units in dist_pool(2).run(_dropin_units):
        assert groups == [(list(SHAPES), 2)]
        assert units == {"w": 48, "b": 1, "v": 35}


def test_a_checkpoint_older_than_a_group_option_loads_with_this_groups_value() -> None:
    """Options added after a checkpoint was written (new hyper-parameters) are not in its
    param_groups: loading keeps this optimizer's value instead of dropping the key."""
    params = [torch.nn.Parameter(t) for t in init_tensors(SHAPES).values()]
    opt = AdamW(params, lr=0.1, weight_decay=0.0)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    del saved["param_groups"][0]["amsgrad"], saved["param_groups"][0]["maximize"]
    fresh = AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.1)
    fresh.load_state_dict(saved)
    group = fresh.param_groups[0]
    assert group["amsgrad"] is False and group["maximize"] is False
    assert group["weight_decay"] == 0.0  # saved values still win
    for p in fresh.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    fresh.step()  # the step reads every option
