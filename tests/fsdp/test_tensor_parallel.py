"""fully_shard x tensor parallelism at W=4: torchtitan's TP plan on a tiny Llama, then
``fully_shard(..., mesh=mesh["dp_shard"])`` (or the HSDP sub-mesh), against one process and
against torch's FSDP2 x TP; the TP-aware RaggedTensor (global shape, gathers, state dicts, DCP
boxes); optimizers and clipping on TP parameters; the refusals."""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import raggedfsdp
from raggedfsdp.optim import AdamW
from raggedfsdp.sharding import RaggedTensor
from raggedfsdp.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from tests.support.tp_models import (
    Llama,
    llama_batch,
    llama_loss,
    make_llama,
    parallelize_llama,
    tp_meshes,
    wrapped_llama,
)

ROWS = 8  # global batch rows: divisible by every data-parallel size tested
STEPS = 10
LR = 3e-3
MESHES = [(2, 2), (1, 4), (4, 1), (2, 1, 2)]


def _wrapped(dims: tuple[int, ...], wrap=raggedfsdp.fully_shard, **kwargs):
    return wrapped_llama(dims, wrap, **kwargs)


def _rows(x: torch.Tensor, index: int, size: int) -> torch.Tensor:
    per = x.shape[0] // size
    return x[index * per : (index + 1) * per]


