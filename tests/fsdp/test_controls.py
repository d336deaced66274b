"""FSDP2's run-time controls on fully_shard-ed modules: explicit prefetch lists, skipping the
backward all-gather, keeping parameters after backward, resharding to a subgroup after forward,
HSDP accumulation without the all-reduce, a custom gradient divide factor, extra forward methods
and async unshard handles. Each is checked against FSDP2 (same settings) or a one-process
reference, and by counting the collectives it is meant to save."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from raggedfsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from raggedfsdp.sharding import RaggedTensor
from tests.support.fsdp_training import (
    ROWS,
    counting,
    full_params,
    my_rows,
    shard_blocks,
    torchtitan_wrap,
)
from tests.support.tiny_models import batch, loss_fn, make_model


def _rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = batch(step, ROWS)
    return my_rows(inputs), my_rows(targets)


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


# ----------------------------------------------------------------------------- prefetch lists
def _set_two_ahead(model: nn.Module) -> None:
    """FSDP2's example: each block prefetches the next two in forward, previous two in backward."""
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - 2) : i][::-1])


def _explicit_prefetch(steps: int) -> dict:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from raggedfsdp.fsdp.param_group import ParamGroup

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ours = shard_blocks(make_model(layers=4), mesh=mesh)
    peer = shard_blocks(make_model(layers=4), wrap=fsdp2_fully_shard, mesh=mesh)
    for model in (ours, peer):
        _set_two_ahead(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, peer)]
    started, unshard = [], ParamGroup.unshard

    def recording(group: ParamGroup, async_op: bool = False) -> None:
        if group._gather is None and not group.is_unsharded:
            started.append(group.name)
        unshard(group, async_op=async_op)

    for step in range(steps):
        for model, opt in zip((ours, peer), opts, strict=True):
            ParamGroup.unshard = recording if (model is ours and step == steps - 1) else unshard
            try:
                loss_fn(model, *_rows(step % 2)).backward()
            finally:
                ParamGroup.unshard = unshard
            opt.step()
            opt.zero_grad()
    ours_params, peer_params = full_params(ours), full_params(peer)
    return {
        "gathers_started": started,
        "vs_fsdp2": _max_abs_diff(ours_params, peer_params),
        "bitwise_fsdp2": all(torch.equal(ours_params[n], peer_params[n]) for n in peer_params),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_explicit_prefetch_lists_gather_in_the_order_asked_and_match_fsdp2(pool, world_size):
    for res in pool.run(_explicit_prefetch, 3):
        # forward: the root (its embedding a group of its own) prefetches layers.0 (default);
        # layers.0 asks for 1 and 2 together, layers.1 for 2 (started already) and 3;
        # backward: the root kept from forward (FSDP2's schedule) prefetches layers.3 beside
        # the head's backward (default), then layers.3 asks for 2 and 1
        assert res["gathers_started"] == [
            "root (TinyTransformer)",
            "root (TinyTransformer): embeddings",
            "layers.0",
            "layers.1",
            "layers.2",
            "layers.3",
            "layers.3",
            "layers.2",
            "layers.1",
            "layers.0",
        ], res
        assert res["vs_fsdp2"] < 1e-6, res
        if world_size == 2:
            assert res["bitwise_fsdp2"], res


def test_prefetch_lists_must_name_wrapped_modules():
    model = shard_blocks(make_model())
    with pytest.raises(ValueError, match=r"set_modules_to_forward_prefetch\(modules=...\): Linear"):
        model.layers[0].set_modules_to_forward_prefetch([model.layers[1].w1])
    with pytest.raises(ValueError, match="set_modules_to_backward_prefetch"):
        model.layers[1].set_modules_to_backward_prefetch([model.layers[0], model.head])
    assert model.layers[1]._raggedfsdp_state.backward_prefetch is None  # nothing was set


# ----------------------------------------------------------------------------- root resharding
def _root_resharded_after_forward(steps: int) -> dict:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    models = []
    for wrap in (fully_shard, fsdp2_fully_shard):
        model = make_model()
        for layer in model.layers:
            wrap(layer, mesh=mesh)
        models.append(wrap(model, mesh=mesh, reshard_after_forward=True))  # FSDP2: root too
    ours, peer = models
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    root = ours._raggedfsdp_state.group
    for step in range(steps):
        for model, opt in zip(models, opts, strict=True):
            with counting("all_gather_flat", ours) as calls:
                loss = loss_fn(model, *_rows(step % 2))
                freed_after_forward = not root.is_unsharded
                loss.backward()
            if model is ours:
                root_gathers, freed = calls["root (TinyTransformer)"], freed_after_forward
            opt.step()
            opt.zero_grad()
    ours_params, peer_params = full_params(ours), full_params(peer)
    return {
        "root_freed_after_forward": freed,
        "root_gathers_per_step": root_gathers,
        "vs_fsdp2": _max_abs_diff(ours_params, peer_params),
        "bitwise_fsdp2": all(torch.equal(ours_params[n], peer_params[n]) for n in peer_params),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_root_resharded_after_forward_when_asked_as_fsdp2(pool, world_size):
    """FSDP2's default keeps the root gathered for backward; an explicit ``True`` frees it during
    the loss's backward and gathers it again (the peak there is the loss's gradient)."""
    for res in pool.run(_root_resharded_after_forward, 3):
        assert res["root_freed_after_forward"] and res["root_gathers_per_step"] == 2, res
        assert res["vs_fsdp2"] < 1e-6, res
        if world_size == 2:
            assert res["bitwise_fsdp2"], res


# ------------------------------------------------------------------------ reshard to a subgroup
def _resharded_to_subgroup(steps: int, mixed: bool, checkpoint: bool) -> dict:
    """Blocks wrapped with ``reshard_after_forward=2`` at W=4, beside ours with ``True`` and
    FSDP2 with ``2``: the same training; after forward each block keeps its rank's half of the
    gathered buffer, and backward gathers over 2 ranks from it."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = []
    for wrap, after_forward in ((fully_shard, 2), (fully_shard, True), (fsdp2_fully_shard, 2)):
        model = make_model()
        model.checkpoint = checkpoint
        kwargs = {"mesh": mesh, "mp_policy": policy} if mixed else {"mesh": mesh}
        for layer in model.layers:
            wrap(layer, reshard_after_forward=after_forward, **kwargs)
        models.append(wrap(model, **kwargs))
    ours = models[0]
    block = ours.layers[1]._raggedfsdp_state.group
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(steps):
        for model, opt in zip(models, opts, strict=True):
            with counting("all_gather_flat", ours, by_size=True) as calls:
                loss = loss_fn(model, *_rows(step % 2))
                if model is ours:  # the chunk kept: this rank's half of the gathered buffer
                    kept = block._post_forward[1].clone()
                    freed = not block.compute.is_full_allocated
                loss.backward()
            if model is ours:
                gathers = dict(calls)
                chunk = kept.numel()
                # the full buffer, gathered over all ranks: the chunk is its slice
                shard = block.master.shard.to(block.compute.dtype)
                segments = [torch.empty_like(shard) for _ in range(4)]
                dist.all_gather(segments, shard)
                full = torch.cat(segments)
                j = dist.get_rank() % 2
                chunk_is_slice = torch.equal(kept, full[j * chunk : (j + 1) * chunk])
            opt.step()
            opt.zero_grad()
    with torch.no_grad():  # no backward follows: nothing is kept
        loss_fn(ours, *_rows(0))
    params = [full_params(m) for m in models]
    return {
        "chunk_fraction": chunk / block.layout.buffer_numel,
        "freed": freed,
        "chunk_is_slice": chunk_is_slice,
        "gathers": gathers,
        "kept_without_grad": block._post_forward is not None,
        "bitwise_true": all(torch.equal(params[0][n], params[1][n]) for n in params[0]),
        "vs_fsdp2": _max_abs_diff(params[0], params[2]),
    }


@pytest.mark.parametrize("world_size", [4])
@pytest.mark.parametrize(("mixed", "checkpoint"), [(False, False), (True, True)])
def test_reshard_after_forward_int_gathers_backward_over_the_subgroup(pool, mixed, checkpoint):
    for res in pool.run(_resharded_to_subgroup, 2, mixed, checkpoint):
        assert res["freed"] and res["chunk_fraction"] == 0.5 and res["chunk_is_slice"], res
        assert not res["kept_without_grad"], res
        for i in range(3):  # each block: forward over 4 ranks, backward over 2
            assert res["gathers"][(f"layers.{i}", 4)] == 1, res
            assert res["gathers"][(f"layers.{i}", 2)] == 1, res
        assert res["bitwise_true"], res
        assert res["vs_fsdp2"] < 2e-5, res


def _reshard_after_forward_bad_input() -> dict:
    errors = {}
    for value in (3, 0, "2", 2.0):
        model = make_model()
        before = {n: p.clone() for n, p in model.named_parameters()}
        try:
            fully_shard(model.layers[0], reshard_after_forward=value)
        except (TypeError, ValueError) as e:
            errors[repr(value)] = f"{type(e).__name__}: {e}"
        untouched = not hasattr(model.layers[0], "_raggedfsdp_state") and all(
            torch.equal(p, before[n]) for n, p in model.named_parameters()
        )
        errors[f"{value!r} untouched"] = untouched
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard(model.layers[0], reshard_after_forward=1)
    errors["1"] = model.layers[0]._raggedfsdp_state.reshard_after_forward
    errors["1 warns"] = any("reshard_after_forward=1" in str(w.message) for w in caught)
    errors["4"] = fully_shard(model.layers[1], reshard_after_forward=4)._raggedfsdp_state
    errors["4"] = errors["4"].reshard_after_forward
    try:
        model.layers[0].set_reshard_after_forward(2)
    except TypeError as e:
        errors["set"] = str(e)
    return errors


@pytest.mark.parametrize("world_size", [4])
def test_reshard_after_forward_int_bad_input(pool):
    for res in pool.run(_reshard_after_forward_bad_input):  # every rank refuses alike
        assert "one of [1, 2, 4]" in res["3"] and "one of [1, 2, 4]" in res["0"], res
        assert res["'2'"].startswith("TypeError") and "reshard_after_forward" in res["2.0"], res
        assert all(v for k, v in res.items() if k.endswith("untouched")), res
        assert res["1"] is False and res["1 warns"] and res["4"] is True, res
        assert "fully_shard(..., reshard_after_forward=<int>)" in res["set"], res


# ----------------------------------------------------------------------------- unshard in backward
def _embedding_not_gathered_in_backward(steps: int) -> dict:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    names = ("ours", "peer", "default", "forced")
    ours, peer, default, forced = (
        torchtitan_wrap(make_model(), wrap)
        for wrap in (fully_shard, fsdp2_fully_shard, fully_shard, fully_shard)
    )
    ours.embed.set_unshard_in_backward(False)
    peer.embed.set_unshard_in_backward(False)
    forced.embed.set_unshard_in_backward(True)  # FSDP2's default
    models = (ours, peer, default, forced)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    gathers = {}
    for step in range(steps):
        for name, model, opt in zip(names, models, opts, strict=True):
            with counting("all_gather_flat", model) as calls:
                loss_fn(model, *_rows(step % 2)).backward()
            gathers[name] = dict(calls)
            opt.step()
            opt.zero_grad()
    params = {name: full_params(m) for name, m in zip(names, models, strict=True)}
    return {
        "embed_gathers": {name: gathers[name]["embed"] for name in ("ours", "default", "forced")},
        "bitwise": all(
            torch.equal(params["ours"][n], params[other][n])
            for other in ("default", "forced")
            for n in params["ours"]
        ),
        "vs_fsdp2": _max_abs_diff(params["ours"], params["peer"]),
    }


def _needed_in_backward_fails_loudly_and_recovers() -> dict:
    model, fresh = shard_blocks(make_model()), shard_blocks(make_model())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, fresh)]
    model.layers[1].set_unshard_in_backward(False)  # wrong: its matmuls need the weights
    result = {}
    for what, action in (
        ("backward", lambda: loss_fn(model, *_rows(0)).backward()),
        ("step", opts[0].step),  # the aborted backward left incomplete gradients
    ):
        try:
            action()
            result[what] = "no error"
        except RuntimeError as err:
            result[what] = str(err)
    model.layers[1].set_unshard_in_backward(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = loss_fn(model, *_rows(0))  # the next forward discards the aborted backward
    result["warned"] = any("partial gradients are discarded" in str(w.message) for w in caught)
    loss.backward()
    loss_fn(fresh, *_rows(0)).backward()
    for opt in opts:
        opt.step()
    result["recovered_bitwise"] = all(
        torch.equal(a, b)
        for a, b in zip(full_params(model).values(), full_params(fresh).values(), strict=True)
    )
    return result


@pytest.mark.parametrize("world_size", [2, 3])
def test_unshard_in_backward_false_skips_the_embedding_gather(pool, world_size):
    """Asked, or by default for an embedding's group; ``True`` gathers it as FSDP2 does."""
    for res in pool.run(_embedding_not_gathered_in_backward, 3):
        assert res["embed_gathers"] == {"ours": 1, "default": 1, "forced": 2}, res
        assert res["bitwise"], res  # the embedding's backward never read its weight
        assert res["vs_fsdp2"] < 1e-6, res


def test_only_plain_embedding_groups_skip_the_backward_gather_by_default():
    class Scaled(nn.Embedding):  # its own forward: it might read the weight in backward
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return super().forward(tokens) * self.weight.norm()

    plain = fully_shard(nn.Embedding(8, 4))
    scaled = fully_shard(Scaled(8, 4))
    mixed = fully_shard(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4)))
    assert not plain._raggedfsdp_state.unshard_in_backward
    assert scaled._raggedfsdp_state.unshard_in_backward
    assert mixed._raggedfsdp_state.unshard_in_backward


