"""fully_shard at the edges a port from FSDP2 + torch.optim relies on, against one float64
process: a weight used twice in one forward, frozen, unused and 0-d / 1-element parameters,
several forwards before one backward, backward twice with ``retain_graph``, accumulation
without sync, an evaluation forward in between, ``zero_grad(set_to_none=False)``; unusual
wrapping (a module without parameters, blocks out of forward order, a non-contiguous
parameter); kept unsharded parameters gathered again after any write to the sharded ones; and
bad arguments, refused in one line before anything changes."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raggedfsdp import MixedPrecisionPolicy, fully_shard
from raggedfsdp.sharding import RaggedTensor

ROWS = 12  # global batch rows: divisible by every world size tested


class Edge(nn.Module):
    """``a`` runs twice per forward, ``frozen`` takes no gradient, ``maybe`` is skipped when
    ``use_maybe`` is off, ``scale`` is 0-d and ``shift`` has one element."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.maybe = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.shift = nn.Parameter(torch.ones(1))
        self.b = nn.Linear(8, 3)
        self.use_maybe = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(torch.tanh(self.a(x))))
        h = h + self.frozen(h)
        if self.use_maybe:
            h = h + self.maybe(h)
        return self.b(h * self.scale + self.shift)


def _edge_model() -> Edge:
    torch.manual_seed(0)
    return Edge().double()


def _loss(model: nn.Module, x: torch.Tensor, how: str, sharded: bool) -> list[torch.Tensor]:
    """The step's losses, each to be backpropagated once, summing to the mean over ROWS rows
    (times W for a rank's rows, since the reduction averages)."""
    factor = dist.get_world_size() / ROWS if sharded else 1 / ROWS
    if how == "two_forwards":  # two forwards, one backward
        half = x.shape[0] // 2
        return [(model(x[:half]).square().sum() + model(x[half:]).square().sum()) * factor]
    if how == "accumulate":  # two micro-batches, the first without gradient sync
        half = x.shape[0] // 2
        return [model(x[:half]).square().sum() * factor, model(x[half:]).square().sum() * factor]
    return [model(x).square().sum() * factor]


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, how: str) -> list[str]:
    """One training step; returns the names of the parameters without a gradient before it."""
    sharded = isinstance(next(model.parameters()), RaggedTensor)
    if how == "eval":  # an evaluation forward in between changes nothing
        with torch.no_grad():
            model.eval()
            model(x)
            model.train()
    losses = _loss(model, x, how, sharded)
    for i, loss in enumerate(losses):
        last = i == len(losses) - 1
        if sharded and how == "accumulate":
            model.set_requires_gradient_sync(last)
        if how == "retain_graph":  # the gradient twice, as torch accumulates it
            loss.backward(retain_graph=True)
        loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    opt.step()
    opt.zero_grad(set_to_none=how != "keep_zeros")
    return no_grad


def _train_edge(wrap: str, how: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, model = _edge_model(), _edge_model()
    if wrap == "each":
        for m in (model.a, model.frozen, model.maybe, model.b):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
    missing = []
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(ROWS, 8, generator=gen, dtype=torch.float64)
        per = ROWS // world
        model.use_maybe = reference.use_maybe = step not in (1, 2)  # unused in steps 1 and 2
        ours = _step(model, opt, x[rank * per : (rank + 1) * per], how)
        expected = _step(reference, ref_opt, x, how)
        missing.append((ours, expected))
    diff = max(
        (p.full_tensor() - q.detach()).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    return {"diff": diff, "missing": missing}


HOWS = ["plain", "keep_zeros", "two_forwards", "retain_graph", "accumulate", "eval"]


@pytest.mark.parametrize("world_size", [1, 3])  # one rank: gradients straight into the segment
@pytest.mark.parametrize("wrap", ["root", "each"])
def test_reuse_frozen_unused_and_scalar_parameters_train_as_one_process(pool, wrap):
    for how in HOWS:
        for result in pool.run(_train_edge, wrap, how):
            assert result["diff"] < 1e-12, (how, result["diff"])
            for ours, expected in result["missing"]:  # .grad is None exactly where torch's is
                assert ours == expected, (how, ours, expected)


# ----------------------------------------------------------------------------- wrapping
class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.act = nn.GELU()
        self.layers[1].weight = nn.Parameter(torch.randn(6, 6).t())  # non-contiguous
        self.gain = nn.Parameter(torch.tensor(0.75))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.act(layer(x))
        return self.head(x * self.gain)


def _unusual_wrapping() -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Stack().double()
    reference = copy.deepcopy(model)
    fully_shard(model.act)  # no parameters
    for i in (2, 0, 1):  # not in forward order
        fully_shard(model.layers[i])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.03, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.03, weight_decay=0.1)
    per = ROWS // world
    for step in range(3):
        x = torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(step)).double()
        (model(x[rank * per : (rank + 1) * per]).square().sum() * world / ROWS).backward()
        (reference(x).square().sum() / ROWS).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return max(
        (p.full_tensor() - q.detach()).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )


@pytest.mark.parametrize("world_size", [3])
def test_unusual_wrapping_trains_as_one_process(pool):
    assert max(pool.run(_unusual_wrapping)) < 1e-12


