"""Blocked optimizers on tensor-parallel parameters at W=4: given the same global gradients,
each sharded step over data parallel x TP equals the single-process step on the unsharded
parameters (Muon: bitwise ``torch.optim.Muon``, each whole matrix orthogonalised on one owner
that receives its TP pieces as well as its data-parallel pieces)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import raggedfsdp
from raggedfsdp.optim import SOAP, AdamW8bit, Muon, Shampoo, ShardedOptimizer, split_muon_params
from raggedfsdp.optim.muon import ns_flops
from tests.support.tp_models import llama_batch, llama_loss, make_llama, tp_meshes, wrapped_llama

LR = 3e-3
MESHES = [(2, 2), (1, 4), (4, 1), (2, 1, 2)]
STEPS = 2


def _layer_matrices(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The blocks' 2-D weights: colwise (``Shard(0)``) and rowwise (``Shard(1)``) ones."""
    return [(n, p) for n, p in model.named_parameters() if "layers" in n and p.dim() == 2]


def _gradients(seed: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) for n, p in _layer_matrices(make_llama())}


def _step_with(params, grads: dict[str, torch.Tensor], opt) -> None:
    for _ in range(STEPS):
        for n, p in params:
            p.grad = torch.empty_like(p).copy_(grads[n])  # this rank's piece (or all of it)
        opt.step()


# ----------------------------------------------------------------------------- Muon
def _muon_on_tp(dims: tuple[int, ...], grads: dict, whole: bool) -> dict:
    policy = {"shard_policy": Muon.shard_policy(whole_matrices=True)} if whole else {}
    model, _, _ = wrapped_llama(dims, raggedfsdp.fully_shard, **policy)
    matrices = _layer_matrices(model)
    opt = Muon(matrices, lr=LR, weight_decay=0.1)
    _step_with(matrices, grads, opt)
    stats = opt.last_step_stats
    return {
        "params": {n: p.full_tensor() for n, p in matrices},
        "momentum": {n: opt.state[p]["momentum_buffer"].full_tensor() for n, p in matrices},
        "ns_run": stats["ns_run"],
        "bytes_sent": stats["bytes_sent"],
    }


@pytest.mark.parametrize("whole", [False, True], ids=["element-units", "whole-matrices"])
@pytest.mark.parametrize("dims", MESHES, ids=lambda d: "x".join(map(str, d)))
def test_muon_step_is_bitwise_torch_on_tp_parameters(dist_pool, dims, whole):
    grads = _gradients()
    reference = make_llama()
    matrices = _layer_matrices(reference)
    opt = torch.optim.Muon([p for _, p in matrices], lr=LR)
    _step_with(matrices, grads, opt)
    results = dist_pool(4).run(_muon_on_tp, dims, grads, whole)
    for result in results:
        for n, p in matrices:
            assert torch.equal(result["params"][n], p.detach()), n
            assert torch.equal(result["momentum"][n], opt.state[p]["momentum_buffer"]), n
    # each matrix orthogonalised once per dp-replicate group: once over the dp x TP block
    replicas = dims[0] if len(dims) == 3 else 1
    run = [name for r in results for name in r["ns_run"]]
    assert sorted(run) == sorted([n for n, _ in matrices] * replicas)
    tp = dims[-1]
    assert any(r["bytes_sent"] for r in results) == (tp > 1 or not whole)


