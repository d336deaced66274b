"""Shampoo, SOAP and AdamW8bit on EP x TP experts at W=4: the recipe's 2-block MoE model with the
TP plan, its fused experts DTensors on ``mesh["ep", "tp"]`` (``Shard(0)`` over ``ep``, ``d_ff``
``Shard(1)`` (w1, w3) or ``Shard(2)`` (w2) over ``tp``), sharded over ``dp_shard_mod_ep``.
Layouts: ep 2 x tp 2 (dp_shard_mod_ep 1) and ep 1 x tp 2 (dp_shard_mod_ep 2: the experts' dp
split cuts their TP blocks too). Given the same global gradients, parameters and every state
tensor after the steps equal the single-process optimizer's on the unsharded model, bitwise.

Shampoo and SOAP view a fused ``(E, d_ff, d)`` tensor as its ``(E·d_ff) × d`` matrix, as one
process does, and compute each global slab on one owner over dp x ep x tp
(``raggedfsdp.optim.tp_slabs``): blocks of 4 (w1's slabs within one TP block, but the TP ranks'
slabs interleave along the expert dim; w2's blocks whole in one TP column block) and of 6 (w1's
slabs cross TP blocks and experts, w2's blocks cross TP column blocks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from raggedfsdp.optim import SOAP, AdamW8bit, Shampoo
from recipes.llama.moe import MoETransformer
from tests.support.ep_steps import full_state, is_expert, step_with, tiny_moe, wrap_ep
from tests.support.optim_helpers import assert_ranks_match

W = 4
E = 4
LR = 3e-3
STEPS = 3
LAYOUTS = [(2, 2), (1, 2)]  # (ep, tp); dp_shard_mod_ep = 4 / (ep * tp)


def _ids(layout: tuple[int, int]) -> str:
    return f"ep{layout[0]}xtp{layout[1]}"


def _model() -> MoETransformer:
    return tiny_moe(E)


def _gradients(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) for n, p in _model().named_parameters()}


def _reference(make, grads: dict) -> tuple[dict, dict]:
    """One process: parameters and state after the steps."""
    model = _model()
    named = list(model.named_parameters())
    opt = make(named)
    step_with(named, grads, opt, STEPS)
    state = full_state(opt, named)
    return {n: p.detach() for n, p in named}, state


# ----------------------------------------------------------------------------- blocked
BLOCKED = {"Shampoo": Shampoo, "SOAP": SOAP}


def _blocked(name: str, block: int, extra: dict):
    options = {"lr": LR, "max_preconditioner_dim": block, "weight_decay": 0.01} | extra
    options |= {"precondition_frequency": 1} if name == "Shampoo" else {}
    return lambda named: BLOCKED[name](named, **options)


def _blocked_on_ep_tp(layout: tuple[int, int], grads: dict, name: str, block: int, extra: dict):
    model = wrap_ep(_model(), *layout)
    named = list(model.named_parameters())
    opt = _blocked(name, block, extra)(named)
    step_with(named, grads, opt, STEPS)
    return {
        "params": {n: p.full_tensor() for n, p in named},
        "state": full_state(opt, named),
        "owner_slabs": opt.last_step_stats["owner_slabs"],
    }


CASES = [("Shampoo", 4, {}), ("Shampoo", 6, {}), ("SOAP", 4, {}), ("SOAP", 6, {})]
CASES += [("SOAP", 4, {"tensor_factors": "per_dim"})]  # a factor per dim of (E, d_ff, d)


@pytest.mark.parametrize("name, block, extra", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_blocked_step_equals_one_process_on_ep_tp_experts(dist_pool, layout, name, block, extra):
    """Every parameter (experts, TP-split and replicated dense weights) and every state tensor
    (per-element and per-slab, gathered in global coordinates) bitwise one process's; some
    expert slabs move to their owners."""
    grads = _gradients(21)
    params, state = _reference(_blocked(name, block, extra), grads)
    assert any(is_expert(key) for key in state)
    results = dist_pool(W).run(_blocked_on_ep_tp, layout, grads, name, block, extra)
    assert_ranks_match(results, params, state)
    assert sum(r["owner_slabs"] for r in results) > 0


# ----------------------------------------------------------------------------- AdamW8bit
TILE = (4, 4)
EIGHT_BIT = {"lr": LR, "weight_decay": 0.1, "min_8bit_size": 64, "tile": TILE}


def _quantizable(name: str) -> bool:
    """Every parameter but w1 and w3, whose ``d_ff`` split over ``tp`` (after the expert dim)
    interleaves the TP ranks' tiles in the global grid (refused, see below)."""
    return not (is_expert(name) and name.endswith((".w1", ".w3")))


def _adamw8bit(named):
    return AdamW8bit([(n, p) for n, p in named if _quantizable(n)], **EIGHT_BIT)