@pytest.mark.parametrize("world_size", [2])
def test_unshard_in_backward_false_where_backward_needs_the_weights_fails_loudly(pool):
    """Freed storage, never stale values; then the optimizer refuses the incomplete gradients
    and the next forward recovers (FSDP2 needs ``reset_iter_state()`` for that)."""
    for res in pool.run(_needed_in_backward_fails_loudly_and_recovers):
        assert "storage of size 0" in res["backward"], res
        assert "raised before it finished reducing gradients" in res["step"], res
        assert res["warned"] and res["recovered_bitwise"], res


# ----------------------------------------------------------------------------- reshard after bwd
def _kept_after_backward() -> dict:
    """Two micro-batches without sync and with the parameters kept, then a synced one: the
    kept forwards need no all-gather; an optimizer step makes the kept copies stale, so the
    next forward gathers again and sees the updated parameters."""
    kept, plain = shard_blocks(make_model()), shard_blocks(make_model())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (kept, plain)]
    inputs, targets = _rows(0)
    half = inputs.shape[0] // 2
    micro = [(inputs[:half], targets[:half]), (inputs[half:], targets[half:])]
    gathers_per_microbatch = []
    for model in (kept, plain):
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            model.set_requires_gradient_sync(last)
            if model is kept:  # FSDP2's accumulation recipe: keep everything until the last
                model.set_reshard_after_forward(False)
                model.set_reshard_after_backward(last)
            with counting("all_gather_flat") as calls:
                (loss_fn(model, x, y) / len(micro)).backward()
            if model is kept:
                gathers_per_microbatch.append(sum(calls.values()))
            if model is kept and i == 0:
                sharded_between = all(isinstance(p, RaggedTensor) for p in model.parameters())
    bitwise_grads = all(
        torch.equal(a, b)
        for a, b in zip(_full_grads(kept).values(), _full_grads(plain).values(), strict=True)
    )
    # stale kept parameters: keep after this backward, step, then forward must re-gather
    kept.set_reshard_after_forward(True)
    kept.set_reshard_after_backward(False)
    loss_fn(kept, *_rows(1)).backward()
    loss_fn(plain, *_rows(1)).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        after_step = kept(inputs), plain(inputs)
    return {
        "gathers_per_microbatch": gathers_per_microbatch,
        "sharded_between_backward_and_forward": sharded_between,
        "bitwise_grads": bitwise_grads,
        "forward_after_step_bitwise": torch.equal(*after_step),
        "all_freed_after_eval": all(
            not m._raggedfsdp_state.group.is_unsharded for m in [*kept.layers, kept]
        ),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_reshard_after_backward_false_saves_the_next_gather_and_never_goes_stale(pool, world_size):
    for res in pool.run(_kept_after_backward):
        # micro-batch 1: one gather per group (3 blocks, the root's and its embedding's);
        # micro-batch 2: none
        assert res["gathers_per_microbatch"] == [5, 0], res
        assert res["sharded_between_backward_and_forward"], res
        assert res["bitwise_grads"], res
        assert res["forward_after_step_bitwise"], res
        assert res["all_freed_after_eval"], res


# ----------------------------------------------------------------------------- HSDP all-reduce
def _hsdp_accumulation() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    partial, synced = shard_blocks(make_model(), mesh=mesh), shard_blocks(make_model(), mesh=mesh)
    inputs, targets = _rows(0)
    half = inputs.shape[0] // 2
    micro = [(inputs[:half], targets[:half]), (inputs[half:], targets[half:])]
    all_reduces = []
    for i, (x, y) in enumerate(micro):
        partial.set_requires_all_reduce(i == len(micro) - 1)
        with counting("all_reduce_flat") as calls:
            (loss_fn(partial, x, y) / 2).backward()
        all_reduces.append(sum(calls.values()))
        if i == 0:
            no_grads_yet = all(p.grad is None for p in partial.parameters())
        (loss_fn(synced, x, y) / 2).backward()
    return {
        "all_reduces": all_reduces,
        "no_grads_before_the_all_reduce": no_grads_yet,
        "vs_synced": _max_abs_diff(_full_grads(partial), _full_grads(synced)),
    }


@pytest.mark.parametrize("world_size", [4])
def test_hsdp_accumulation_with_one_all_reduce(pool):
    for res in pool.run(_hsdp_accumulation):
        # one per group (3 blocks, the root's and its embedding's), on the last micro-batch only
        assert res["all_reduces"] == [0, 5], res
        assert res["no_grads_before_the_all_reduce"], res
        assert res["vs_synced"] < 1e-6, res


# ----------------------------------------------------------------------------- divide factor
def _divide_factor(mesh_shape: tuple[int, ...]) -> dict:
    mesh = init_device_mesh("cpu", mesh_shape)
    summed, averaged = shard_blocks(make_model(), mesh=mesh), shard_blocks(make_model(), mesh=mesh)
    for m in [*summed.layers, summed]:
        m.set_gradient_divide_factor(1.0)
    reference = make_model()
    for model in (summed, averaged):
        loss_fn(model, *_rows(0)).backward()
    loss_fn(reference, *batch(0, ROWS)).backward()
    world = dist.get_world_size()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    return {
        "summed_vs_world_times_reference": _max_abs_diff(
            _full_grads(summed), {n: world * g for n, g in ref_grads.items()}
        ),
        "averaged_vs_reference": _max_abs_diff(_full_grads(averaged), ref_grads),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gradient_divide_factor_one_sums_the_ranks_gradients(pool, world_size):
    shapes = [(world_size,)] + ([(2, 2)] if world_size == 4 else [])  # and HSDP
    for shape in shapes:
        for res in pool.run(_divide_factor, shape):
            assert res["summed_vs_world_times_reference"] < 1e-5 * world_size, (shape, res)
            assert res["averaged_vs_reference"] < 1e-5, (shape, res)


def test_gradient_divide_factor_bad_input():
    model = shard_blocks(make_model())
    for bad in (0, -2.0, "4", True, float("nan")):
        with pytest.raises(ValueError, match=r"set_gradient_divide_factor\(factor="):
            model.set_gradient_divide_factor(bad)
    assert model._raggedfsdp_state.group.gradient_divide_factor is None


# ----------------------------------------------------------------------------- forward methods
class _WithScore(nn.Module):
    """A model with a second entry point that uses the root's own parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model()
        self.scale = nn.Parameter(torch.tensor([0.5, 2.0]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens) * self.scale[0]

    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens).logsumexp(-1) * self.scale[1]


def _forward_method() -> dict:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    from torch.distributed.fsdp import register_fsdp_forward_method as fsdp2_register

    results = {}
    for name, wrap, register in (
        ("ours", fully_shard, register_fsdp_forward_method),
        ("fsdp2", fsdp2_fully_shard, fsdp2_register),
    ):
        torch.manual_seed(0)
        model = _WithScore()
        shard_blocks(model.inner, wrap=wrap)
        wrap(model)
        register(model, "score")
        scores = model.score(_rows(0)[0])
        scores.sum().backward()
        results[name] = (scores.detach(), _full_grads(model), model)
    register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not wrapped: left alone
    try:
        register_fsdp_forward_method(results["ours"][2], "no_such_method")
        refused = False
    except ValueError:
        refused = True
    return {
        "scores_bitwise": torch.equal(results["ours"][0], results["fsdp2"][0]),
        "grads_vs_fsdp2": _max_abs_diff(results["ours"][1], results["fsdp2"][1]),
        "unknown_method_refused": refused,
    }


@pytest.mark.parametrize("world_size", [2])
def test_register_fsdp_forward_method_matches_fsdp2(pool):
    for res in pool.run(_forward_method):
        assert res["scores_bitwise"] and res["unknown_method_refused"], res
        assert res["grads_vs_fsdp2"] < 1e-6, res


# ----------------------------------------------------------------------------- unshard handle
def _async_unshard_handle() -> dict:
    model = shard_blocks(make_model())
    layer = model.layers[0]
    expected = full_params(layer)
    handle = layer.unshard(async_op=True)
    handle.wait()
    unsharded = dict(layer.named_parameters())
    result = {
        "unsharded_values": all(torch.equal(unsharded[n], t) for n, t in expected.items()),
        "plain_tensors": not any(isinstance(p, RaggedTensor) for p in unsharded.values()),
        "sync_returns_none": model.layers[1].unshard() is None,
    }
    sharded = list(model.layers[0]._raggedfsdp_state.group.params)
    with torch.no_grad():  # change the sharded parameters while the unsharded ones are kept
        for mp in sharded:
            mp.sharded.mul_(2)
    layer.unshard()  # must gather again, not hand out the kept (now stale) values
    result["regathered_after_change"] = all(
        torch.equal(p, 2 * expected[n]) for n, p in layer.named_parameters()
    )
    layer.reshard()
    model.layers[1].reshard()
    result["resharded"] = all(isinstance(p, RaggedTensor) for p in model.parameters())
    return result


@pytest.mark.parametrize("world_size", [3])
def test_unshard_async_returns_a_handle(pool):
    for res in pool.run(_async_unshard_handle):
        assert all(res.values()), res
