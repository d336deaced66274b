"""fully_shard: training parity with one process and with PyTorch FSDP2, HSDP, mixed precision,
checkpointing, gradient accumulation, zero-copy buffers and bad input."""

from __future__ import annotations

from functools import partial
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import raggedfsdp.fsdp.param_group as param_group_module
import raggedfsdp.sharding.schedule as schedule
from raggedfsdp import MixedPrecisionPolicy, fully_shard
from raggedfsdp.fsdp import FSDPModule
from raggedfsdp.fsdp.state import in_backward
from raggedfsdp.sharding import RaggedShard, RaggedTensor, row_units
from tests.support.fsdp_training import (
    ROWS,
    counting,
    full_params,
    max_diff,
    my_rows,
    shard_blocks,
    torchtitan_wrap,
    train,
)
from tests.support.tiny_models import batch, loss_fn, make_model


# ----------------------------------------------------------------------------- parity
def _parity(steps: int, checkpoint: bool) -> dict:
    world = dist.get_world_size()
    reference = make_model()
    ours = shard_blocks(make_model(), shard_policy=row_units(1))
    ours.checkpoint = checkpoint
    ref_losses = train(
        reference,
        torch.optim.AdamW(reference.parameters(), lr=1e-2),
        steps,
        sharded=False,
        clip=1.0,
    )
    our_losses = train(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2), steps, clip=1.0)

    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    peer = make_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in peer.layers:
        fsdp2_fully_shard(layer, mesh=mesh)
    fsdp2_fully_shard(peer, mesh=mesh)
    peer_opt = torch.optim.AdamW(peer.parameters(), lr=1e-2)
    peer_losses = []
    for step in range(steps):
        inputs, targets = batch(step % 2, ROWS)
        loss = loss_fn(peer, my_rows(inputs), my_rows(targets))
        loss.backward()
        peer_losses.append(torch.nn.utils.clip_grad_norm_(peer.parameters(), 1.0).item())
        peer_opt.step()
        peer_opt.zero_grad()
        dist.all_reduce(loss := loss.detach().clone(), op=dist.ReduceOp.AVG)
        peer_losses.append(loss.item())
    peer_params = full_params(peer)
    ours_params = full_params(ours)
    return {
        "vs_reference": max_diff(ours, reference),
        "loss_vs_reference": max(abs(a - b) for a, b in zip(our_losses, ref_losses, strict=True)),
        "vs_fsdp2": max((ours_params[n] - peer_params[n]).abs().max().item() for n in peer_params),
        "bitwise_fsdp2": all(torch.equal(ours_params[n], peer_params[n]) for n in peer_params),
        "losses": our_losses,
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_training_matches_one_process_and_fsdp2(pool, world_size):
    results = pool.run(_parity, 4, False)
    for res in results:
        assert res["vs_reference"] < 2e-5, res
        assert res["loss_vs_reference"] < 2e-5, res
        assert res["vs_fsdp2"] < 2e-5, res
    losses = results[0]["losses"][1::2]
    assert losses[2] < losses[0] and losses[3] < losses[1]  # the loss falls


@pytest.mark.parametrize("world_size", [3])
def test_activation_checkpointing_gives_the_same_training(pool):
    plain = pool.run(_parity, 3, False)
    recomputed = pool.run(_parity, 3, True)
    assert [r["losses"] for r in plain] == [r["losses"] for r in recomputed]


# ----------------------------------------------------------------------------- HSDP
def _hsdp_vs_fsdp(steps: int) -> float:
    flat = shard_blocks(make_model())
    flat_losses = train(flat, torch.optim.AdamW(flat.parameters(), lr=1e-2), steps)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = shard_blocks(make_model(), mesh=mesh)
    hsdp_losses = train(hsdp, torch.optim.AdamW(hsdp.parameters(), lr=1e-2), steps)
    params = full_params(flat)
    diff = max((p.full_tensor() - params[n]).abs().max().item() for n, p in hsdp.named_parameters())
    return max(diff, max(abs(a - b) for a, b in zip(flat_losses, hsdp_losses, strict=True)))


@pytest.mark.parametrize("world_size", [4])
def test_hsdp_2x2_matches_1d(pool):
    assert max(pool.run(_hsdp_vs_fsdp, 3)) < 2e-5


# ----------------------------------------------------------------------------- mixed precision
def _mixed_precision(steps: int) -> dict:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = shard_blocks(make_model(), mp_policy=policy)
    reference = make_model()
    our_losses = train(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2), steps)
    ref_losses = train(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), steps, sharded=False
    )
    dtypes = {p.dtype for p in ours.parameters()} | {p.grad is None for p in ours.parameters()}
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(our_losses, ref_losses, strict=True)),
        "param_diff": max_diff(ours, reference),
        "master_dtypes": dtypes,
        "reduced": _reduced_gradient(policy),
    }


def _reduced_gradient(policy: MixedPrecisionPolicy) -> torch.Tensor:
    """The averaged gradient of a weight whose per-rank gradients are exact in bf16 but whose
    mean is not: rank 0's is 1, rank 1's 2**-8. An fp32 reduction gives (1 + 2**-8) / 2; a
    bf16 one rounds it to 0.5 (training losses cannot tell the two apart)."""
    model = nn.Linear(4, 1, bias=False)
    fully_shard(model, mp_policy=policy)
    x = torch.full((1, 4), 1.0 if dist.get_rank() == 0 else 2.0**-8)
    model(x).sum().backward()  # the weight's gradient is x, computed in bf16
    return model.weight.grad.full_tensor()


