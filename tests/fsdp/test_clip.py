"""Gradient clipping of fully_shard gradients with non-finite values and float64 gradients:
ours and torch's ``clip_grad_norm_`` see a NaN on any rank, as one process would, and float64
gradients keep float64's range."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raggedfsdp import clip_grad_norm_
from raggedfsdp.sharding import RaggedShard, RaggedTensor
from tests.support.fsdp_training import ROWS, my_rows, shard_blocks
from tests.support.tiny_models import batch, loss_fn, make_model

CLIPS = {"raggedfsdp": clip_grad_norm_, "torch": torch.nn.utils.clip_grad_norm_}


def _gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.full_tensor() for p in model.parameters()]


def _clip_with_a_nan_on_one_rank(bad: float) -> dict:
    """A NaN (or inf) in rank 1's piece of one gradient: each clip, at each norm type, raises
    with ``error_if_nonfinite`` and leaves the gradients as they were; without it, every rank
    gets the non-finite norm one process would."""
    model = shard_blocks(make_model())
    loss_fn(model, *(my_rows(t) for t in batch(0, ROWS))).backward()
    if dist.get_rank() == 1:
        piece = next(p.grad.local for p in model.parameters() if p.grad.local.numel())
        piece[0] = bad
    before = _gradients(model)
    outcome = {}
    for name, clip in CLIPS.items():
        for norm_type in (2.0, 1.0, math.inf):
            try:
                clip(model.parameters(), 1.0, norm_type, error_if_nonfinite=True)
                outcome[f"{name} {norm_type} raised"] = False
            except RuntimeError:
                outcome[f"{name} {norm_type} raised"] = True
            kept = all(
                torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
                for a, b in zip(before, _gradients(model), strict=True)
            )
            outcome[f"{name} {norm_type} kept gradients"] = kept
    grads = [p.grad for p in model.parameters()]
    norms = {n: torch.nn.utils.get_total_norm(grads, n).item() for n in (2.0, math.inf)}
    norms["ours"] = clip_grad_norm_(model.parameters(), 1.0, math.inf).item()
    return {"outcome": outcome, "norms": norms}


@pytest.mark.parametrize("world_size", [3])
@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_clip_grad_norm_raises_on_a_non_finite_gradient_in_any_rank(pool, bad):
    """Over gloo the inf-norm's MAX all-reduce dropped a NaN on rank 1: both clips returned a
    finite norm instead of raising (issue 18, item 1)."""
    for res in pool.run(_clip_with_a_nan_on_one_rank, bad):
        assert all(res["outcome"].values()), res["outcome"]
        if math.isnan(bad):
            assert all(math.isnan(v) for v in res["norms"].values()), res["norms"]
        else:
            assert all(v == math.inf for v in res["norms"].values()), res["norms"]


def _clip_float64() -> dict:
    """float64 gradients of 1e30 (squares overflow float32): the norm one process gets."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = RaggedShard.even((10,), world, 1, "big")
    start, stop = spec.local_range(rank)
    whole = torch.full((10,), 1e30, dtype=torch.float64)
    reference = nn.Parameter(torch.zeros(10, dtype=torch.float64))
    reference.grad = whole.clone()
    expected = torch.nn.utils.clip_grad_norm_([reference], 1.0).item()
    got = {}
    for name, clip in CLIPS.items():
        param = nn.Parameter(
            RaggedTensor(torch.zeros(stop - start, dtype=torch.float64), spec, rank)
        )
        param.grad = RaggedTensor(whole[start:stop].clone(), spec, rank)
        total = clip([param], 1.0)
        got[name] = (total.item(), total.dtype, param.grad.full_tensor())
    return {"expected": expected, "clipped": reference.grad, "got": got}


@pytest.mark.parametrize("world_size", [3])
def test_clip_grad_norm_of_float64_gradients_accumulates_in_float64(pool):
    for res in pool.run(_clip_float64):
        assert res["expected"] == pytest.approx(math.sqrt(10) * 1e30)
        for name, (total, dtype, clipped) in res["got"].items():
            assert total == pytest.approx(res["expected"], rel=1e-12), name
            assert dtype == torch.float64, name
            torch.testing.assert_close(clipped, res["clipped"], rtol=1e-12, atol=0)