def _train(model, opt, index: int, size: int, steps: int = STEPS, clip=None) -> list[float]:
    """The dp-mean losses (with ``clip``, a clip_grad_norm_ function: the norm before each)."""
    losses = []
    for step in range(steps):
        inputs, targets = llama_batch(step % 3, ROWS)
        loss = llama_loss(model, _rows(inputs, index, size), _rows(targets, index, size))
        loss.backward()
        if clip is not None:
            losses.append(clip(model.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the same on every TP rank: the dp mean
        losses.append(loss.item())
    return losses


@functools.cache
def _single(steps: int = STEPS, clip=None) -> tuple[list[float], dict]:
    """One process's losses and weights: the reference of every mesh, computed once per
    ``(steps, clip)`` (the tests only read it)."""
    model = make_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        inputs, targets = llama_batch(step % 3, ROWS)
        loss = llama_loss(model, inputs, targets)
        loss.backward()
        if clip is not None:
            losses.append(clip(model.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- end to end
def _end_to_end(dims: tuple[int, ...], optimizer: str) -> tuple[list[float], dict]:
    model, index, size = _wrapped(dims)
    cls = AdamW if optimizer == "ours" else torch.optim.AdamW
    opt = cls(model.parameters(), lr=LR)
    losses = _train(model, opt, index, size)
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dims", MESHES, ids=lambda d: "x".join(map(str, d)))
def test_training_matches_one_process(dist_pool, dims):
    expected, weights = _single()
    for optimizer in ("ours", "torch"):
        results = dist_pool(4).run(_end_to_end, dims, optimizer)
        for losses, params in results:
            assert max(abs(a - b) for a, b in zip(losses, expected, strict=True)) < 1e-5
            for name, value in weights.items():
                assert params[name].shape == value.shape
                assert torch.allclose(params[name], value, atol=1e-5), name


def _fsdp2_vs_ours(dims: tuple[int, ...], bf16: bool) -> list[float]:
    """Losses of FSDP2 x TP and of ours, the same model, data and mixed precision."""
    kind = torch.bfloat16 if bf16 else None
    mp = {"param_dtype": kind, "reduce_dtype": torch.float32 if bf16 else None}
    with warnings.catch_warnings():  # FSDP2's root returns the replicated logits as a view
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        theirs, index, size = _wrapped(
            dims, wrap=fsdp2_fully_shard, mp_policy=MixedPrecisionPolicy(**mp)
        )
        theirs_losses = _train(theirs, torch.optim.AdamW(theirs.parameters(), lr=LR), index, size)
    ours, index, size = _wrapped(dims, mp_policy=raggedfsdp.MixedPrecisionPolicy(**mp))
    ours_losses = _train(ours, AdamW(ours.parameters(), lr=LR), index, size)
    return [abs(a - b) for a, b in zip(ours_losses, theirs_losses, strict=True)]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_matches_fsdp2_times_tp(dist_pool, bf16):
    for diffs in dist_pool(4).run(_fsdp2_vs_ours, (2, 2), bf16):
        assert max(diffs) < 1e-5


def _meta_init(dims: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Built on the meta device, parallelized, wrapped, then materialized and initialised."""
    tp_mesh, dp_mesh, _, _ = tp_meshes(dims)
    with torch.device("meta"):
        model = parallelize_llama(Llama(), tp_mesh)
    for block in model.layers:
        raggedfsdp.fully_shard(block, mesh=dp_mesh)
    raggedfsdp.fully_shard(model, mesh=dp_mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def test_meta_init_gives_the_unsharded_weights(dist_pool):
    reference = Llama()
    torch.manual_seed(5)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.02)
    for dims in ((2, 2), (1, 4)):
        for params in dist_pool(4).run(_meta_init, dims):
            for n, p in reference.named_parameters():
                assert torch.equal(params[n], p.detach()), n


# ----------------------------------------------------------------------------- optimizer steps
def _same_gradient_steps(dims: tuple[int, ...], grads: dict[str, torch.Tensor]) -> dict:
    """Two steps of ours and of torch's AdamW from the given global gradients."""
    out = {}
    for name, cls in (("ours", AdamW), ("torch", torch.optim.AdamW)):
        model, _, _ = _wrapped(dims)
        opt = cls(model.parameters(), lr=LR, weight_decay=0.1)
        for _ in range(2):
            for n, p in model.named_parameters():
                p.grad = torch.empty_like(p).copy_(grads[n])  # this rank's piece of it
            opt.step()
        out[name] = {n: p.full_tensor() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("dims", [(2, 2), (1, 4)], ids=lambda d: "x".join(map(str, d)))
def test_adamw_step_is_bitwise_torch_on_tp_parameters(dist_pool, dims):
    reference = make_llama()
    gen = torch.Generator().manual_seed(7)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in reference.named_parameters()}
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    for _ in range(2):
        for n, p in reference.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
    for result in dist_pool(4).run(_same_gradient_steps, dims, grads):
        for which in ("ours", "torch"):
            for n, p in reference.named_parameters():
                assert torch.equal(result[which][n], p.detach()), (which, n)


def _clipped(dims: tuple[int, ...], clip) -> list[float]:
    model, index, size = _wrapped(dims)
    return _train(model, AdamW(model.parameters(), lr=LR), index, size, steps=3, clip=clip)


@pytest.mark.parametrize("clip", [raggedfsdp.clip_grad_norm_, torch.nn.utils.clip_grad_norm_])
def test_clip_grad_norm_counts_every_dim_once(dist_pool, clip):
    expected, _ = _single(steps=3, clip=torch.nn.utils.clip_grad_norm_)  # norms and losses
    for dims in ((2, 2), (2, 1, 2)):
        for values in dist_pool(4).run(_clipped, dims, clip):
            assert max(abs(a - b) for a, b in zip(values, expected, strict=True)) < 1e-5


# ----------------------------------------------------------------------------- state
def _state_dicts(dims: tuple[int, ...]) -> dict:
    """Full state dicts after two steps, and the same state loaded into a fresh model."""
    model, index, size = _wrapped(dims)
    opt = AdamW(model.parameters(), lr=LR)
    _train(model, opt, index, size, steps=2)
    full = StateDictOptions(full_state_dict=True)
    model_sd = get_model_state_dict(model, options=full)
    optim_sd = get_optimizer_state_dict(model, opt, options=full)
    fresh, _, _ = _wrapped(dims)
    fresh_opt = AdamW(fresh.parameters(), lr=LR)
    raggedfsdp.state_dict.set_state_dict(
        fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=full
    )
    reloaded = get_optimizer_state_dict(fresh, fresh_opt, options=full)
    # torch's own optimizer state dict, its sharded states replaced by full tensors: each rank
    # must take its TP block's piece of them
    torch_sd = opt.state_dict()
    for state in torch_sd["state"].values():
        for key, value in state.items():
            if isinstance(value, RaggedTensor):
                state[key] = value.full_tensor()
    third, _, _ = _wrapped(dims)
    third_opt = AdamW(third.parameters(), lr=LR)
    third_opt.load_state_dict(torch_sd)
    names = [n for n, _ in third.named_parameters()]
    loaded_full = {
        names[i]: third_opt.state[p]["exp_avg"].full_tensor()
        for i, p in enumerate(third.parameters())
    }
    return {
        "loaded_full": loaded_full,
        "model": model_sd,
        "gathered": {n: p.full_tensor() for n, p in model.named_parameters()},
        "fresh": {n: p.full_tensor() for n, p in fresh.named_parameters()},
        "exp_avg": {n: s["exp_avg"] for n, s in optim_sd["state"].items()},
        "reloaded": {n: s["exp_avg"] for n, s in reloaded["state"].items()},
        "types": {n: type(p).__name__ for n, p in model.named_parameters()},
    }


def test_full_state_dicts_are_global(dist_pool):
    shapes = {n: p.shape for n, p in make_llama().named_parameters()}
    for result in dist_pool(4).run(_state_dicts, (2, 2)):
        assert set(result["types"].values()) == {"RaggedTensor"}
        for n, shape in shapes.items():
            assert result["model"][n].shape == shape == result["exp_avg"][n].shape
            assert torch.equal(result["model"][n], result["gathered"][n])
            assert torch.equal(result["fresh"][n], result["gathered"][n])  # cut back to pieces
            assert torch.equal(result["reloaded"][n], result["exp_avg"][n])
            assert torch.equal(result["loaded_full"][n], result["exp_avg"][n])


def _dcp_save(path: str) -> dict:
    model, index, size = _wrapped((2, 2))
    opt = AdamW(model.parameters(), lr=LR)
    _train(model, opt, index, size, steps=2)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    exp_avg = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    return {"params": {n: p.full_tensor() for n, p in model.named_parameters()}, "exp_avg": exp_avg}


def _dcp_load(path: str, dims: tuple[int, ...]) -> dict:
    model, _, _ = _wrapped(dims)
    opt = AdamW(model.parameters(), lr=LR)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    opt.load_state_dict(state["optim"])
    exp_avg = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    return {"params": {n: p.full_tensor() for n, p in model.named_parameters()}, "exp_avg": exp_avg}


def test_dcp_boxes_are_global_across_mesh_changes(dist_pool, tmp_path):
    saved = dist_pool(4).run(_dcp_save, str(tmp_path))[0]  # at dp 2 x tp 2
    for dims in ((4, 1), (1, 2), (3, 1)):  # dp 4, dp 1 x tp 2, dp 3
        for loaded in dist_pool(math.prod(dims)).run(_dcp_load, str(tmp_path), dims):
            for key in ("params", "exp_avg"):
                for n, value in saved[key].items():
                    assert torch.equal(loaded[key][n], value), (dims, key, n)
    single = make_llama(seed=1).state_dict()  # one process, no process group
    dcp.load({"model": single}, checkpoint_id=str(tmp_path))
    for n, value in saved["params"].items():
        assert torch.equal(single[n], value), n


# ----------------------------------------------------------------------------- refusals
def _refusal(make_module, **kwargs) -> str:
    """The error ``fully_shard`` raises for the module ``make_module(mesh)`` builds on a
    (dp 2 x tp 2) mesh, after checking that the module's parameters were left as they were."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    module, fsdp_mesh = make_module(mesh)
    before = dict(module.named_parameters())
    try:
        raggedfsdp.fully_shard(module, mesh=fsdp_mesh, **kwargs)
    except (ValueError, NotImplementedError) as error:
        after = dict(module.named_parameters())
        assert all(after[n] is p for n, p in before.items()) and not isinstance(
            module, raggedfsdp.FSDPModule
        )
        return str(error)
    raise AssertionError("fully_shard accepted it")


def _linear_with(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(4, 4, bias=False)
    linear.weight = torch.nn.Parameter(weight)
    return linear


def _refusals() -> dict[str, str]:
    w = torch.randn(4, 4)
    return {
        "tp mesh as dp mesh": _refusal(
            lambda m: (parallelize_llama(make_llama(), m["tp"]).layers[0], m["tp"])
        ),
        "whole mesh": _refusal(lambda m: (parallelize_llama(make_llama(), m["tp"]).layers[0], m)),
        "shard over dp": _refusal(
            lambda m: (_linear_with(distribute_tensor(w, m["dp_shard"], [Shard(0)])), m["dp_shard"])
        ),
        "partial": _refusal(
            lambda m: (_linear_with(DTensor.from_local(w, m["tp"], [Partial()])), m["dp_shard"])
        ),
        "strided": _refusal(
            lambda m: (
                _linear_with(DTensor.from_local(w, m["tp"], [_StridedShard(0, split_factor=2)])),
                m["dp_shard"],
            )
        ),
        "2-d mesh": _refusal(
            lambda m: (
                _linear_with(distribute_tensor(w, m, [Replicate(), Shard(0)])),
                m["dp_shard"],
            )
        ),
        "not divisible": _refusal(
            lambda m: (
                _linear_with(distribute_tensor(torch.randn(5, 4), m["tp"], [Shard(0)])),
                m["dp_shard"],
            )
        ),
        "fp8": _refusal(
            lambda m: (parallelize_llama(make_llama(), m["tp"]).layers[0], m["dp_shard"]),
            mp_policy=raggedfsdp.MixedPrecisionPolicy(all_gather=raggedfsdp.fsdp.Float8Blocks(4)),
        ),
    }


def test_bad_input_is_refused_before_anything_changes(dist_pool):
    expected = {
        "tp mesh as dp mesh": ("'attention_norm.weight'", "shares ranks", "mesh['dp_shard']"),
        "whole mesh": ("'attention_norm.weight'", "shares ranks", "mesh['dp_shard']"),
        "shard over dp": ("'weight'", "shares ranks", "mesh['dp_shard']"),
        "partial": ("'weight'", "Partial", "Shard(dim) and Replicate()"),
        "strided": ("'weight'", "_StridedShard", "Shard(dim) and Replicate()"),
        "2-d mesh": ("'weight'", "1-D TP mesh", "mesh['dp_shard']"),
        "not divisible": ("'weight'", "size 5 does not divide by the TP degree 2", "choose"),
        "fp8": ("'attention_norm.weight'", "Replicate()", "all_gather", "without all_gather"),
    }
    for messages in dist_pool(4).run(_refusals):
        for case, parts in expected.items():
            assert "\n" not in messages[case]
            for part in parts:
                assert part in messages[case], (case, messages[case])


def _notes() -> tuple[str, ...]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    block = parallelize_llama(make_llama(), mesh["tp"]).layers[0]
    raggedfsdp.fully_shard(
        block, mesh=mesh["dp_shard"], shard_policy=raggedfsdp.sharding.row_units(4)
    )
    return block._fsdp_state().group.notes


def test_blocks_cut_by_the_tp_split_are_noted(dist_pool):
    notes = " ".join(dist_pool(4).run(_notes)[0])
    assert "'attention.wo.weight'" in notes and "'feed_forward.w2.weight'" in notes  # Shard(1)
    assert "'attention.wq.weight'" not in notes  # Shard(0): 8 local rows, 4-row blocks whole


def _accumulated(dims: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Two micro-batches, the first without gradient sync, then one step."""
    model, index, size = _wrapped(dims)
    opt = AdamW(model.parameters(), lr=LR)
    for micro in range(2):
        model.set_requires_gradient_sync(micro == 1)
        inputs, targets = llama_batch(micro, ROWS)
        llama_loss(model, _rows(inputs, index, size), _rows(targets, index, size)).backward()
    opt.step()
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def test_gradient_accumulation_without_sync(dist_pool):
    reference = make_llama()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    for micro in range(2):
        llama_loss(reference, *llama_batch(micro, ROWS)).backward()
    opt.step()
    for params in dist_pool(4).run(_accumulated, (2, 2)):
        for n, p in reference.named_parameters():
            assert torch.allclose(params[n], p.detach(), atol=1e-6), n


def _strict_refusal() -> tuple[str, str]:
    """``strict(row_units(4))`` on a block whose rowwise weights TP cuts: refused, the block
    left as it was; the plain policy notes it instead."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    block = parallelize_llama(make_llama(), mesh["tp"]).layers[0]
    policy = raggedfsdp.sharding.strict(raggedfsdp.sharding.row_units(4))
    try:
        raggedfsdp.fully_shard(block, mesh=mesh["dp_shard"], shard_policy=policy)
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError("a strict policy accepted blocks cut by TP")
    assert not isinstance(block, raggedfsdp.FSDPModule)
    fine = parallelize_llama(make_llama(), mesh["tp"]).layers[0].attention.wq
    raggedfsdp.fully_shard(fine, mesh=mesh["dp_shard"], shard_policy=policy)  # Shard(0): whole
    return message, type(fine).__name__


def test_a_strict_policy_refuses_blocks_cut_by_tp(dist_pool):
    for message, wrapped in dist_pool(4).run(_strict_refusal):
        assert "strict shard policy" in message and "'attention.wo.weight'" in message
        assert "drop strict(...)" in message and "\n" not in message
        assert wrapped == "RaggedFSDPLinear"  # the colwise weight wrapped fine