@pytest.mark.parametrize("world_size", [2])
def test_bf16_compute_with_fp32_master_and_reduction(pool):
    for res in pool.run(_mixed_precision, 3):
        assert res["master_dtypes"] == {torch.float32, True}
        assert res["loss_diff"] < 3e-2 and res["param_diff"] < 3e-2, res
        assert torch.equal(res["reduced"], torch.full((1, 4), (1 + 2.0**-8) / 2)), res["reduced"]


def _flush_order() -> list[tuple[str, bool]]:
    """With mixed precision each group holds its bf16 gradients until the last arrives; they go
    into the fp32 buffer only after the group's parameters are freed."""
    from raggedfsdp.fsdp.param_group import ParamGroup

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = torchtitan_wrap(make_model(), partial(fully_shard, mp_policy=mp))
    seen, flush = [], ParamGroup.flush_held_grads

    def recording(group: ParamGroup) -> None:
        if group._held:
            seen.append((group.name, group.compute.is_full_allocated))
        flush(group)

    with mock.patch.object(ParamGroup, "flush_held_grads", recording):
        loss_fn(model, *batch(0, 2)).backward()
    return seen


@pytest.mark.parametrize("world_size", [2])
def test_mixed_precision_gradients_are_flattened_after_the_parameters_are_freed(pool):
    for seen in pool.run(_flush_order):
        assert [name for name, _ in seen] == [
            "[norm, head]",
            "layers.2",
            "layers.1",
            "layers.0",
            "embed",
        ], seen
        assert not any(allocated for _, allocated in seen), seen


# ----------------------------------------------------------------------------- accumulation
def _accumulation() -> float:
    ours = shard_blocks(make_model())
    inputs, targets = batch(0, ROWS)
    inputs, targets = my_rows(inputs), my_rows(targets)
    half = inputs.shape[0] // 2 or 1
    ours.set_requires_gradient_sync(False)
    (loss_fn(ours, inputs[:half], targets[:half]) * 0.5).backward()
    no_comm = all(p.grad is None for p in ours.parameters())
    ours.set_requires_gradient_sync(True)
    (loss_fn(ours, inputs[half:], targets[half:]) * 0.5).backward()
    accumulated = {n: p.grad.full_tensor() for n, p in ours.named_parameters()}
    whole = shard_blocks(make_model())
    loss_fn(whole, inputs, targets).backward()
    assert no_comm, "gradients were reduced while sync was off"
    return max(
        (p.grad.full_tensor() - accumulated[n]).abs().max().item()
        for n, p in whole.named_parameters()
    )


@pytest.mark.parametrize("world_size", [2])
def test_gradient_accumulation_without_sync(pool):
    assert max(pool.run(_accumulation)) < 1e-6


# ----------------------------------------------------------------------------- torch's clipping
def _whole_reductions() -> dict:
    """sum/mean/max/min/amax/amin/var/std of sharded gradients equal those of the gathered
    ones on every rank (some ranks hold empty pieces of the small tensors)."""
    model = shard_blocks(make_model())
    inputs, targets = batch(0, ROWS)
    loss_fn(model, my_rows(inputs), my_rows(targets)).backward()
    reductions = {
        "sum": torch.sum,
        "mean": torch.mean,
        "max": torch.max,
        "min": torch.min,
        "amax": torch.amax,
        "amin": torch.amin,
        "var": torch.var,
        "std": torch.std,
    }
    worst = 0.0
    for p in model.parameters():
        full = p.grad.full_tensor()
        for name, reduce in reductions.items():
            mine, expected = reduce(p.grad), reduce(full)
            assert not isinstance(mine, RaggedTensor)
            # sums cancel: their error is relative to the sum of magnitudes
            scale = reduce(full.abs()) if name in ("sum", "mean") else expected.abs()
            worst = max(worst, ((mine - expected).abs() / scale.clamp_min(1e-30)).item())
    empty = sum(p.grad.local.numel() == 0 for p in model.parameters())
    return {"worst_relative": worst, "empty_pieces": empty}


@pytest.mark.parametrize("world_size", [3, 4])
def test_whole_tensor_reductions_of_sharded_gradients(pool):
    results = pool.run(_whole_reductions)
    assert all(r["worst_relative"] < 1e-5 for r in results), results
    assert sum(r["empty_pieces"] for r in results) > 0  # the empty-piece path ran


