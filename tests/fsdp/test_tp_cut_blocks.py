"""Shampoo and SOAP on TP parameters whose TP split cuts their blocks, at W=4: each global
slab is computed on one owner over data parallel x TP (``raggedfsdp.optim.tp_slabs``), so
given the same gradients the step and the per-block state equal one process's, bitwise, and
the owner-held state reshards with DCP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

import raggedfsdp
from raggedfsdp.optim import SOAP, Shampoo
from raggedfsdp.sharding import strict
from tests.support.optim_helpers import assert_ranks_match
from tests.support.tp_models import llama_batch, llama_loss, make_llama, tp_meshes, wrapped_llama

LR = 3e-3
STEPS = 3
BLOCKED = {"Shampoo": Shampoo, "SOAP": SOAP}
#: Cuts every TP-split weight of the tiny Llama (16 x 16 attention, 32 x 16 / 16 x 32 MLP,
#: 32 x 16 embedding and head) at tp 2 and 4: slabs across colwise TP blocks, blocks across
#: rowwise column blocks, and edge blocks (16 = 12 + 4).
BLOCK = 12


def _options(name: str, **extra) -> dict:
    options = {"lr": LR, "max_preconditioner_dim": BLOCK} | extra
    return options | ({"precondition_frequency": 1} if name == "Shampoo" else {})


def _gradients(named, seed: int = 10) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(p.shape, generator=gen) for n, p in named} for _ in range(STEPS)]


def _step_with(named, grads: list[dict], opt) -> None:
    for step in grads:
        for n, p in named:
            p.grad = torch.empty_like(p).copy_(step[n])  # this rank's piece (or all of it)
        opt.step()


def _full_state(opt, named) -> dict[str, torch.Tensor]:
    """Every state tensor but the step counters, gathered whole (global coordinates)."""
    return {
        f"{n}.{key}": value.full_tensor() if hasattr(value, "full_tensor") else value
        for n, p in named
        for key, value in opt.state[p].items()
        if key != "step"
    }


def _blocked_on_tp(dims: tuple[int, ...], grads: list[dict], name: str, options: dict) -> dict:
    model, _, _ = wrapped_llama(dims, raggedfsdp.fully_shard)  # element units: dp cuts too
    named = list(model.named_parameters())
    opt = BLOCKED[name](named, **options)
    _step_with(named, grads, opt)
    return {
        "params": {n: p.full_tensor() for n, p in named},
        "state": _full_state(opt, named),
        "owner_slabs": opt.last_step_stats["owner_slabs"],
        "bytes_sent": opt.last_step_stats["bytes_sent"],
    }


def _reference(name: str, options: dict) -> tuple[dict, dict, list[dict]]:
    reference = make_llama()
    named = list(reference.named_parameters())
    grads = _gradients(named)
    opt = BLOCKED[name](named, **options)
    _step_with(named, grads, opt)
    return {n: p.detach() for n, p in named}, _full_state(opt, named), grads


@pytest.mark.parametrize("name", BLOCKED)
@pytest.mark.parametrize("dims", [(2, 2), (1, 4), (2, 1, 2)], ids=lambda d: "x".join(map(str, d)))
def test_cut_blocks_step_equals_one_process(dist_pool, dims, name):
    """Slabs the TP split (and the dp split) cut are assembled on their owners: parameters
    and every state tensor equal one process's bitwise, and the moved slabs are counted."""
    options = _options(name)
    params, state, grads = _reference(name, options)
    results = dist_pool(4).run(_blocked_on_tp, dims, grads, name, options)
    assert_ranks_match(results, params, state)
    assert sum(r["owner_slabs"] for r in results) > 0 and sum(r["bytes_sent"] for r in results)


class _Experts(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(weight)


EXPERTS = (2, 8, 12)  # Shampoo's view: 16 x 12 rows of (expert, row); TP on dim 1 interleaves


def _experts_on_tp(dims, dim: int, grads: list[torch.Tensor], name: str, options: dict) -> dict:
    tp_mesh, dp_mesh, _, _ = tp_meshes(dims)
    weight = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(3))
    module = _Experts(distribute_tensor(weight, tp_mesh, [Shard(dim)]))
    raggedfsdp.fully_shard(module, mesh=dp_mesh)
    named = [("w", module.w)]
    opt = BLOCKED[name](named, **options)
    _step_with(named, [{"w": g} for g in grads], opt)
    return {"w": module.w.full_tensor(), "state": _full_state(opt, named)}