def _adamw8bit_on_ep_tp(layout: tuple[int, int], grads: dict) -> dict:
    policy = AdamW8bit.shard_policy(tile=TILE, min_8bit_size=64)
    model = wrap_ep(_model(), *layout, shard_policy=policy)
    named = list(model.named_parameters())
    opt = _adamw8bit(named)
    step_with(named, grads, opt, STEPS)
    return {"params": {n: p.full_tensor() for n, p in named}, "state": full_state(opt, named)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_adamw8bit_tiles_split_on_ep_and_tp(dist_pool, layout):
    """w2 ``(E, d, d_ff)``: ``Shard(0)`` over ep splits the (E·d / 4, d_ff / 4) absmax grid's
    rows, ``Shard(2)`` over tp its columns; every 4 x 4 tile lies in one expert and one TP
    block. Parameters, 8-bit codes and absmax grids (global coordinates) bitwise one process."""
    grads = _gradients(22)
    params, state = _reference(_adamw8bit, grads)
    assert any(is_expert(k) and k.endswith("_absmax") for k in state)
    assert_ranks_match(dist_pool(W).run(_adamw8bit_on_ep_tp, layout, grads), params, state)


def _refusal(layout: tuple[int, int], options: dict) -> str:
    model = wrap_ep(_model(), *layout)
    experts = [(n, p) for n, p in model.named_parameters() if is_expert(n)]
    try:
        AdamW8bit(experts, lr=LR, **options)
    except ValueError as error:
        return str(error)
    raise AssertionError("AdamW8bit accepted w1 split after the expert dim")


@pytest.mark.parametrize("options", [{}, {"tile": TILE}], ids=["blocks", "tiles"])
def test_adamw8bit_refuses_interleaved_blocks_in_one_line(dist_pool, options):
    """w1's ``d_ff`` split over tp follows the expert dim: the TP ranks' blocks alternate in
    the global grid, which no ``Shard`` describes, so AdamW8bit refuses it at construction
    (before any state), naming the parameter, both splits and the fix."""
    for message in dist_pool(W).run(_refusal, (2, 2), {"min_8bit_size": 64, **options}):
        assert "\n" not in message, message
        assert message.startswith(
            "parameter 'layers.0.feed_forward.experts.w1' is split over the 'ep' x 'tp' mesh "
            "dims ((Shard(dim=0), Shard(dim=1)) over 2 x 2 ranks): the "
        ), message
        assert "the split of dim 1 interleaves them with the dims before it" in message, message
        assert "give it to AdamW, Muon, Shampoo or SOAP" in message, message


# ----------------------------------------------------------------------------- checkpoints
def _make(name: str):
    return _adamw8bit if name == "AdamW8bit" else _blocked(name, 6, {})


def _policy(name: str) -> dict:
    policy = AdamW8bit.shard_policy(tile=TILE, min_8bit_size=64)
    return {"shard_policy": policy} if name == "AdamW8bit" else {}


def _save(layout: tuple[int, int], grads: dict, name: str, path: str) -> None:
    model = wrap_ep(_model(), *layout, **_policy(name))
    named = list(model.named_parameters())
    opt = _make(name)(named)
    step_with(named, grads, opt, STEPS)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)


def _load(layout: tuple[int, int], name: str, path: str) -> dict:
    model = wrap_ep(_model(), *layout, **_policy(name))
    named = list(model.named_parameters())
    opt = _make(name)(named)
    sd = {"optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    opt.load_state_dict(sd["optim"])
    return full_state(opt, named)


@pytest.mark.parametrize("name", ["Shampoo", "SOAP", "AdamW8bit"])
def test_state_saved_at_ep2_tp2_loads_at_ep1_tp2(dist_pool, tmp_path, name):
    """Owner-held per-slab state (owners over ep x tp) and 8-bit grids split on both mesh
    dims, saved by DCP at ep 2 x tp 2, load at ep 1 x tp 2 x dp 2 (other owners, other
    pieces) equal to one process's state, bitwise."""
    grads, path = _gradients(23), str(tmp_path / "ckpt")
    _, state = _reference(_make(name), grads)
    dist_pool(W).run(_save, (2, 2), grads, name, path)
    for loaded in dist_pool(W).run(_load, (1, 2), name, path):
        assert loaded.keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(loaded[key], value), key


class _OneSplitAdamW8bit(AdamW8bit):
    """A subclass written for 1-D TP: its math does not claim several splits."""

    handles_multi_dim_tp = False


def _one_split_refusal() -> str:
    model = wrap_ep(_model(), 2, 2)
    experts = [(n, p) for n, p in model.named_parameters() if is_expert(n)]
    try:
        _OneSplitAdamW8bit(experts, lr=LR)
    except ValueError as error:
        return str(error)
    raise AssertionError("an optimizer without handles_multi_dim_tp accepted EP x TP experts")


def test_optimizer_without_multi_dim_tp_refuses_in_one_line(dist_pool):
    """``handles_multi_dim_tp`` unset: refused at construction, naming the fix."""
    for message in dist_pool(W).run(_one_split_refusal):
        assert "\n" not in message, message
        assert message.startswith(
            "parameter 'layers.0.feed_forward.experts.w1' is split over the 'ep' x 'tp' mesh "
            "dims ((Shard(dim=0), Shard(dim=1)) over 2 x 2 ranks): _OneSplitAdamW8bit knows "
            "pieces split on one mesh dim, not 2 (handles_multi_dim_tp unset)"
        ), message
        assert "give it to AdamW, Muon, Shampoo or SOAP" in message, message