class _Experts(nn.Module):
    """A stacked (E, m, n) expert weight, TP-split on one of its dims."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(weight)


EXPERTS = (4, 12, 20)


def _expert_weight() -> torch.Tensor:
    return torch.randn(EXPERTS, generator=torch.Generator().manual_seed(3))


def _muon_on_experts(dims: tuple[int, int], dim: int, grad: torch.Tensor) -> torch.Tensor:
    tp_mesh, dp_mesh, _, _ = tp_meshes(dims)
    module = _Experts(distribute_tensor(_expert_weight(), tp_mesh, [Shard(dim)]))
    raggedfsdp.fully_shard(module, mesh=dp_mesh)
    opt = Muon(module.parameters(), lr=LR)
    _step_with([("w", module.w)], {"w": grad}, opt)
    return module.w.full_tensor()


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_muon_on_tp_split_stacked_experts(dist_pool, dim):
    """Experts split by TP (dim 0: whole experts per TP rank), or each expert's rows or
    columns split: every expert is orthogonalised whole, as one process does."""
    grad = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(4))
    reference = _Experts(_expert_weight())
    _step_with([("w", reference.w)], {"w": grad}, Muon(reference.parameters(), lr=LR))
    for dims in ((2, 2), (1, 4)):
        for weight in dist_pool(4).run(_muon_on_experts, dims, dim, grad):
            assert torch.equal(weight, reference.w.detach()), dims


# ----------------------------------------------------------------------------- end to end
E2E_STEPS = 10
ROWS = 8


def _train_muon(dims: tuple[int, ...]) -> list[float]:
    """Dp-mean losses of 10 Muon steps (AdamW for the embeddings, head and norms)."""
    model, index, size = wrapped_llama(dims, raggedfsdp.fully_shard)
    opt = Muon(split_muon_params(model), lr=LR)
    per = ROWS // size
    losses = []
    for step in range(E2E_STEPS):
        inputs, targets = llama_batch(step % 3, ROWS)
        rows = slice(index * per, (index + 1) * per)
        loss = llama_loss(model, inputs[rows], targets[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def _single_muon() -> list[float]:
    model = make_llama()
    opt = Muon(split_muon_params(model), lr=LR)
    losses = []
    for step in range(E2E_STEPS):
        loss = llama_loss(model, *llama_batch(step % 3, ROWS))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_muon_training_over_dp_and_tp(dist_pool):
    """10 steps within 1e-5 of one process. TP changes gradients in the last bits (rowwise
    partial sums, sequence-parallel norms) and bf16 Newton-Schulz amplifies them: measured
    9.3e-6 at (2, 2) and 5.0e-6 at (1, 4), against 2.4e-7 for plain FSDP at (4, 1)."""
    expected = _single_muon()
    for dims in [(4, 1), (2, 2), (1, 4)]:
        for losses in dist_pool(4).run(_train_muon, dims):
            assert max(abs(a - b) for a, b in zip(losses, expected, strict=True)) < 1e-5, dims


# ----------------------------------------------------------------------------- AdamW8bit
def _adamw8bit(**config) -> dict:
    return {"lr": LR, "weight_decay": 0.1, "min_8bit_size": 64, **config}


def _policy(config: dict) -> dict:
    keys = ("block_size", "tile", "min_8bit_size")
    options = _adamw8bit(**config)
    return {"shard_policy": AdamW8bit.shard_policy(**{k: options[k] for k in keys if k in options})}


def _colwise_or_replicated(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if "wo" not in n and "w2" not in n]


def _full_state(opt, named) -> dict:
    """Every state tensor but the step counters, gathered whole (global coordinates)."""
    return {
        f"{n}.{key}": value.full_tensor() if hasattr(value, "full_tensor") else value
        for n, p in named
        for key, value in opt.state[p].items()
        if key != "step"
    }


def _adamw8bit_on_tp(dims: tuple[int, ...], grads: dict, config: dict, only_colwise: bool):
    model, _, _ = wrapped_llama(dims, raggedfsdp.fully_shard, **_policy(config))
    named = _colwise_or_replicated(model) if only_colwise else list(model.named_parameters())
    opt = AdamW8bit(named, **_adamw8bit(**config))
    _step_with(named, grads, opt)
    return {"params": {n: p.full_tensor() for n, p in named}, "state": _full_state(opt, named)}


CONFIGS_8BIT = {"tiles": ({"tile": (4, 4)}, False), "blocks": ({"block_size": 64}, True)}


@pytest.mark.parametrize("config", CONFIGS_8BIT, ids=str)
@pytest.mark.parametrize("dims", [(2, 2), (1, 4), (2, 1, 2)], ids=lambda d: "x".join(map(str, d)))
def test_adamw8bit_step_is_bitwise_one_process_on_tp_parameters(dist_pool, dims, config):
    """Blocks of the global tensor, each whole in one TP block: the same bits as one process,
    state included (the absmax grid in global coordinates)."""
    options, only_colwise = CONFIGS_8BIT[config]
    reference = make_llama()
    named = list(reference.named_parameters())
    named = _colwise_or_replicated(reference) if only_colwise else named
    gen = torch.Generator().manual_seed(8)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in named}
    opt = AdamW8bit(named, **_adamw8bit(**options))
    _step_with(named, grads, opt)
    expected = _full_state(opt, named)
    assert any(key.endswith("_absmax") for key in expected)  # 8-bit state, not the fallback
    for result in dist_pool(4).run(_adamw8bit_on_tp, dims, grads, options, only_colwise):
        for n, p in named:
            assert torch.equal(result["params"][n], p.detach()), n
        assert result["state"].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(result["state"][key], value), key


def _adamw8bit_refusals() -> dict[str, str]:
    model, _, _ = wrapped_llama((2, 2), raggedfsdp.fully_shard)
    named = list(model.named_parameters())
    messages = {}
    for case, config in {"blocks on rowwise": {"block_size": 64}, "tile": {"tile": (3, 4)}}.items():
        try:
            AdamW8bit(named, **_adamw8bit(**config))
        except ValueError as error:
            messages[case] = str(error)
    return messages


def test_adamw8bit_refuses_blocks_the_tp_split_cuts(dist_pool):
    for messages in dist_pool(4).run(_adamw8bit_refusals):
        assert "'layers.0.attention.wo.weight'" in messages["blocks on rowwise"]
        assert "cross its TP blocks" in messages["blocks on rowwise"]
        assert "tile=(rows, cols)" in messages["blocks on rowwise"]
        assert "'tok_embeddings.weight'" in messages["tile"] and "divides 16" in messages["tile"]
        assert "cut tile=(3, 4)" in messages["tile"]
        assert all("\n" not in m for m in messages.values())


def _adamw8bit_dcp(path: str, dims: tuple[int, ...], grads: dict | None) -> dict:
    """With ``grads``: two steps at ``dims``, then save; without: load into a fresh run."""
    import torch.distributed.checkpoint as dcp

    config = {"tile": (4, 4)}
    model, _, _ = wrapped_llama(dims, raggedfsdp.fully_shard, **_policy(config))
    named = list(model.named_parameters())
    opt = AdamW8bit(named, **_adamw8bit(**config))
    if grads is not None:
        _step_with(named, grads, opt)
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)
    else:
        state = {"optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=path)
        opt.load_state_dict(state["optim"])
    return _full_state(opt, named)


def test_adamw8bit_tp_state_reshards_with_dcp(dist_pool, tmp_path):
    """8-bit codes and the absmax grid saved at dp 2 x tp 2 load at dp 4 and dp 1 x tp 4."""
    gen = torch.Generator().manual_seed(9)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in make_llama().named_parameters()}
    saved = dist_pool(4).run(_adamw8bit_dcp, str(tmp_path), (2, 2), grads)[0]
    for dims in ((4, 1), (1, 4)):
        for loaded in dist_pool(4).run(_adamw8bit_dcp, str(tmp_path), dims, None):
            assert loaded.keys() == saved.keys()
            for key, value in saved.items():
                assert torch.equal(loaded[key], value), (dims, key)


class _SplitAndReplicated(nn.Module):
    """A colwise TP matrix beside one TP replicates (a router, say)."""

    def __init__(self, split: torch.Tensor, replicated: torch.Tensor) -> None:
        super().__init__()
        self.split = nn.Parameter(split)
        self.replicated = nn.Parameter(replicated)


def _mixed_weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(8, 12, generator=gen), torch.randn(12, 6, generator=gen)


def _muon_on_mixed(dims: tuple[int, int], grads: dict) -> dict:
    tp_mesh, dp_mesh, _, _ = tp_meshes(dims)
    split, replicated = _mixed_weights()
    module = _SplitAndReplicated(
        distribute_tensor(split, tp_mesh, [Shard(0)]),
        distribute_tensor(replicated, tp_mesh, [Replicate()]),
    )
    raggedfsdp.fully_shard(module, mesh=dp_mesh)
    named = list(module.named_parameters())
    opt = Muon(named, lr=LR)
    _step_with(named, grads, opt)
    stats = opt.last_step_stats
    return {
        "params": {n: p.full_tensor() for n, p in named},
        "flops": (stats["ns_flops"], stats["ns_flops_max"], stats["ns_flops_mean"]),
    }


def test_muon_on_tp_split_and_replicated_matrices(dist_pool):
    """One exchange over dp x TP for the split matrix, one over each TP coordinate's dp ranks
    for the replicated one; the step is one process's and the FLOP stats add both."""
    reference = _SplitAndReplicated(*_mixed_weights())
    named = list(reference.named_parameters())
    gen = torch.Generator().manual_seed(6)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in named}
    _step_with(named, grads, Muon(named, lr=LR))
    total = ns_flops(8, 12, 5) + ns_flops(12, 6, 5)
    for dims in ((2, 2), (1, 4)):
        results = dist_pool(4).run(_muon_on_mixed, dims, grads)
        for result in results:
            for n, p in named:
                assert torch.equal(result["params"][n], p.detach()), (dims, n)
        mine = [r["flops"][0] for r in results]
        _, most, mean = results[0]["flops"]
        assert most == max(mine) and mean * 4 == pytest.approx(sum(mine))
        # every TP coordinate's dp group works on its copy of the replicated matrix
        assert sum(mine) == ns_flops(8, 12, 5) + dims[1] * ns_flops(12, 6, 5) != total


