"""Expert parallelism at W=4 (recipes/llama/expert_parallel.py): the recipe's MoE layer with its
fused experts ``Shard(0)`` over an ``ep`` mesh dim and tokens dispatched by all-to-all, at (dp 2
x ep 2) and (dp 1 x ep 4), against the same layer in one process; a tiny MoE model trained with
the experts on ``dp_shard_mod_ep`` and the dense weights on every rank; Muon's zero-byte step on
whole experts; DCP across EP changes; the refusals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import raggedfsdp
from raggedfsdp.optim import AdamW, Muon
from recipes.llama.expert_parallel import (
    check_ep,
    distribute_experts,
    ep_meshes,
    shard_ep_block,
    shard_ep_block_fsdp2,
    take_all_to_all_bytes,
)
from recipes.llama.model_config import MoEConfig
from recipes.llama.moe import MoEBlock, MoEFeedForward, MoETransformer, balance_routers

W = 4
E = 8
DIMS = [(2, 2), (1, 4)]  # (dp_shard_mod_ep, ep)
HSDP = (2, 1, 2)  # (dp_replicate, dp_shard_mod_ep, ep)
ROWS, SEQ = 8, 8  # global batch: W ranks of 2 rows
STEPS = 5
LR = 3e-3
STARVED = -10.0  # a bias no softmax score can overcome: those experts never get a token


def _ids(value) -> str:
    if isinstance(value, tuple) and len(value) == 3:
        return f"rep{value[0]}xdp{value[1]}xep{value[2]}"
    if isinstance(value, tuple):
        return f"dp{value[0]}xep{value[1]}"
    if isinstance(value, str):
        return value
    return "ac" if value else "no-ac"


def _cfg(**overrides) -> MoEConfig:
    base = dict(
        dim=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        n_experts=E,
        top_k=2,
        moe_hidden=24,
        n_shared_experts=1,
        n_dense_layers=0,
        bias_update_rate=1e-2,
        expert_impl="loop",
    )
    return MoEConfig(**{**base, **overrides})


def _seeded(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            gen = torch.Generator().manual_seed(seed * 1000 + i)
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return module


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-6) -> bool:
    """Within ``tol`` of ``want``'s largest magnitude (gradients here reach ~10: the dense
    shared expert's sums its rows in another order on each rank)."""
    return got.shape == want.shape and bool(
        (got - want).abs().max() <= tol * max(1.0, want.abs().max())
    )