@pytest.mark.parametrize("name", BLOCKED)
@pytest.mark.parametrize("dim, block", [(1, 6), (1, 4), (2, 4), (2, 6)])
def test_cut_blocks_of_3d_tensors(dist_pool, dim, block, name):
    """A split on the middle dim of a 3-D tensor interleaves the TP ranks' rows of the
    blocked view: 6-row slabs mix them (each slab's rows are put back in order on its owner),
    4-row slabs lie whole on one TP rank but out of rank order (owners then take balanced
    shares, so state stays split in rank order); one on the last dim splits the view's
    columns (6-wide blocks: each TP block holds one whole block column, the local path, whose
    grafting norms see contiguous blocks as one process's do). SOAP per dim as well: its
    slabs' later dims are the tensor's."""
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(EXPERTS, generator=gen) for _ in range(STEPS)]
    extras = [{}] + ([{"tensor_factors": "per_dim"}] if name == "SOAP" else [])
    for extra in extras:
        options = _options(name, max_preconditioner_dim=block, **extra)
        reference = _Experts(torch.randn(EXPERTS, generator=torch.Generator().manual_seed(3)))
        named = [("w", reference.w)]
        opt = BLOCKED[name](named, **options)
        _step_with(named, [{"w": g} for g in grads], opt)
        state = _full_state(opt, named)
        for result in dist_pool(4).run(_experts_on_tp, (2, 2), dim, grads, name, options):
            assert torch.equal(result["w"], reference.w.detach()), extra
            for key, value in state.items():
                assert torch.equal(result["state"][key], value), (key, extra)


# ----------------------------------------------------------------------------- checkpoints
def _save_cut(dims, grads, name: str, options: dict, path: str) -> None:
    model, _, _ = wrapped_llama(dims, raggedfsdp.fully_shard)
    named = list(model.named_parameters())
    opt = BLOCKED[name](named, **options)
    _step_with(named, grads, opt)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)


def _load_cut(dims, name: str, options: dict, path: str) -> dict:
    model, _, _ = wrapped_llama(dims, raggedfsdp.fully_shard)
    named = list(model.named_parameters())
    opt = BLOCKED[name](named, **options)
    sd = {"optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    opt.load_state_dict(sd["optim"])
    return _full_state(opt, named)


@pytest.mark.parametrize("name", BLOCKED)
def test_owner_held_state_reshards_with_dcp(dist_pool, tmp_path, name):
    """State saved at dp 2 x tp 2 (owners over dp x tp) loads at dp 1 x tp 4, where other
    ranks own other slabs, equal to one process's state."""
    options = _options(name)
    _, state, grads = _reference(name, options)
    path = str(tmp_path / "ckpt")
    dist_pool(4).run(_save_cut, (2, 2), grads, name, options, path)
    for loaded in dist_pool(4).run(_load_cut, (1, 4), name, options, path):
        assert loaded.keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(loaded[key], value), key


# ----------------------------------------------------------------------------- refusals
def _strict_refusal() -> str:
    try:
        wrapped_llama((1, 4), raggedfsdp.fully_shard, shard_policy=strict(Shampoo.shard_policy(8)))
    except ValueError as error:
        return str(error)
    return ""


def test_strict_policy_still_refuses_a_cut_block(dist_pool):
    """``strict(policy)`` is the contract that no other split cuts the policy's blocks: a TP
    split that cuts Shampoo's slabs is refused at ``fully_shard``, before any optimizer."""
    for message in dist_pool(4).run(_strict_refusal):
        assert "strict shard policy" in message and "cuts" in message, message
        assert "\n" not in message


# ----------------------------------------------------------------------------- end to end
E2E_STEPS, ROWS = 10, 8
# Shampoo's inverse roots, recomputed every step here, turn the last-bit gradient differences of
# another reduction order into loss differences near 1e-5 in fp32 (9.3e-6 at (2, 2) on one
# machine, 1.9e-5 on another, 3.8e-6 at (4, 1)): a bound that the machine's kernels decide. In
# fp64 they stay near 1e-13, so an error in the owners' math cannot hide under 1e-5. SOAP's
# eigenbases flip on differences of any size (1e-3 apart after 3 steps in fp64 as in fp32), so
# it trains in fp32 and is held to what plain FSDP shows.
E2E_DTYPE = {"Shampoo": torch.float64, "SOAP": torch.float32}


def _train(dims: tuple[int, ...] | None, name: str) -> list[float]:
    """Dp-mean losses of 10 steps with every parameter on Shampoo or SOAP (``dims`` None: one
    process), blocks cut by the TP split."""
    dtype = E2E_DTYPE[name]
    if dims is None:
        model, index, size = make_llama(dtype=dtype), 0, 1
    else:
        model, index, size = wrapped_llama(dims, raggedfsdp.fully_shard, dtype)
    opt = BLOCKED[name](model.parameters(), **_options(name))
    per, losses = ROWS // size, []
    for step in range(E2E_STEPS):
        inputs, targets = llama_batch(step % 3, ROWS)
        rows = slice(index * per, (index + 1) * per)
        loss = llama_loss(model, inputs[rows], targets[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        if dims is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", BLOCKED)
def test_training_over_dp_and_tp_matches_one_process(dist_pool, name):
    """10 steps at (2, 2) with cut blocks: losses within 1e-5 of one process (Shampoo, fp64:
    3e-13), or within what plain FSDP at the same W (4, 1) shows where that is more (SOAP's
    eigenbases amplify the last-bit gradient differences of any reduction order: 8.3e-4 at
    (4, 1), 4.7e-4 at (2, 2))."""
    reference = _train(None, name)

    def worst(dims: tuple[int, int]) -> float:
        runs = dist_pool(4).run(_train, dims, name)
        return max(abs(a - b) for losses in runs for a, b in zip(losses, reference, strict=True))

    assert worst((2, 2)) < max(1e-5, worst((4, 1)))