def test_a_container_without_forward_is_refused_and_its_blocks_wrap_after():
    model = Stack()
    before = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"got a ModuleList, a container without forward"):
        fully_shard(model.layers)  # its hooks would never run (FSDP2 refuses it too)
    with pytest.raises(ValueError, match=r"got a ModuleList"):
        fully_shard([model.layers, model.head])
    assert dict(model.named_parameters()) == before
    fully_shard(list(model.layers))  # the fix the message names
    fully_shard(model)
    model(torch.randn(2, 6)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bad_arguments_are_one_line_errors_that_change_nothing():
    model = Stack()
    before = dict(model.named_parameters())
    cases = [
        ({"module": None}, TypeError, r"takes an nn\.Module or a non-empty list of them"),
        ({"mp_policy": torch.bfloat16}, TypeError, r"mp_policy=torch\.bfloat16\): expected a Mix"),
        ({"shard_policy": 32}, TypeError, r"shard_policy=32\): expected a callable"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match) as caught:
            fully_shard(kwargs.pop("module", model), **kwargs)
        assert "\n" not in str(caught.value)
        assert dict(model.named_parameters()) == before
    for dtype in ("bf16", torch.int8):
        with pytest.raises(TypeError, match=r"param_dtype=.*expected a floating-point"):
            MixedPrecisionPolicy(param_dtype=dtype)
    fully_shard(model)
    with pytest.raises(ValueError, match="Wrap submodules before their parent"):
        fully_shard(model.head)  # the root first, then a child: its parameters are taken
    model(torch.randn(2, 6)).sum().backward()  # still usable


# ----------------------------------------------------------------------------- kept copies
def _kept_copies_follow_writes(path: str) -> dict:
    """Unsharded parameters kept after backward (``set_reshard_after_backward(False)``) or
    after an evaluation forward (``reshard_after_forward=False``) are gathered again after
    anything writes the sharded ones: this package's optimizers, which write the local pieces
    below autograd; per-rank math on ``.local``; DCP loads into one ``model.state_dict()``,
    whose detached tensors wrap the parameters' pieces."""
    import torch.distributed.checkpoint as dcp

    from raggedfsdp.optim import AdamW, AdamW8bit, Muon

    def make(kept: bool, seed: int = 0, policy=None) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 3))
        if kept:
            fully_shard(model[0], reshard_after_forward=False, shard_policy=policy)
            fully_shard(model, reshard_after_forward=False, shard_policy=policy)
            model.set_reshard_after_backward(False)
        return model

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    stale = {}
    eight_bit = partial(AdamW8bit, min_8bit_size=0)  # its CPU kernel writes through pointers
    policies = {"AdamW8bit": AdamW8bit.shard_policy(min_8bit_size=0)}
    for name, build in (("AdamW", AdamW), ("AdamW8bit", eight_bit), ("Muon", Muon)):
        kept, plain = make(True, policy=policies.get(name)), make(False)
        opts = []
        for model in (kept, plain):
            groups = [{"params": [model[0].weight]}, {"params": list(model[2].parameters())}]
            if build is Muon:
                groups[1]["use_muon"] = False
            opts.append(build(groups, lr=0.05))
        for model, opt in zip((kept, plain), opts, strict=True):
            model(x).square().sum().backward()
            opt.step()
        with torch.no_grad():
            stale[name] = not torch.equal(kept(x), plain(x))
    kept = make(True)
    with torch.no_grad():
        kept(x)  # kept gathered (reshard_after_forward=False)
        kept[0].weight.local.mul_(0.5)  # per-rank math on the local piece
        expected = torch.nn.functional.linear(x, kept[0].weight.full_tensor())
        stale["local"] = not torch.equal(kept[0](x), expected)
    state = {"model": kept.state_dict()}  # taken once, loaded into twice
    for seed in (1, 2):
        dcp.save({"model": make(False, seed).state_dict()}, checkpoint_id=f"{path}/{seed}")
    for seed in (1, 2):
        dcp.load(state, checkpoint_id=f"{path}/{seed}")
        with torch.no_grad():
            stale[f"dcp {seed}"] = not torch.equal(kept(x), make(False, seed)(x))
    return stale


@pytest.mark.parametrize("world_size", [2])
def test_kept_unsharded_parameters_follow_every_write_to_the_sharded_ones(pool, tmp_path):
    for stale in pool.run(_kept_copies_follow_writes, str(tmp_path / "ckpt")):
        assert not any(stale.values()), stale


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0])


def test_wrapping_a_module_whose_forward_never_runs_names_it_and_the_fix():
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``: the
    refused op says which wrapped module it is and to wrap the attention instead."""
    model = Attention()
    fully_shard(model.attn.out_proj)
    fully_shard(model)
    x = torch.randn(2, 3, 8)
    with pytest.raises(NotImplementedError, match=r"fully_shard module 'attn\.out_proj'.*Wrap"):
        model(x)
    fixed = Attention()
    fully_shard(fixed.attn)  # the fix works
    fully_shard(fixed)
    fixed(x).sum().backward()


def test_load_errors_name_parameters_given_by_position():
    """An optimizer built from ``model.parameters()`` knows positions only; the model (through
    ``set_optimizer_state_dict``) or fully_shard (directly) knows the names."""
    from raggedfsdp.optim import AdamW
    from raggedfsdp.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    for shard in (False, True):
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        if shard:
            fully_shard(model)
        opt = AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        bad = get_optimizer_state_dict(model, opt)
        bad["state"]["0.bias"]["exp_avg"] = torch.zeros(5)
        named = r"'0\.bias' \(param_groups\[0\]\[1\]\) state 'exp_avg': shape \(5,\)"
        with pytest.raises(ValueError, match=named):
            set_optimizer_state_dict(model, opt, bad)
        direct = copy.deepcopy(opt.state_dict())
        direct["state"][1]["exp_avg"] = torch.zeros(5)
        with pytest.raises(ValueError, match=named if shard else r"^'param_groups\[0\]\[1\]'"):
            opt.load_state_dict(direct)  # without a model only fully_shard's names are known
