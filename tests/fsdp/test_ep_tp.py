"""EP x TP at W=4, (dp_shard_mod_ep 1 x ep 2 x tp 2): the recipe's 2-block MoE model with the TP
plan, its fused experts DTensors on ``mesh["ep", "tp"]`` (``Shard(0)`` over ``ep``, ``d_ff``
``Shard(1)`` / ``Shard(2)`` over ``tp``), sharded over ``dp_shard_mod_ep``, the dense weights
over ``dp_shard`` (``recipes/llama/expert_parallel.py``). The TP record holds both splits
(``TPShard.splits``). Given the same global gradients: AdamW bitwise ``torch.optim.AdamW``,
Muon bitwise ``torch.optim.Muon`` per expert matrix, ``clip_grad_norm_`` over every dim the
single-process norm; full and DCP state dicts in global coordinates (saved at ep 2 x tp 2,
loaded into one process bitwise). Shampoo, SOAP and AdamW8bit on these experts:
``test_ep_tp_optimizers.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import raggedfsdp
from raggedfsdp.optim import AdamW, Muon
from raggedfsdp.sharding.tp_shard import tp_of
from recipes.llama.moe import MoETransformer
from tests.support.ep_steps import full_state, is_expert, set_grads, step_with, tiny_moe, wrap_ep

W, EP, TP = 4, 2, 2
E = 4
LR = 3e-3
STEPS = 2


def _model() -> MoETransformer:
    return tiny_moe(E)


def _wrapped(**kwargs) -> MoETransformer:
    """The TP plan, experts on (ep, tp), then the EP wrapping; ``kwargs`` go to every
    fully_shard call."""
    return wrap_ep(_model(), EP, TP, **kwargs)


def _gradients(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) for n, p in _model().named_parameters()}


# ----------------------------------------------------------------------------- the record
def _records() -> dict[str, tuple]:
    model = _wrapped()
    out = {}
    for n, p in model.named_parameters():
        tp = tp_of(p.ragged_shard)
        if tp is not None and is_expert(n):
            out[n] = (tp.splits, tp.local_shape, tp.offsets, tp.size, tp.rank)
    return out


def test_experts_hold_both_splits(dist_pool):
    """w1 (E, d_ff, d): Shard(0) over ep, Shard(1) over tp; w2 (E, d, d_ff): Shard(2) over
    tp; rank r sits at (ep r // 2, tp r % 2) and its block starts there."""
    for rank, records in enumerate(dist_pool(W).run(_records)):
        ep, tp = divmod(rank, TP)
        w1 = records["layers.0.feed_forward.experts.w1"]
        assert w1 == (((0, 0), (1, 1)), (2, 4, 16), (2 * ep, 4 * tp, 0), 4, rank), w1
        w2 = records["layers.1.feed_forward.experts.w2"]
        assert w2 == (((0, 0), (1, 2)), (2, 16, 4), (2 * ep, 0, 4 * tp), 4, rank), w2


# ----------------------------------------------------------------------------- AdamW
def _adamw(grads: dict) -> dict:
    model = _wrapped()
    named = list(model.named_parameters())
    opt = AdamW(named, lr=LR, weight_decay=0.1)
    step_with(named, grads, opt, STEPS)
    return {"params": {n: p.full_tensor() for n, p in named}, "state": full_state(opt, named)}


def test_adamw_step_is_bitwise_torch(dist_pool):
    grads = _gradients(7)
    reference = _model()
    named = list(reference.named_parameters())
    opt = torch.optim.AdamW([p for _, p in named], lr=LR, weight_decay=0.1, foreach=False)
    step_with(named, grads, opt, STEPS)
    for result in dist_pool(W).run(_adamw, grads):
        for n, p in named:
            assert torch.equal(result["params"][n], p.detach()), n
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(result["state"][f"{n}.{key}"], opt.state[p][key]), (n, key)


# ----------------------------------------------------------------------------- Muon
def _muon(grads: dict, whole: bool) -> dict:
    policy = {"shard_policy": Muon.shard_policy(whole_matrices=True)} if whole else {}
    model = _wrapped(**policy)
    experts = [(n, p) for n, p in model.named_parameters() if is_expert(n)]
    opt = Muon(experts, lr=LR, weight_decay=0.1)
    step_with(experts, grads, opt, STEPS)
    return {
        "params": {n: p.full_tensor() for n, p in experts},
        "momentum": {n: opt.state[p]["momentum_buffer"].full_tensor() for n, p in experts},
    }


def _torch_muon_per_expert(grads: dict) -> tuple[dict, dict]:
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
def test_muon_orthogonalises_each_expert_from_its_tp_blocks(dist_pool, whole):
    """Each expert's rows (w1, w3) or columns (w2) lie on the two TP ranks of its EP rank:
    the owner assembles them, bitwise torch's Muon on that expert matrix."""
    grads = _gradients(5)
    params, momenta = _torch_muon_per_expert(grads)
    for result in dist_pool(W).run(_muon, grads, whole):
        for n in params:
            assert torch.equal(result["params"][n], params[n]), n
            assert torch.equal(result["momentum"][n], momenta[n]), n


# ----------------------------------------------------------------------------- clipping
def _clip(grads: dict, max_norm: float) -> dict:
    model = _wrapped()
    named = list(model.named_parameters())
    set_grads(named, grads)
    norm = raggedfsdp.clip_grad_norm_(model.parameters(), max_norm)
    return {"norm": norm.item(), "grads": {n: p.grad.full_tensor() for n, p in named}}


def test_clip_grad_norm_covers_every_dim(dist_pool):
    """Each expert gradient counted once over ep x tp, each TP-split dense one over dp x tp,
    each replicated one (norms, routers) once: the single-process norm."""
    grads = _gradients(11)
    reference = _model()
    set_grads(list(reference.named_parameters()), grads)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
    for result in dist_pool(W).run(_clip, grads, 1.0):
        assert result["norm"] == pytest.approx(want, rel=1e-6)
        for n, p in reference.named_parameters():
            assert torch.allclose(result["grads"][n], p.grad, rtol=1e-5, atol=1e-8), n


# ----------------------------------------------------------------------------- checkpoints
def _params_and_moments(model, opt) -> dict[str, torch.Tensor]:
    named = list(model.named_parameters())
    out = {n: p.full_tensor() for n, p in named}
    return out | {f"{n}/exp_avg_sq": opt.state[p]["exp_avg_sq"].full_tensor() for n, p in named}


def _dcp_save(path: str, grads: dict) -> dict[str, torch.Tensor]:
    """A model stepped at ep 2 x tp 2, saved by DCP with its AdamW state."""
    model = _wrapped()
    named = list(model.named_parameters())
    opt = AdamW(named, lr=LR)
    step_with(named, grads, opt, STEPS)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    return _params_and_moments(model, opt)


def _dcp_load(path: str, ep: int) -> dict[str, torch.Tensor]:
    """Loaded at ep 1 x tp 1 (every parameter over the 4 dp ranks) or at (dp 2 x ep 2)."""
    model = _model()
    if ep == 1:
        for block in model.layers:
            raggedfsdp.fully_shard(block)
        raggedfsdp.fully_shard(model)
    else:
        wrap_ep(model, ep)
    named = list(model.named_parameters())
    opt = AdamW(named, lr=LR)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    opt.load_state_dict(state["optim"])
    return _params_and_moments(model, opt)


def test_dcp_at_ep2_tp2_loads_at_ep1_tp1_and_one_process_bitwise(dist_pool, tmp_path):
    """Parameters and AdamW moments (global boxes of two splits) bitwise at ep 1 x tp 1 and at
    dp 2 x ep 2 (W=4), and in one process (no process group), where they are also the
    single-process run's."""
    grads, path = _gradients(13), str(tmp_path / "ckpt")
    saved = dist_pool(W).run(_dcp_save, path, grads)[0]
    for ep in (1, 2):
        for loaded in dist_pool(W).run(_dcp_load, path, ep):
            for name, value in saved.items():
                assert torch.equal(loaded[name], value), (ep, name)
    reference = _model()
    named = list(reference.named_parameters())
    opt = torch.optim.AdamW([p for _, p in named], lr=LR, foreach=False)
    step_with(named, grads, opt, STEPS)
    single = {k: torch.zeros_like(v) for k, v in reference.state_dict().items()}
    dcp.load({"model": single}, checkpoint_id=path)
    for n, value in reference.state_dict().items():
        assert torch.equal(single[n], value), n
    for n, p in named:
        assert torch.equal(saved[n], p.detach()), n
