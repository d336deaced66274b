"""Optimizers on expert-parallel parameters at W=4, (dp_shard_mod_ep 2 x ep 2) and (1 x 4): the
recipe's 2-block MoE model with its fused experts ``Shard(0)`` over ``ep`` and sharded over
``dp_shard_mod_ep``, the dense weights over every rank (``recipes/llama/expert_parallel.py``).
Given the same global gradients, each sharded step equals the single-process step on the
unsharded model: AdamW bitwise ``torch.optim.AdamW``; Muon bitwise ``torch.optim.Muon`` run on
each expert matrix as its own parameter (and with whole experts, zero optimizer bytes); Shampoo,
SOAP and AdamW8bit bitwise one process, state included (their blocks lie within one expert);
``clip_grad_norm_`` over dp x ep equals the single-process norm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import raggedfsdp
from raggedfsdp.optim import SOAP, AdamW, AdamW8bit, Muon, Shampoo
from recipes.llama.moe import MoETransformer
from tests.support.ep_steps import full_state, is_expert, set_grads, step_with, tiny_moe, wrap_ep

W = 4
E = 8
DIMS = [(2, 2), (1, 4)]  # (dp_shard_mod_ep, ep)
LR = 3e-3
STEPS = 2
BLOCK = 4  # Shampoo / SOAP blocks: divide every expert's (24, 32) and (32, 24) matrices


def _ids(dims: tuple[int, int]) -> str:
    return f"dp{dims[0]}xep{dims[1]}"


def _model() -> MoETransformer:
    return tiny_moe(E, dim=32, moe_hidden=24)


def _wrapped(ep: int, **kwargs) -> MoETransformer:
    """Experts over ep and dp_shard_mod_ep, the rest over every rank; ``kwargs`` (the
    optimizer's shard policy) go to every fully_shard call."""
    return wrap_ep(_model(), ep, **kwargs)


def _gradients(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) for n, p in _model().named_parameters()}


# ----------------------------------------------------------------------------- AdamW
def _adamw_on_ep(dims: tuple[int, int], grads: dict) -> dict:
    model = _wrapped(dims[1])
    named = list(model.named_parameters())
    opt = AdamW(named, lr=LR, weight_decay=0.1)
    step_with(named, grads, opt, STEPS)
    return {"params": {n: p.full_tensor() for n, p in named}, "state": full_state(opt, named)}


@pytest.mark.parametrize("dims", DIMS, ids=_ids)
def test_adamw_step_is_bitwise_torch_on_ep_parameters(dist_pool, dims):
    grads = _gradients(7)
    reference = _model()
    named = list(reference.named_parameters())
    opt = torch.optim.AdamW([p for _, p in named], lr=LR, weight_decay=0.1, foreach=False)
    step_with(named, grads, opt, STEPS)
    for result in dist_pool(W).run(_adamw_on_ep, dims, grads):
        for n, p in named:
            assert torch.equal(result["params"][n], p.detach()), n
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(result["state"][f"{n}.{key}"], opt.state[p][key]), (n, key)


# ----------------------------------------------------------------------------- Muon
def _muon_on_ep(dims: tuple[int, int], grads: dict, whole: bool) -> dict:
    policy = {"shard_policy": Muon.shard_policy(whole_matrices=True)} if whole else {}
    model = _wrapped(dims[1], **policy)
    experts = [(n, p) for n, p in model.named_parameters() if is_expert(n)]
    opt = Muon(experts, lr=LR, weight_decay=0.1)
    step_with(experts, grads, opt, STEPS)
    stats = opt.last_step_stats
    return {
        "params": {n: p.full_tensor() for n, p in experts},
        "momentum": {n: opt.state[p]["momentum_buffer"].full_tensor() for n, p in experts},
        "bytes": stats["bytes_sent"] + stats["bytes_received"],
        "local": (stats["matrices"], stats["matrices_local"]),
    }


def _torch_muon_per_expert(grads: dict) -> tuple[dict, dict]:
    """torch.optim.Muon with every expert matrix of every fused tensor as its own parameter:
    the stacked weights and momenta after the steps."""
    fused = {n: p.detach() for n, p in _model().named_parameters() if is_expert(n)}
    matrices = {(n, e): nn.Parameter(w[e].clone()) for n, w in fused.items() for e in range(E)}
    opt = torch.optim.Muon(list(matrices.values()), lr=LR, weight_decay=0.1)
    for _ in range(STEPS):
        for (n, e), p in matrices.items():
            p.grad = grads[n][e].clone()
        opt.step()
    params = {n: torch.stack([matrices[n, e].detach() for e in range(E)]) for n in fused}
    momenta = {
        n: torch.stack([opt.state[matrices[n, e]]["momentum_buffer"] for e in range(E)])
        for n in fused
    }
    return params, momenta


@pytest.mark.parametrize("whole", [False, True], ids=["element-units", "whole-experts"])
@pytest.mark.parametrize("dims", DIMS, ids=_ids)
def test_muon_orthogonalises_each_expert_where_it_lies(dist_pool, dims, whole):
    """Bitwise torch's Muon per expert matrix; with whole experts every matrix is local to the
    rank that holds it and the step moves no optimizer bytes."""
    grads = _gradients(8)
    params, momenta = _torch_muon_per_expert(grads)
    for result in dist_pool(W).run(_muon_on_ep, dims, grads, whole):
        for n, want in params.items():
            assert torch.equal(result["params"][n], want), n
            assert torch.equal(result["momentum"][n], momenta[n]), n
        if whole:
            assert result["bytes"] == 0, result
            assert result["local"] == (2 * 3 * E, 2 * 3 * E), result