# ----------------------------------------------------------------------------- Shampoo, SOAP
BLOCKED = {"Shampoo": Shampoo, "SOAP": SOAP}
BLOCK = 4  # divides every TP block of the tiny Llama at tp 2 and 4


def _blocked_options(name: str) -> dict:
    options = {"lr": LR, "max_preconditioner_dim": BLOCK}
    return options | ({"precondition_frequency": 1} if name == "Shampoo" else {})


def _blocked_on_tp(dims: tuple[int, ...], grads: dict, name: str) -> dict:
    cls = BLOCKED[name]
    policy = cls.shard_policy(max_preconditioner_dim=BLOCK)
    model, _, _ = wrapped_llama(dims, raggedfsdp.fully_shard, shard_policy=policy)
    named = list(model.named_parameters())
    opt = cls(named, **_blocked_options(name))
    _step_with(named, grads, opt)
    return {"params": {n: p.full_tensor() for n, p in named}, "state": _full_state(opt, named)}


@pytest.mark.parametrize("name", BLOCKED)
@pytest.mark.parametrize("dims", [(2, 2), (1, 4), (2, 1, 2)], ids=lambda d: "x".join(map(str, d)))
def test_blocked_step_equals_one_process_on_tp_parameters(dist_pool, dims, name):
    """Shampoo and SOAP block the global tensor: each TP block holds whole blocks (colwise
    ones whole slabs, rowwise ones whole block columns), so the step and the per-block state
    are one process's."""
    reference = make_llama()
    named = list(reference.named_parameters())
    gen = torch.Generator().manual_seed(10)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in named}
    opt = BLOCKED[name](named, **_blocked_options(name))
    _step_with(named, grads, opt)
    expected = _full_state(opt, named)
    for result in dist_pool(4).run(_blocked_on_tp, dims, grads, name):
        for n, p in named:
            assert torch.equal(result["params"][n], p.detach()), n
        assert result["state"].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(result["state"][key], value), key