def _grad_scaler(kind: str) -> dict:
    """torch's GradScaler (or FSDP's ShardedGradScaler) on sharded gradients: training as one
    process does, and an inf in one rank's piece makes every rank skip the step."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    make_scaler = {"torch": torch.amp.GradScaler, "sharded": ShardedGradScaler}[kind]
    models = {"reference": make_model(), "ours": shard_blocks(make_model())}
    for name, model in models.items():
        scaler = make_scaler("cpu", init_scale=1024.0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            inputs, targets = batch(step % 2, ROWS)
            if name == "ours":
                inputs, targets = my_rows(inputs), my_rows(targets)
            scaler.scale(loss_fn(model, inputs, targets)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    params = full_params(models["ours"])
    diff = max(
        (params[n] - p).abs().max().item() for n, p in models["reference"].named_parameters()
    )
    # an overflow in rank 0's piece only: every rank must skip the step and halve the scale
    model = models["ours"]
    loss_fn(model, *batch(0, 2)).backward()
    if dist.get_rank() == 0:
        piece = next(p.grad.local for p in model.parameters() if p.grad.local.numel())
        piece[0] = float("inf")
    before = full_params(model)
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    skipped = all(torch.equal(before[n], t) for n, t in full_params(model).items())
    return {"vs_one_process": diff, "skipped": skipped, "halved": scaler.get_scale() == scale / 2}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["torch", "sharded"])
def test_grad_scaler_unscales_pieces_and_agrees_on_overflow(pool, kind):
    for res in pool.run(_grad_scaler, kind):
        assert res["vs_one_process"] < 2e-5 and res["skipped"] and res["halved"], res


def _torch_clipping() -> dict:
    """torch.nn.utils' norm and clipping functions on fully_shard gradients: the whole
    tensors' norms (one all-reduce per call), as FSDP2 users call them."""
    import math

    from raggedfsdp import clip_grad_norm_

    model = shard_blocks(make_model())
    loss_fn(model, *(my_rows(t) for t in batch(0, ROWS))).backward()
    full = [p.grad.full_tensor() for p in model.parameters()]
    errors = {}
    for norm_type in (2.0, 1.0, 0.0, math.inf):
        whole = [torch.linalg.vector_norm(g, norm_type) for g in full]
        expected = torch.linalg.vector_norm(torch.stack(whole), norm_type).item()
        for foreach in (True, False):
            got = torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters()], norm_type, foreach=foreach
            )
            errors[f"ord={norm_type} foreach={foreach}"] = abs(got.item() / expected - 1)
    twin = shard_blocks(make_model())
    loss_fn(twin, *(my_rows(t) for t in batch(0, ROWS))).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    ours = clip_grad_norm_(twin.parameters(), 0.1)
    clipped = [p.grad.full_tensor() for p in model.parameters()]
    coef = 0.1 / (norm.item() + 1e-6)
    return {
        "norm_errors": errors,
        "returns_plain_tensor": type(norm) is torch.Tensor,
        "vs_raggedfsdp_clip": abs(norm.item() / ours.item() - 1),
        "clip_error": max(
            (c - g * coef).abs().max().item() for c, g in zip(clipped, full, strict=True)
        ),
    }


@pytest.mark.parametrize("world_size", [1, 3])
def test_torch_clip_grad_norm_works_on_sharded_gradients(pool):
    for res in pool.run(_torch_clipping):
        assert max(res["norm_errors"].values()) < 1e-5, res
        assert res["returns_plain_tensor"] and res["vs_raggedfsdp_clip"] < 1e-6, res
        assert res["clip_error"] < 1e-7, res


# ----------------------------------------------------------------------------- zero copy
def _zero_copy() -> dict:
    model = shard_blocks(make_model())
    layer = model.layers[0]
    group = layer._raggedfsdp_state.group
    sharded_views = all(
        p.local.untyped_storage().data_ptr() == group.master.shard.untyped_storage().data_ptr()
        for p in layer.parameters()
    )
    loss = loss_fn(model, *batch(0, 2))
    freed_after_forward = not group.compute.is_full_allocated
    layer.unshard()
    unsharded_views = all(
        p.untyped_storage().data_ptr() == group.compute.full.untyped_storage().data_ptr()
        for p in layer.parameters()
    )
    layer.reshard()
    layer.unshard(async_op=True)  # a prefetch nobody uses: reshard must free its buffer too
    layer.reshard()
    prefetch_freed = not group.compute.is_full_allocated
    loss.backward()
    # all sharded grads of the group are views of one S-element segment: the reduce output
    storages = {p.grad.local.untyped_storage().data_ptr() for p in layer.parameters()}
    grad_views = len(storages) == 1 and all(
        p.grad.local.untyped_storage().nbytes() == 4 * group.layout.segment_size
        for p in layer.parameters()
    )
    return {
        "sharded_params_view_flat_shard": sharded_views,
        "unsharded_params_view_gathered_buffer": unsharded_views,
        "sharded_grads_view_reduce_output": grad_views,
        "unsharded_freed_after_forward": freed_after_forward,
        "unused_prefetch_freed_by_reshard": prefetch_freed,
        "freed_after_backward": not group.compute.is_full_allocated
        and not group.grads.is_full_allocated,
    }


@pytest.mark.parametrize("world_size", [3])
def test_parameters_and_gradients_are_views_of_the_flat_buffers(pool):
    for res in pool.run(_zero_copy):
        assert all(res.values()), res