# ----------------------------------------------------------------------------- blocked
BLOCKED = {"Shampoo": Shampoo, "SOAP": SOAP}


def _blocked_options(name: str) -> dict:
    options = {"lr": LR, "max_preconditioner_dim": BLOCK}
    return options | ({"precondition_frequency": 1} if name == "Shampoo" else {})


def _blocked_on_ep(dims: tuple[int, int], grads: dict, name: str) -> dict:
    cls = BLOCKED[name]
    model = _wrapped(dims[1], shard_policy=cls.shard_policy(max_preconditioner_dim=BLOCK))
    named = list(model.named_parameters())
    opt = cls(named, **_blocked_options(name))
    step_with(named, grads, opt, STEPS)
    return {"params": {n: p.full_tensor() for n, p in named}, "state": full_state(opt, named)}


@pytest.mark.parametrize("name", BLOCKED)
@pytest.mark.parametrize("dims", DIMS, ids=_ids)
def test_blocked_step_equals_one_process_on_ep_parameters(dist_pool, dims, name):
    """Shampoo and SOAP blocks of a fused expert tensor lie within one expert (its matrix
    tiled by BLOCK), so each EP rank holds whole blocks: step and state bitwise one process."""
    grads = _gradients(9)
    reference = _model()
    named = list(reference.named_parameters())
    opt = BLOCKED[name](named, **_blocked_options(name))
    step_with(named, grads, opt, STEPS)
    expected = full_state(opt, named)
    assert any(is_expert(key) for key in expected)
    for result in dist_pool(W).run(_blocked_on_ep, dims, grads, name):
        for n, p in named:
            assert torch.equal(result["params"][n], p.detach()), n
        assert result["state"].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(result["state"][key], value), key


# ----------------------------------------------------------------------------- AdamW8bit
EIGHT_BIT = {"lr": LR, "weight_decay": 0.1, "min_8bit_size": 64}
CONFIGS_8BIT = {"tiles": {"tile": (4, 4)}, "blocks": {"block_size": 64}}


def _adamw8bit_on_ep(dims: tuple[int, int], grads: dict, config: dict) -> dict:
    keys = {"min_8bit_size": 64, **config}
    model = _wrapped(dims[1], shard_policy=AdamW8bit.shard_policy(**keys))
    named = list(model.named_parameters())
    opt = AdamW8bit(named, **EIGHT_BIT, **config)
    step_with(named, grads, opt, STEPS)
    return {"params": {n: p.full_tensor() for n, p in named}, "state": full_state(opt, named)}


@pytest.mark.parametrize("config", CONFIGS_8BIT)
@pytest.mark.parametrize("dims", DIMS, ids=_ids)
def test_adamw8bit_blocks_never_cross_experts(dist_pool, dims, config):
    """1-D blocks of 64 and (4, 4) tiles of the global tensor: an expert's (24, 32) matrix is
    768 elements, so every block lies in one expert, held by one EP rank. Step and state
    (8-bit codes and the absmax grid, in global coordinates) bitwise one process."""
    options = CONFIGS_8BIT[config]
    grads = _gradients(10)
    reference = _model()
    named = list(reference.named_parameters())
    opt = AdamW8bit(named, **EIGHT_BIT, **options)
    step_with(named, grads, opt, STEPS)
    expected = full_state(opt, named)
    assert any(is_expert(k) and k.endswith("_absmax") for k in expected)  # 8-bit experts
    for result in dist_pool(W).run(_adamw8bit_on_ep, dims, grads, options):
        for n, p in named:
            assert torch.equal(result["params"][n], p.detach()), n
        assert result["state"].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(result["state"][key], value), key


# ----------------------------------------------------------------------------- clipping
def _clip_on_ep(dims: tuple[int, int], grads: dict, max_norm: float) -> dict:
    model = _wrapped(dims[1])
    named = list(model.named_parameters())
    set_grads(named, grads)
    norm = raggedfsdp.clip_grad_norm_(model.parameters(), max_norm)
    return {"norm": norm.item(), "grads": {n: p.grad.full_tensor() for n, p in named}}


@pytest.mark.parametrize("dims", DIMS, ids=_ids)
def test_clip_grad_norm_covers_dp_and_ep(dist_pool, dims):
    """Each expert gradient counted once over dp_shard_mod_ep x ep, each dense one once over
    every rank: the single-process norm (float rounding of the sum order), and the clipped
    gradients scaled by it."""
    grads = _gradients(11)
    reference = _model()
    set_grads(list(reference.named_parameters()), grads)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
    for result in dist_pool(W).run(_clip_on_ep, dims, grads, 1.0):
        assert result["norm"] == pytest.approx(want, rel=1e-6)
        for n, p in reference.named_parameters():
            assert torch.allclose(result["grads"][n], p.grad, rtol=1e-5, atol=1e-8), n