# ----------------------------------------------------------------------------- refusals
class _WholeTensorSign(ShardedOptimizer):
    """A subclass written for data parallelism alone (``p -= lr * g / ‖g‖``): it does not set
    ``handles_tensor_parallel``, so TP parameters are refused at its first step."""

    @classmethod
    def shard_policy(cls, **config):
        return raggedfsdp.sharding.element_units()

    def _policy(self):
        return self.shard_policy()

    def _state_specs(self, piece, group):
        return {}

    def _new_step(self, group, device):
        return torch.tensor(0.0)

    def _update(self, group, pieces, step):
        for pc in pieces:
            pc.local().add_(pc.local_grad(), alpha=-group["lr"])


def _blocked_refusals() -> dict[str, str]:
    model, _, _ = wrapped_llama((1, 4), raggedfsdp.fully_shard)
    named = list(model.named_parameters())
    before = {n: p.full_tensor() for n, p in named}
    messages = {}
    for name, cls in BLOCKED.items():  # merged dims would run across the TP split
        try:
            cls(named, lr=LR, max_preconditioner_dim=8, merge_dims=True)
        except ValueError as error:
            messages[name] = str(error)
    opt = _WholeTensorSign(named, {"lr": LR})
    for _, p in named:
        p.grad = torch.ones_like(p)
    try:
        opt.step()
    except NotImplementedError as error:
        messages["subclass"] = str(error)
    try:
        SOAP(named, lr=LR, max_preconditioner_dim=4, normalize_grads=True)
    except ValueError as error:
        messages["normalize_grads"] = str(error)
    assert all(torch.equal(p.full_tensor(), before[n]) for n, p in named)
    return messages


def test_blocked_optimizers_refuse_what_tp_cannot_keep_whole(dist_pool):
    for messages in dist_pool(4).run(_blocked_refusals):
        assert messages.keys() == {"Shampoo", "SOAP", "subclass", "normalize_grads"}
        for name in BLOCKED:
            assert "'tok_embeddings.weight'" in messages[name]
            assert "merge_dims=True" in messages[name] and "merge_dims=False" in messages[name]
        assert "'tok_embeddings.weight'" in messages["subclass"]
        assert "handles_tensor_parallel" in messages["subclass"]
        assert "normalize_grads=False" in messages["normalize_grads"]
        assert all("\n" not in m for m in messages.values())