def _starve_last(moe: MoEFeedForward, ep: int) -> None:
    """The experts of the last EP rank get no token (their bias is never overcome)."""
    with torch.no_grad():
        moe.expert_bias[-(moe.n_experts // ep) :] = STARVED


# ----------------------------------------------------------------------------- the layer
def _layer_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(W * 6, 32, generator=gen), torch.randn(W * 6, 32, generator=gen)


def _layer_reference(starve_ep: int | None, impl: str = "loop") -> dict[str, torch.Tensor]:
    layer = _seeded(MoEFeedForward(_cfg(expert_impl=impl)))
    if starve_ep:
        _starve_last(layer, starve_ep)
    x, target = _layer_inputs()
    x.requires_grad_(True)
    out = layer(x)
    (out * target).sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return {"out": out.detach(), "x": x.grad, **grads}


def _layer_on_ep(dims: tuple[int, int], starve: bool, impl: str = "loop") -> dict:
    mesh, dp = ep_meshes(dims[1])
    rank, ep = dp.get_local_rank(), dims[1]
    layer = _seeded(MoEFeedForward(_cfg(expert_impl=impl)))
    if starve:
        _starve_last(layer, ep)
    distribute_experts(layer, mesh["ep"])
    x, target = _layer_inputs()
    x = x.chunk(W)[rank].clone().requires_grad_(True)
    out = layer(x)
    (out * target.chunk(W)[rank]).sum().backward()
    # the local experts' gradient sums the tokens of this rank's ep group: sum over the rest
    grads = {}
    for name, p in layer.named_parameters():
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad.clone()
        group = mesh["dp_shard_mod_ep"].get_group() if "experts" in name else None
        dist.all_reduce(g, group=group)
        grads[name] = g
    load = layer.tokens_per_expert.clone()
    sent = (take_all_to_all_bytes(layer), take_all_to_all_bytes(layer))
    expected = _expected_all_to_all_bytes(load, ep)
    dist.all_reduce(load)
    received = load.view(ep, -1).sum(1)  # tokens each EP rank's experts received
    traffic = {"sent": sent, "expected_sent": expected}
    return {"out": out.detach(), "x": x.grad, "received": received, **traffic, **grads}


def _expected_all_to_all_bytes(counts: torch.Tensor, ep: int) -> int:
    """What this rank sends to other EP ranks in one forward and backward: its rows for the
    other ranks' experts (dispatch), the rows the others sent it (combine), each once more as
    gradients, and the per-expert counts (int64) to the others; 32 fp32 values a row."""
    every = [torch.empty_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(every, counts)
    rank = dist.get_rank()
    me, group = rank % ep, range(rank - rank % ep, rank - rank % ep + ep)
    to_others = sum(counts.view(ep, -1).sum(1)[j].item() for j in range(ep) if j != me)
    from_others = sum(every[s].view(ep, -1)[me].sum().item() for s in group if s != rank)
    return int(2 * (to_others + from_others) * 32 * 4 + (E - E // ep) * 8)


@pytest.mark.parametrize(
    ("dims", "impl"), [(DIMS[0], "loop"), (DIMS[1], "loop"), (DIMS[0], "grouped_mm")], ids=_ids
)
def test_layer_output_and_gradients_match_one_process(dist_pool, dims, impl):
    """Both expert paths (grouped_mm runs on CPU in fp32), each EP rank's local experts."""
    ep = dims[1]
    for starve in (False, True):
        expected = _layer_reference(ep if starve else None, impl)
        results = dist_pool(W).run(_layer_on_ep, dims, starve, impl)
        for rank, got in enumerate(results):
            local_e = slice((rank % ep) * (E // ep), (rank % ep + 1) * (E // ep))
            assert bool(got["received"][-1] == 0) == starve, got["received"]
            assert got["sent"] == (got["expected_sent"], 0), got["sent"]  # counted, then reset
            for key in ("out", "x"):
                want = expected[key].chunk(W)[rank]
                assert _close(got[key], want), (key, starve)
            for name, want in expected.items():
                if name in ("out", "x"):
                    continue
                if "experts." in name and "shared" not in name:
                    want = want[local_e]
                assert _close(got[name], want), (name, starve)


# ----------------------------------------------------------------------------- training
def _model(activation_checkpointing: bool = False, n_experts: int = E) -> MoETransformer:
    cfg = _cfg(n_experts=n_experts)
    model = MoETransformer(cfg, seq_len=SEQ, activation_checkpointing=activation_checkpointing)
    model.init_weights(seed=3)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 256, (ROWS, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, inputs, targets) -> torch.Tensor:
    return F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())


def _wrap_ep(model: MoETransformer, ep: int, fsdp2: bool = False, replicate: int = 1, **kwargs):
    """Experts over ep and dp_shard_mod_ep (HSDP over dp_replicate too), the rest over every
    rank, with raggedfsdp or torch's FSDP2; (model, dp index: the rank's batch rows)."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh, dp = ep_meshes(ep, replicate=replicate)
    _starve_last(model.layers[0].feed_forward, ep)
    distribute_experts(model, mesh["ep"])
    wrap_block = shard_ep_block_fsdp2 if fsdp2 else shard_ep_block
    wrap = fsdp2_fully_shard if fsdp2 else raggedfsdp.fully_shard
    for block in model.layers:
        if isinstance(block, MoEBlock):
            wrap_block(block, mesh, dp, **kwargs)
        else:
            wrap(block, mesh=dp, **kwargs)
    wrap(model, mesh=dp, **kwargs)
    return model, dist.get_rank()  # dp_rank: row-major over (dp_replicate, dp_shard)


def _train(model, opt, rank: int | None) -> list[float]:
    losses = []
    for step in range(STEPS):
        inputs, targets = _batch(step)
        if rank is not None:
            inputs, targets = inputs.chunk(W)[rank], targets.chunk(W)[rank]
        loss = _loss(model, inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        balance_routers(model, model.cfg.bias_update_rate)
        loss = loss.detach().clone()
        if rank is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def _train_on_ep(
    dims: tuple[int, ...], ac: bool = False, fsdp2: bool = False, n_experts: int = E
) -> dict:
    replicate = dims[0] if len(dims) == 3 else 1
    model, rank = _wrap_ep(_model(ac, n_experts), dims[-1], fsdp2, replicate)
    adamw = torch.optim.AdamW if fsdp2 else AdamW  # FSDP2's parameters are DTensors
    losses = _train(model, adamw(model.parameters(), lr=LR), rank)
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    bias = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    placements = str(getattr(model.layers[0].feed_forward.experts.w1, "placements", None))
    return {"losses": losses, "weights": weights, "bias": bias, "placements": placements}


def _reference(ep: int, n_experts: int = E) -> tuple[MoETransformer, list[float]]:
    """One process's model (the last EP rank's experts starved, as ``_wrap_ep`` does) after
    ``STEPS`` steps, and its losses."""
    model = _model(n_experts=n_experts)
    _starve_last(model.layers[0].feed_forward, ep)
    return model, _train(model, torch.optim.AdamW(model.parameters(), lr=LR), None)


@pytest.fixture(scope="module")
def trained(dist_pool) -> Callable[..., Any]:
    """``trained(fn, *args)``: ``fn(*args)`` (``_reference`` in this process, ``_train_on_ep``
    on the W-rank pool), computed once for the module: the training test and the FSDP2 test
    compare with the same runs of ours and of one process."""
    cache: dict[tuple, Any] = {}

    def get(fn: Callable[..., Any], *args: Any) -> Any:
        if (fn, *args) not in cache:
            cache[(fn, *args)] = fn(*args) if fn is _reference else dist_pool(W).run(fn, *args)
        return cache[(fn, *args)]

    return get


@pytest.mark.parametrize(
    ("dims", "ac"),
    [(DIMS[0], False), (DIMS[1], False), (DIMS[0], True), (HSDP, False)],
    ids=_ids,
)
def test_training_matches_one_process(trained, dims, ac):
    """With activation checkpointing the recomputed forward dispatches again (the same
    counts and routes); the reference runs without it. HSDP x EP: the experts reduce-scatter
    over dp_shard_mod_ep and all-reduce over dp_replicate, the dense weights as HSDP."""
    model, expected = trained(_reference, dims[-1])
    for got in trained(_train_on_ep, dims, ac, False, E):
        assert max(abs(a - b) for a, b in zip(got["losses"], expected, strict=True)) < 1e-5
        for name, p in model.named_parameters():
            assert got["weights"][name].shape == p.shape, name
            # 1e-4: one embedding row (a token seen once, a gradient near AdamW's eps) ends
            # 5.4e-5 off, as it does under plain fully_shard at W=4 without EP; the rest <1e-6
            assert torch.allclose(got["weights"][name], p.detach(), atol=1e-4), name
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):  # the same balancing, identical on every rank
                assert torch.equal(got["bias"][name], b), name


@pytest.mark.parametrize(
    ("dims", "experts"),
    [(DIMS[0], E), (DIMS[1], E), (HSDP, E), (DIMS[0], 2)],
    ids=["dp2xep2", "dp1xep4", "rep2xdp1xep2", "dp2xep2-2experts"],
)
def test_fsdp2_x_ep_matches_ours_and_one_process(dist_pool, trained, dims, experts):
    """torch's fully_shard on the experts over dp_shard_mod_ep (``shard_ep_block_fsdp2``),
    HSDP over (dp_replicate, dp_shard_mod_ep) at (2, 1, 2): both train as one process (and the
    training test above checks ours alone, HSDP x EP included). With 2 experts at (2, 2) an EP
    rank's one expert is split on dim 1 over dp_shard_mod_ep (torchtitan's rule)."""
    model, expected = trained(_reference, dims[-1], experts)
    ours = trained(_train_on_ep, dims, False, False, experts)
    fsdp2 = dist_pool(W).run(_train_on_ep, dims, False, True, experts)
    assert ("Shard(dim=1)" in fsdp2[0]["placements"]) == (experts == 2), fsdp2[0]["placements"]
    for got, mine in zip(fsdp2, ours, strict=True):
        assert max(abs(a - b) for a, b in zip(got["losses"], expected, strict=True)) < 1e-5
        assert max(abs(a - b) for a, b in zip(got["losses"], mine["losses"], strict=True)) < 1e-5
        for name, p in model.named_parameters():
            assert got["weights"][name].shape == p.shape, name
            # 1e-4: the embedding row of test_training_matches_one_process (5.8e-5 here)
            assert torch.allclose(got["weights"][name], p.detach(), atol=1e-4), name
        assert got["bias"].keys() == mine["bias"].keys()
        for name, b in got["bias"].items():
            assert torch.equal(b, mine["bias"][name]), name


# ----------------------------------------------------------------------------- Muon
def _muon_on_ep(dims: tuple[int, int]) -> dict:
    policy = Muon.shard_policy(whole_matrices=True)
    model, rank = _wrap_ep(_model(), dims[1], shard_policy=policy)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    opt = Muon(experts, lr=0.02)
    inputs, targets = _batch(0)
    _loss(model, inputs.chunk(W)[rank], targets.chunk(W)[rank]).backward()
    opt.step()
    stats = opt.last_step_stats
    return {k: stats[k] for k in ("bytes_sent", "bytes_received", "matrices", "matrices_local")}


def test_muon_moves_zero_optimizer_bytes_for_whole_experts(dist_pool):
    for dims in DIMS:
        for stats in dist_pool(W).run(_muon_on_ep, dims):
            assert stats["bytes_sent"] == stats["bytes_received"] == 0, (dims, stats)
            assert stats["matrices"] == stats["matrices_local"] == 2 * 3 * E, (dims, stats)


# ----------------------------------------------------------------------------- checkpoints
def _dcp_save(path: str) -> dict:
    model, rank = _wrap_ep(_model(), 2)
    opt = AdamW(model.parameters(), lr=LR)
    _train(model, opt, rank)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    return _params_and_moments(model, opt)


def _params_and_moments(model, opt) -> dict[str, torch.Tensor]:
    out = {n: p.full_tensor() for n, p in model.named_parameters()}
    out |= {
        f"{n}/exp_avg": opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()
    }
    return out


def _dcp_load(path: str, ep: int) -> dict:
    """Loaded at ep 1 (no EP: every parameter over the 4 dp ranks) or at (dp 1 x ep 4)."""
    model = MoETransformer(_cfg(), seq_len=SEQ)
    if ep == 1:
        for block in model.layers:
            raggedfsdp.fully_shard(block)
        raggedfsdp.fully_shard(model)
    else:
        model, _ = _wrap_ep(model, ep)
    opt = AdamW(model.parameters(), lr=LR)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    opt.load_state_dict(state["optim"])
    return _params_and_moments(model, opt)


def test_dcp_saved_at_dp2_ep2_loads_at_ep1_ep4_and_one_process(dist_pool, tmp_path):
    """Parameters and AdamW moments bitwise at ep 1 and ep 4; parameters in one process."""
    saved = dist_pool(W).run(_dcp_save, str(tmp_path))[0]
    for ep in (1, 4):
        for loaded in dist_pool(W).run(_dcp_load, str(tmp_path), ep):
            for name, value in saved.items():
                assert torch.equal(loaded[name], value), (ep, name)
    single = MoETransformer(_cfg(), seq_len=SEQ).state_dict()  # no process group
    dcp.load({"model": single}, checkpoint_id=str(tmp_path))
    for name, value in saved.items():
        if "/" not in name:
            assert torch.equal(single[name], value), name


# ----------------------------------------------------------------------------- refusals
def test_ep_not_dividing_the_experts_is_one_line():
    with pytest.raises(ValueError, match=r"ep=4 does not divide n_experts=6") as info:
        check_ep(6, 4)
    assert "\n" not in str(info.value)


def _refusals() -> list[str]:
    mesh, _ = ep_meshes(4)
    messages = []
    layer = MoEFeedForward(_cfg(n_experts=6))
    before = dict(layer.named_parameters())
    try:
        distribute_experts(layer, mesh["ep"])
    except ValueError as error:
        messages.append(str(error))
    assert dict(layer.named_parameters()) == before  # nothing changed
    try:
        ep_meshes(3)
    except ValueError as error:
        messages.append(str(error))
    return messages


def test_bad_ep_is_refused_before_any_change(dist_pool):
    for messages in dist_pool(W).run(_refusals):
        assert len(messages) == 2 and all("\n" not in m for m in messages), messages
        assert "ep=4 does not divide n_experts=6" in messages[0]
        assert "ep=3 does not divide the world size 4" in messages[1]