def _one_rank_holds_the_whole_group() -> dict:
    """At one shard rank, in the parameters' own dtype, the sharded and the unsharded
    parameters view one buffer: no gather, no copy, nothing freed; an optimizer step is what
    the next forward reads; the gradients go straight into the sharded segment (no flat
    gradient buffer filled and copied out). A bf16 compute dtype still gathers (casts) into a
    buffer of its own, and frees it."""
    model = shard_blocks(make_model())
    group = model.layers[0]._raggedfsdp_state.group
    grad_buffer_allocs: list[None] = []
    alloc_full = group.grads.alloc_full
    group.grads.alloc_full = lambda: grad_buffer_allocs.append(None) or alloc_full()
    storage = group.master.full.untyped_storage()
    base = storage.data_ptr()
    sharded_alias = all(
        p.local.untyped_storage().data_ptr() == base for p in model.layers[0].parameters()
    )
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen, losses = [], []
    model.layers[0].register_forward_hook(  # before fully_shard's, which reshards
        lambda mod, args, out: seen.extend(
            p.untyped_storage().data_ptr() for p in mod.parameters()
        ),
        prepend=True,
    )
    for step in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            loss = loss_fn(m, *batch(step, ROWS))
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
    bf16 = shard_blocks(make_model(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    bf16_group = bf16.layers[0]._raggedfsdp_state.group
    loss_fn(bf16, *batch(0, ROWS)).backward()
    return {
        "whole": group.shard_is_whole and not bf16_group.shard_is_whole,
        "sharded_alias": sharded_alias,
        "unsharded_alias": all(ptr == base for ptr in seen),
        "still_one_buffer": group.master.full.untyped_storage().data_ptr() == base,
        "no_gathered_bytes": group.all_gather_bytes == 0 and group.gathered_bytes == 0,
        "resharded": not group.is_unsharded,
        "losses_equal": losses[0::2] == losses[1::2],
        "gradients_straight_into_the_segment": not grad_buffer_allocs,
        "bf16_gathers_and_frees": bf16_group.all_gather_bytes > 0
        and not bf16_group.compute.is_full_allocated,
    }


@pytest.mark.parametrize("world_size", [1])
def test_one_rank_computes_on_the_sharded_memory(pool):
    for res in pool.run(_one_rank_holds_the_whole_group):
        assert all(res.values()), res


def _root_freed_after_the_head(variant: str) -> dict:
    """Whether the root's gathered norm + head are still held when the last block's backward
    starts (their gradients are in), whether its embedding, a group of its own, was freed
    right after forward, and how often each is gathered in a step after the first (with
    ``set_reshard_after_backward(False)`` both stay from the first step's backward on)."""
    model = shard_blocks(make_model())
    state = model._raggedfsdp_state
    root, lookups = state.group, state.forward_only
    if variant == "frozen head":  # read in backward, with no signal when that is over (the
        # root's inputs, token ids, get no gradient): held to the end of backward
        model.head.weight.requires_grad_(False)
    if variant == "kept after backward":  # no all-gather of either in the next forward
        model.set_reshard_after_backward(False, recurse=False)
    seen = {"embedding alone": [mp.fqn for mp in lookups.params] == ["embed.weight"]}

    def look(*_) -> None:
        seen["held"] = root.compute.is_full_allocated

    model.layers[-1].register_full_backward_pre_hook(look)
    loss_fn(model, *batch(0, 2)).backward()  # the root's lazy set-up names the groups
    with counting("all_gather_flat", model) as calls:
        loss = loss_fn(model, *batch(1, 2))
        seen["embedding freed after forward"] = not lookups.compute.is_full_allocated
        loss.backward()
    # the root's norm and head once, in forward (kept for their backward, as FSDP2's root),
    # not again after (the first block does not prefetch them back); the embedding never in
    # backward
    seen["gathers"] = (calls["root (TinyTransformer)"], calls["root (TinyTransformer): embeddings"])
    return seen


@pytest.mark.parametrize("world_size", [2])
def test_root_embedding_is_freed_after_forward_and_the_head_after_its_backward(pool):
    """FSDP2 holds both to the end of backward; the parity tests above show the same training."""
    for variant, held, freed, gathers in (
        ("default", False, True, (1, 1)),
        ("frozen head", True, True, (1, 1)),
        ("kept after backward", True, False, (0, 0)),
    ):
        expected = {
            "embedding alone": True,
            "held": held,
            "embedding freed after forward": freed,
            "gathers": gathers,
        }
        assert pool.run(_root_freed_after_the_head, variant) == [expected] * 2, variant


def _frozen_and_unfrozen_after_wrapping(steps: int) -> dict:
    """The head frozen after a step, and a block weight frozen before wrapping unfrozen after
    one: with FSDP2 side by side doing the same."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    models = []
    for wrap in (fully_shard, fsdp2_fully_shard):
        model = make_model()
        model.layers[0].w1.weight.requires_grad_(False)
        models.append(shard_blocks(model, wrap))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    head_before = None
    for step in range(steps):
        if step == 1:
            head_before = models[0].head.weight.full_tensor()
            for model in models:
                model.head.weight.requires_grad_(False)
                model.layers[0].w1.weight.requires_grad_(True)
        for model, opt in zip(models, opts, strict=True):
            loss_fn(model, *batch(step % 2, 2)).backward()
            opt.step()
            opt.zero_grad()
    ours, peer = full_params(models[0]), full_params(models[1])
    return {
        "head_kept": torch.equal(ours["head.weight"], head_before),
        "w1_trained": not torch.equal(ours["layers.0.w1.weight"], make_model().layers[0].w1.weight),
        "vs_fsdp2": max((ours[n] - peer[n]).abs().max().item() for n in ours),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_freezing_after_wrapping_takes_effect_at_the_next_forward(pool):
    for res in pool.run(_frozen_and_unfrozen_after_wrapping, 3):
        assert res["head_kept"] and res["w1_trained"], res
        assert res["vs_fsdp2"] < 1e-6, res


def _frozen_parameters_read_after_the_trainable_gradients(steps: int) -> dict:
    """Fine-tuning with a block's attention frozen and another block wholly frozen, beside
    FSDP2 doing the same: backward reads the frozen weights after every trainable gradient of
    the block is in, so only the gradients of the block's input say when it is done with
    them. Also whether each block is freed before the backward of the block below starts."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    models = []
    for wrap in (fully_shard, fsdp2_fully_shard):
        model = make_model()
        for p in [*model.layers[1].attn_norm.parameters(), *model.layers[1].attn.parameters()]:
            p.requires_grad_(False)
        model.layers[2].requires_grad_(False)
        models.append(shard_blocks(model, wrap))
    ours = models[0]
    held = {}
    for below, block in ((ours.layers[0], "layers.1"), (ours.layers[1], "layers.2")):
        group = ours.layers[int(block[-1])]._raggedfsdp_state.group
        below.register_full_backward_pre_hook(
            lambda *_, b=block, g=group: held.__setitem__(b, g.compute.is_full_allocated)
        )
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(steps):
        for model, opt in zip(models, opts, strict=True):
            loss_fn(model, *(my_rows(t) for t in batch(step % 2, ROWS))).backward()
            opt.step()
            opt.zero_grad()
    full, peer = full_params(ours), full_params(models[1])
    return {
        "vs_fsdp2": max((full[n] - peer[n]).abs().max().item() for n in full),
        "frozen_kept": torch.equal(full["layers.2.w2.weight"], make_model().layers[2].w2.weight),
        "held_at_the_block_below": held,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_frozen_parameters_read_after_the_trainable_gradients_stay_gathered_until_read(pool):
    """Before, the block was freed once its trainable gradients were in, and its frozen
    attention's backward then failed reading freed storage."""
    for res in pool.run(_frozen_parameters_read_after_the_trainable_gradients, 3):
        assert res["vs_fsdp2"] < 1e-6 and res["frozen_kept"], res
        assert res["held_at_the_block_below"] == {"layers.1": False, "layers.2": False}, res


def _gathered_at_each_backward_all_gather(root_reshard: bool | None) -> list[int]:
    """How many groups hold gathered parameters each time backward starts an all-gather
    (``root_reshard``: the root's ``reshard_after_forward``), with the groups taken as above
    the latency bound (``LATENCY_BOUND_BYTES`` at 0: one group prefetched at a time)."""
    with mock.patch.object(schedule, "LATENCY_BOUND_BYTES", 0):
        return _gathered_in_backward(root_reshard)


def _gathered_in_backward(root_reshard: bool | None) -> list[int]:
    model = make_model()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model, reshard_after_forward=root_reshard)
    groups = [
        g for m in model.modules() if isinstance(m, FSDPModule) for g in m._fsdp_state().groups
    ]
    loss_fn(model, *batch(0, 2)).backward()  # the first step records the order
    original, held = param_group_module.all_gather_flat, []

    def watched(*args, **kwargs):
        if in_backward():  # the new buffer is allocated by now
            held.append(sum(g.compute.is_full_allocated for g in groups))
        return original(*args, **kwargs)

    with mock.patch.object(param_group_module, "all_gather_flat", watched):
        loss_fn(model, *batch(1, 2)).backward()
    return held


@pytest.mark.parametrize("world_size", [2])
def test_backward_holds_two_groups_at_most_when_it_prefetches(pool):
    """The one computing and the one prefetched: a block is freed once its input's gradient is
    computed, before that gradient reaches the block below, whose backward prefetches the next
    (the root's norm and head are freed after the head's backward, the embedding after
    forward). Before that signal was an autograd Function, the count reached 3."""
    for held in pool.run(_gathered_at_each_backward_all_gather, True):
        # the root freed after forward: the root alone (gathered again, no prefetch beside the
        # head's backward), the last block alone once the root is freed, then each block with
        # the one it prefetches
        assert held == [1, 1, 2, 2], held
    for held in pool.run(_gathered_at_each_backward_all_gather, None):
        # the default, FSDP2's root schedule: its norm and head held from forward (the
        # embedding freed after it), the last block prefetched beside the head's backward,
        # then each block with the one it prefetches
        assert held == [2, 2, 2], held
    for held in pool.run(_gathered_at_each_backward_all_gather, False):
        # all of the root kept (the embedding too, to the end, as FSDP2 keeps it)
        assert held == [3, 3, 3], held


class _HeadReadingTheEmbedding(nn.Module):
    """A lookup whose weight the head also reads directly (``h @ embed.weight.T``), as some
    models tie their output projection: backward reads the embedding weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix = nn.Embedding(32, 16), nn.Linear(16, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mix(self.embed(tokens)) @ self.embed.weight.T


def _embedding_read_by_the_head(frozen: bool) -> dict:
    models = []
    for wrap in (lambda m: m, fully_shard):
        torch.manual_seed(0)
        model = _HeadReadingTheEmbedding()
        model.embed.weight.requires_grad_(not frozen)  # a frozen one's reads leave no trace
        models.append(wrap(model))
    reference, ours = models
    state = ours._raggedfsdp_state
    inputs, targets = batch(0, ROWS)
    logits = ours(my_rows(inputs))
    kept = state.forward_only.compute.is_full_allocated
    F.cross_entropy(logits.flatten(0, 1), my_rows(targets).flatten()).backward()
    F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten()).backward()
    return {
        "own_group": [mp.fqn for mp in state.forward_only.params] == ["embed.weight"],
        "kept_for_backward": kept,
        "freed_after_backward": not state.forward_only.compute.is_full_allocated,
        "grad_error": max(
            (p.grad.full_tensor() - q.grad).abs().max().item()
            for p, q in zip(ours.parameters(), reference.parameters(), strict=True)
            if q.requires_grad
        ),
    }


@pytest.mark.parametrize("world_size", [2])
def test_an_embedding_weight_read_beyond_its_lookup_stays_gathered_for_backward(pool):
    """The forward's autograd graph shows the head reading it: its group is not freed after
    forward (it would be for a lookup alone, see the root test above); nor is a frozen one,
    whose reads the graph cannot show."""
    for frozen in (False, True):
        for res in pool.run(_embedding_read_by_the_head, frozen):
            assert res["own_group"] and res["kept_for_backward"], (frozen, res)
            assert res["freed_after_backward"] and res["grad_error"] < 1e-6, (frozen, res)


class _ReusedUnderReentrantCheckpoints(nn.Module):
    """``lin`` runs in two reentrant checkpoints: its gradient arrives twice in one backward,
    from two nested backward passes. In the order ``lin, other, lin`` every gradient of the
    group is in before the first region's recomputation, which still reads ``lin``."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.other, self.lin = nn.Linear(8, 8), nn.Linear(8, 8)
        self.order = order.split(", ")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.order:
            x = torch.utils.checkpoint.checkpoint(getattr(self, name), x, use_reentrant=True)
        return x


def _reentrant_reuse(order: str) -> float:
    torch.manual_seed(0)
    reference = _ReusedUnderReentrantCheckpoints(order)
    torch.manual_seed(0)
    ours = fully_shard(_ReusedUnderReentrantCheckpoints(order))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    reference(x).square().sum().backward()
    ours(x.detach().requires_grad_()).square().sum().backward()
    return max(
        (p.grad.full_tensor() - q.grad).abs().max().item()
        for p, q in zip(ours.parameters(), reference.parameters(), strict=True)
    )


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("order", ["other, lin, lin", "lin, other, lin"])
def test_a_weight_reused_in_reentrant_checkpoints_gets_the_summed_gradient(pool, order):
    """The group waits for its input's gradient, computed after the last recomputation
    (before, the second order freed it early and the recomputation failed)."""
    assert max(pool.run(_reentrant_reuse, order)) < 1e-6


# ----------------------------------------------------------------------------- checkpointing
def _save(path: str, steps: int) -> dict:
    import torch.distributed.checkpoint as dcp

    model = shard_blocks(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, steps)
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    full = full_params(model)
    return full


def _load(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model = shard_blocks(make_model(seed=123))  # different init: everything must come from disk
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    return full_params(model)


def test_dcp_save_at_4_load_at_3_and_1(dist_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = dist_pool(4).run(_save, path, 2)[0]
    for world in (3, 1):
        for loaded in dist_pool(world).run(_load, path):
            assert saved.keys() == loaded.keys()
            for name in saved:
                assert torch.equal(saved[name], loaded[name]), (world, name)


# ----------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_with_clear_errors():
    model = make_model()
    fully_shard(model.layers[0])
    with pytest.raises(ValueError, match="already wrapped"):
        fully_shard(model.layers[0])
    tied = make_model()
    tied.head.weight = tied.embed.weight
    fully_shard(tied.layers[0])
    fully_shard(tied)  # tied weights inside one group are fine
    assert tied._raggedfsdp_state.group.layout.by_name.keys() >= {"embed.weight"}
    split = make_model()
    split.layers[1].w1.weight = split.layers[0].w1.weight
    fully_shard(split.layers[0])
    with pytest.raises(
        ValueError, match=r"w1\.weight.* already sharded by the fully_shard call on Block"
    ):
        fully_shard(split.layers[1])
    mixed = make_model()  # (several dtypes in one group are fine: tests/fsdp/test_mixed_dtypes.py)
    mixed.layers[0].w1.to("meta")
    with pytest.raises(ValueError, match="one fully_shard group holds one device"):
        fully_shard(mixed.layers[0])
    fully_shard(mixed.layers[0].w1)  # the fix the error suggests works
    fully_shard(mixed.layers[0])
    foreign = make_model()  # a subclass parameter fully_shard did not make
    spec = RaggedShard.even(tuple(foreign.head.bias.shape), 1, 1, "bias")
    foreign.head.bias = nn.Parameter(RaggedTensor(foreign.head.bias.detach().clone(), spec, 0))
    with pytest.raises(ValueError, match=r"'bias' is a RaggedTensor: fully_shard shards plain"):
        fully_shard(foreign.head)
    assert not hasattr(foreign.head, "_raggedfsdp_state")
    # refused while planning the embedding's group, after the norm's and head's: nothing stays
    root = make_model()
    before = dict(root.named_parameters())
    with pytest.raises(ValueError, match=r"unit=0 for parameter 'embed\.weight'"):
        fully_shard(root, shard_policy=lambda fqn, p: 0 if fqn == "embed.weight" else 1)
    assert dict(root.named_parameters()) == before and not hasattr(root, "_raggedfsdp_state")
    fully_shard(root)  # and it can be wrapped afterwards


def _dtensor_parameter() -> str:
    from torch.distributed.tensor import Shard, distribute_tensor

    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weight = distribute_tensor(model.head.weight.detach(), mesh, [Shard(0)])
    model.head.weight = nn.Parameter(weight)
    try:
        fully_shard(model.head)
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize("world_size", [2])
def test_tensor_parallel_parameters_are_refused(pool):
    # a DTensor on the data-parallel ranks themselves (TP on another mesh dim is accepted:
    # tests/fsdp/test_tensor_parallel.py)
    for message in pool.run(_dtensor_parameter):
        assert "'weight' is a DTensor" in message and "shares ranks" in message, message


def test_unsharded_params_report_global_shapes_and_gather():
    model = make_model()
    reference = make_model()
    shard_blocks(model)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert isinstance(p, nn.Parameter) and isinstance(p, RaggedTensor), name
        assert p.shape == q.shape and p.dtype == q.dtype
        assert torch.equal(p.full_tensor(), q.detach())
    with pytest.raises(NotImplementedError, match="full_tensor"):
        model.head.weight @ model.head.weight.T


def _resume(path: str, save: bool, steps: int) -> list[float]:
    """Train 2 steps and checkpoint (model + optimizer), or load that checkpoint; then train
    ``steps`` more and return the losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = shard_blocks(make_model(seed=0 if save else 7))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if save:
        train(model, opt, 2)
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path)
    else:
        train(model, opt, 1)  # create optimizer state to load into
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": opt_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return train(model, opt, steps, start=2)


def test_resumed_training_continues(dist_pool, tmp_path):
    path = str(tmp_path / "resume")
    continued = dist_pool(4).run(_resume, path, True, 2)[0]
    same_world = dist_pool(4).run(_resume, path, False, 2)[0]
    assert same_world == continued  # bitwise
    other_world = dist_pool(3).run(_resume, path, False, 2)[0]
    assert max(abs(a - b) for a, b in zip(other_world, continued, strict=True)) < 1e-5


def _step_inside_backward() -> str:
    model = shard_blocks(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = loss_fn(model, *batch(0, 2))
    loss.register_hook(lambda g: opt.step())  # runs while backward is in progress
    try:
        loss.backward()
    except RuntimeError as err:
        return str(err)
    return "no error"


def _optimizer_in_backward(steps: int, hsdp: bool) -> dict:
    """torch's optimizer-in-backward recipe (one optimizer per parameter, stepped from the
    parameter's post-accumulate-grad hook), beside the usual step after backward."""
    kwargs = {"mesh": init_device_mesh("cpu", (2, 2))} if hsdp else {}
    stepped_in_backward = shard_blocks(make_model(), **kwargs)
    usual = shard_blocks(make_model(), **kwargs)
    per_param = {p: torch.optim.AdamW([p], lr=1e-2) for p in stepped_in_backward.parameters()}
    steps_seen = []

    def step_now(param: torch.Tensor) -> None:
        per_param[param].step()
        per_param[param].zero_grad()
        steps_seen.append(in_backward())

    for param in stepped_in_backward.parameters():
        param.register_post_accumulate_grad_hook(step_now)
    opt = torch.optim.AdamW(usual.parameters(), lr=1e-2)
    for step in range(steps):
        loss_fn(stepped_in_backward, *batch(step % 2, 2)).backward()
        loss_fn(usual, *batch(step % 2, 2)).backward()
        opt.step()
        opt.zero_grad()
    ours, reference = full_params(stepped_in_backward), full_params(usual)
    return {
        "bitwise": all(torch.equal(ours[n], reference[n]) for n in ours),
        "steps_in_backward": sum(steps_seen),
        "grads_left": sum(p.grad is not None for p in stepped_in_backward.parameters()),
    }


@pytest.mark.parametrize(("world_size", "hsdp"), [(2, False), (3, False), (4, True)])
def test_optimizer_in_backward_steps_each_parameter_once_its_gradient_is_reduced(pool, hsdp):
    """FSDP2 runs the sharded parameters' post-accumulate-grad hooks after its reduction (HSDP:
    after the replicas' all-reduce); before, ours never ran them and such an optimizer
    silently never stepped."""
    num_params = len(list(make_model().parameters()))
    for res in pool.run(_optimizer_in_backward, 3, hsdp):
        assert res["bitwise"] and res["grads_left"] == 0, res
        assert res["steps_in_backward"] == 3 * num_params, res


@pytest.mark.parametrize("world_size", [2])
def test_optimizer_step_before_backward_finished_is_refused(pool):
    for message in pool.run(_step_inside_backward):
        assert "before backward finished" in message


def test_mesh_for_another_device_is_refused():
    class FakeMesh:
        device_type = "cuda"

    from raggedfsdp.comm import ShardMesh

    mesh = ShardMesh(None, 0, 1, device_mesh=FakeMesh())
    model = make_model()
    with pytest.raises(ValueError, match="'cuda' DeviceMesh but parameter"):
        fully_shard(model.layers[0], mesh=mesh)
    fully_shard(model.layers[0])  # nothing was changed by the refused call


def _checkpoint_wrapper_parity(steps: int) -> float:
    """torchtitan-style activation checkpointing: the block is wrapped by checkpoint_wrapper
    and fully_shard goes on the wrapper, so recomputation bypasses the FSDP hooks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    reference = make_model()
    ours = make_model()
    ours.layers = nn.ModuleList(checkpoint_wrapper(layer) for layer in ours.layers)
    shard_blocks(ours)
    ref_losses = train(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), steps, sharded=False
    )
    our_losses = train(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2), steps)
    return max(abs(a - b) for a, b in zip(our_losses, ref_losses, strict=True))


@pytest.mark.parametrize("world_size", [2])
def test_checkpoint_wrapper_recomputes_with_unsharded_params(pool):
    assert max(pool.run(_checkpoint_wrapper_parity, 3)) < 2e-5


def _mismatched(kind: str) -> str:
    model = make_model(hidden=40 if dist.get_rank() == 0 or kind != "shape" else 48)
    policy = row_units(2) if dist.get_rank() == 1 and kind == "policy" else None
    # an int makes a subgroup: the other ranks must not be left waiting in its creation
    subgroup = 2 if dist.get_rank() == 0 and kind == "reshard_after_forward" else None
    shard_blocks(model, shard_policy=policy, reshard_after_forward=subgroup)
    try:
        loss_fn(model, *batch(0, 2))
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    ("world_size", "kind"), [(2, "shape"), (2, "policy"), (4, "reshard_after_forward")]
)
def test_ranks_with_different_models_fail_before_the_first_collective(pool, kind):
    for message in pool.run(_mismatched, kind):
        assert "differs across ranks" in message, message
        assert "layers.0" in message or "root" in message


# ----------------------------------------------------------------------------- torchtitan style
def _torchtitan_parity(steps: int) -> dict:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    ours = torchtitan_wrap(make_model(), fully_shard)
    peer = torchtitan_wrap(make_model(), fsdp2_fully_shard)
    our_losses = train(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2), steps, clip=1.0)
    peer_opt = torch.optim.AdamW(peer.parameters(), lr=1e-2)
    for step in range(steps):
        loss_fn(peer, *(my_rows(t) for t in batch(step % 2, ROWS))).backward()
        torch.nn.utils.clip_grad_norm_(peer.parameters(), 1.0)
        peer_opt.step()
        peer_opt.zero_grad()
    group = ours.norm._raggedfsdp_state.group
    assert ours.head._raggedfsdp_state is ours.norm._raggedfsdp_state
    # forward: the [norm, head] group stays gathered for backward, the embedding is freed
    logits = ours(my_rows(batch(0, ROWS)[0]))
    kept, embed_freed = group.is_unsharded, not ours.embed._raggedfsdp_state.group.is_unsharded
    logits.sum().backward()
    ours.zero_grad()
    peer_params = full_params(peer)
    diffs = [
        (p.full_tensor() - peer_params[n]).abs().max().item() for n, p in ours.named_parameters()
    ]
    return {
        "vs_fsdp2": max(diffs),
        "bitwise_fsdp2": all(d == 0 for d in diffs),
        "group_name": group.name,
        "param_names": sorted(group.layout.by_name),
        "kept_after_forward": kept,
        "embedding_freed_after_forward": embed_freed,
        "freed_after_backward": not group.is_unsharded,
        "losses_fall": our_losses[-1] < our_losses[1],
    }


@pytest.mark.parametrize("world_size", [2, 3])
def testtorchtitan_wrapping_with_a_list_group_matches_fsdp2(pool, world_size):
    for res in pool.run(_torchtitan_parity, 4):
        assert res["group_name"] == "[norm, head]"
        assert res["param_names"] == ["0.weight", "1.bias", "1.weight"]
        assert res["kept_after_forward"] and res["embedding_freed_after_forward"]
        assert res["freed_after_backward"] and res["losses_fall"]
        assert res["vs_fsdp2"] < 1e-6, res
        if world_size == 2:
            assert res["bitwise_fsdp2"], res


def test_list_of_modules_bad_input():
    model = make_model()
    with pytest.raises(TypeError, match="non-empty list"):
        fully_shard([])
    with pytest.raises(ValueError, match="same module twice"):
        fully_shard([model.norm, model.norm])
    fully_shard(model.norm)
    with pytest.raises(ValueError, match="RMSNorm is already wrapped"):
        fully_shard([model.head, model.norm])
    assert not hasattr(model.head, "_raggedfsdp_state")  # the refused call changed nothing


def _eval_shows_sharded_parameters(wrapping: str) -> dict:
    model = make_model()
    if wrapping == "torchtitan":
        torchtitan_wrap(model, fully_shard)
    else:
        shard_blocks(model)
    groups = [m._raggedfsdp_state.group for m in model.modules() if hasattr(m, "_raggedfsdp_state")]
    inputs = my_rows(batch(0, ROWS)[0])
    with torch.no_grad():
        model(inputs)
    after_eval = {g.name: g.is_unsharded for g in set(groups) if g is not None}
    all_ragged = all(isinstance(p, RaggedTensor) for p in model.parameters())
    with counting("all_gather_flat", model) as calls, torch.no_grad():
        model(inputs)
    model(inputs).sum().backward()  # training still works after it
    return {
        "kept_after_eval": [name for name, unsharded in after_eval.items() if unsharded],
        "second_eval_gathers": sorted(calls),
        "all_ragged_after_eval": all_ragged,
        "grads": all(p.grad is not None for p in model.parameters()),
    }


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("wrapping", ["blocks", "torchtitan"])
def test_forward_without_grad_shows_sharded_parameters_and_frees_all_but_kept_groups(
    pool, wrapping
):
    """No backward follows a no-grad forward: the root is freed too, and a group created with
    ``reshard_after_forward=False`` (torchtitan's ``[norm, output]``) keeps only its memory, as
    FSDP2 keeps it for evaluation loops, so the next forward skips its all-gather. Outside
    forward, ``model.parameters()`` are the sharded ones either way (state dicts, optimizers)."""
    layers = ["layers.0", "layers.1", "layers.2"]
    # torchtitan's root owns no parameters: everything is in the embedding, blocks, [norm, head]
    kept, others = (
        (["[norm, head]"], ["embed"])
        if wrapping == "torchtitan"
        else ([], ["root (TinyTransformer)", "root (TinyTransformer): embeddings"])
    )
    every = [*layers, *others]
    for res in pool.run(_eval_shows_sharded_parameters, wrapping):
        assert res["kept_after_eval"] == kept, res
        assert res["second_eval_gathers"] == sorted(every), res
        assert res["all_ragged_after_eval"] and res["grads"], res


# ----------------------------------------------------------------------------- torch.compile
def _compiled(whole_model: bool) -> dict:
    """torchtitan compiles each block (``block.compile()``) before wrapping it; others compile
    the wrapped model. FSDP's hooks are kept out of the graphs (``torch._dynamo.disable``), so
    a block compiles to one graph, shared by all blocks, that the parameter swapping between
    sharded and unsharded never invalidates."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    params, graphs = {}, []
    for compiled in (False, True):
        model = make_model()
        for layer in model.layers:
            if compiled and not whole_model:
                layer.compile(backend="aot_eager")
            fully_shard(layer)
        fully_shard(model)
        if compiled and whole_model:
            model.compile(backend="aot_eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            train(model, opt, 1, start=step)
            graphs.append(counters["stats"]["unique_graphs"])
        params[compiled] = full_params(model)
    return {
        "bitwise_eager": all(torch.equal(params[True][n], t) for n, t in params[False].items()),
        "graphs_per_step": graphs[3:],
    }


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("whole_model", [False, True])
def test_compiled_model_trains_bitwise_as_eager_without_recompiling(pool, whole_model):
    for res in pool.run(_compiled, whole_model):
        assert res["bitwise_eager"], res
        graphs = res["graphs_per_step"]
        assert graphs[0] == graphs[-1], res  # nothing recompiles after the first step
        if not whole_model:
            assert graphs == [1, 1, 1], res  # FSDP's hooks stay out of the block's graph
