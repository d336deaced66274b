"""raggedfsdp.optim.AdamW against torch.optim.AdamW, bitwise, in all three modes (single process,
drop-in ZeRO-2, FSDP with RaggedTensor parameters) at world sizes 1-4; state dicts; DCP
resharding from 4 ranks to 3; per-rank state size; bad input."""

from __future__ import annotations

import copy

import pytest
import torch

from raggedfsdp.optim import AdamW
from raggedfsdp.sharding import RaggedShard, RaggedTensor
from tests.support.optim_helpers import (
    assert_resumes_bitwise,
    average,
    continue_in_lockstep,
    counted_params,
    exact_grads,
    init_tensors,
    local_piece,
    mode_params,
    ragged_params,
    rank_world,
    set_ragged_grads,
    train_checkpointed,
)

# Awkward on purpose: sizes that leave padding and empty pieces at W=3 and 4, a scalar-ish tensor
# and one larger matrix.
SHAPES = {"w": (7, 5), "b": (13,), "cube": (3, 4, 5), "one": (1,), "big": (64, 33)}

CONFIGS = [
    {},
    {"amsgrad": True, "maximize": True},
    {"foreach": True, "weight_decay": 0.0},
    {"fused": True},
    {"lr": torch.tensor(0.01)},
]
CONFIG_IDS = ["default", "amsgrad-maximize", "foreach", "fused", "tensor-lr"]


def _groups(params: dict[str, torch.Tensor]) -> list[dict]:
    """Two groups with their own hyper-parameters (torch's usual decay / no-decay split)."""
    names = list(params)
    return [
        {"params": [(n, params[n]) for n in names[:2]], "lr": 0.02, "betas": (0.8, 0.99)},
        {"params": [(n, params[n]) for n in names[2:]], "weight_decay": 0.1},
    ]


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _reference(config: dict) -> tuple[dict[str, torch.nn.Parameter], torch.optim.AdamW]:
    ref = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    return ref, torch.optim.AdamW(_groups(ref), **copy.deepcopy(config))


def _drive(opt, ref_opt, params, ref, set_grads, steps: int = 4) -> None:
    """Steps with a scheduler on both; parameter 'b' gets no gradient at step 2 (skipped)."""
    sched, ref_sched = _schedule(opt), _schedule(ref_opt)
    world = rank_world()[1]
    for step in range(steps):
        grads = exact_grads(SHAPES, step, world)
        for n, q in ref.items():
            q.grad = None if (n == "b" and step == 2) else average(grads[n])
        set_grads(params, grads, skip="b" if step == 2 else None)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def _set_plain_grads(params, grads, skip=None) -> None:
    rank = rank_world()[0]
    for n, p in params.items():
        p.grad = None if n == skip else grads[n][rank].clone()


def _set_full_grads(params, grads, skip=None) -> None:
    set_ragged_grads(
        {n: p for n, p in params.items() if n != skip}, {n: average(g) for n, g in grads.items()}
    )


# ----------------------------------------------------------------------------- single process
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_single_process_equals_torch_bitwise(config):
    params = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    opt = AdamW(_groups(params), **copy.deepcopy(config))
    ref, ref_opt = _reference(config)
    _drive(opt, ref_opt, params, ref, _set_plain_grads)
    for n in SHAPES:
        assert torch.equal(params[n], ref[n]), n
    mine, theirs = opt.state_dict(), ref_opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    for i, state in theirs["state"].items():
        assert mine["state"][i].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(mine["state"][i][key], value), (i, key)


def test_single_process_autograd_and_torch_state_dict_interchange():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    twin = copy.deepcopy(model)
    opt, ref_opt = AdamW(model.parameters(), lr=0.01), torch.optim.AdamW(twin.parameters(), lr=0.01)
    for _ in range(3):
        x = torch.randn(8, 16)
        for m, o in ((model, opt), (twin, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    # torch's state dict loads into ours and ours into torch's, and both continue identically
    opt.load_state_dict(ref_opt.state_dict())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    x = torch.randn(8, 16)
    for m, o in ((model, opt), (twin, ref_opt)):
        m(x).square().mean().backward()
        o.step()
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)
    )


# ----------------------------------------------------------------------------- drop-in, W=1..4
def _dropin_equals_torch(config: dict) -> list[bool]:
    params = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    opt = AdamW(_groups(params), **copy.deepcopy(config))
    ref, ref_opt = _reference(config)
    _drive(opt, ref_opt, params, ref, _set_plain_grads)
    return [torch.equal(params[n], ref[n]) for n in SHAPES]


@pytest.mark.parametrize("config", CONFIGS[:3], ids=CONFIG_IDS[:3])
def test_dropin_equals_torch_bitwise(pool, config):
    for rank, result in enumerate(pool.run(_dropin_equals_torch, config)):
        assert all(result), f"rank {rank}: {dict(zip(SHAPES, result, strict=True))}"


def _group_added_later() -> list[bool]:
    params = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    first, second = _groups(params)
    opt = AdamW([first])
    opt.add_param_group(second)  # planned and fingerprinted on its own, on every rank
    ref, ref_opt = _reference({})
    _drive(opt, ref_opt, params, ref, _set_plain_grads, steps=2)
    return [torch.equal(params[n], ref[n]) for n in SHAPES]


def test_dropin_param_group_added_after_construction(pool):
    for result in pool.run(_group_added_later):
        assert all(result), result


def _dropin_autograd() -> list[bool]:
    """Gradients from backward land in the flat buffer (hooks mark them), including
    accumulation over two backward calls; unused parameters are skipped like torch."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 10), torch.nn.Linear(10, 3), torch.nn.Linear(3, 2)
    )
    ref = copy.deepcopy(model)
    opt, ref_opt = AdamW(model.parameters(), lr=0.05), torch.optim.AdamW(ref.parameters(), lr=0.05)
    weights = [torch.randint(-4, 4, (world, 5, 3)).float() / 4 for _ in range(3)]
    for step in range(3):
        x = torch.randint(-4, 4, (world, 5, 6)).float() / 4
        # the last layer is unused on every rank at step 1 (torch skips it: no weight decay)
        use_last = step != 1
        for r in range(world):
            out = ref[1](ref[0](x[r]))
            loss = (out * weights[step][r]).sum() / world + (ref[2](out).sum() if use_last else 0)
            loss.backward()
        for _ in range(2):  # accumulate half of the local loss twice
            out = model[1](model[0](x[rank]))
            loss = (out * weights[step][rank]).sum() / 2 + (
                model[2](out).sum() * world / 2 if use_last else 0
            )
            loss.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return [
        torch.allclose(a, b, rtol=0, atol=1e-6)
        for a, b in zip(model.parameters(), ref.parameters(), strict=True)
    ]


def test_dropin_with_autograd_accumulates_into_the_flat_buffer(pool):
    for result in pool.run(_dropin_autograd):
        assert all(result), result


# ----------------------------------------------------------------------------- FSDP, W=1..4
def _fsdp_equals_torch(config: dict, planned: bool) -> list[bool]:
    rank, world = rank_world()
    init = init_tensors(SHAPES)
    if planned:
        params, _ = ragged_params(init, AdamW.shard_policy(), world, rank)
    else:  # explicit uneven splits with empty ranks, each piece its own allocation
        counts = {
            n: RaggedShard.from_counts(
                t.shape, t.shape[-1], [t.numel() // t.shape[-1]] + [0] * (world - 1), n
            )
            if i % 2
            else RaggedShard.even(t.shape, world, 1, n)
            for i, (n, t) in enumerate(init.items())
        }
        counts = {
            n: RaggedShard.from_counts(s.shape, s.unit, s.units_per_rank[::-1], n)
            if n == "big"
            else s
            for n, s in counts.items()
        }
        params = counted_params(init, counts, rank)
    opt = AdamW(_groups(params), **copy.deepcopy(config))
    ref, ref_opt = _reference(config)
    _drive(opt, ref_opt, params, ref, _set_full_grads)
    return [torch.equal(*local_piece(params[n], ref[n])) for n in SHAPES]


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_fsdp_equals_torch_bitwise(pool, config):
    for planned in (True, False):
        for rank, result in enumerate(pool.run(_fsdp_equals_torch, config, planned)):
            assert all(result), (
                f"planned={planned} rank {rank}: {dict(zip(SHAPES, result, strict=True))}"
            )


# ----------------------------------------------------------------------------- state dicts
def _clone(sd: dict) -> dict:
    """Deep copy of a state dict (deepcopy cannot copy a RaggedTensor's process group)."""
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()}
    return {"state": state, "param_groups": copy.deepcopy(sd["param_groups"])}


def _round_trip() -> bool:
    world = rank_world()[1]
    params = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    twin = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES, seed=1).items()}
    opt, twin_opt = AdamW(_groups(params), amsgrad=True), AdamW(_groups(twin), amsgrad=True)
    for step in range(2):
        _set_plain_grads(params, exact_grads(SHAPES, step, world))
        opt.step()
    saved = opt.state_dict()
    twin_opt.load_state_dict(_clone(saved))
    again = twin_opt.state_dict()
    same = again["param_groups"] == saved["param_groups"] and all(
        torch.equal(a, b) if not isinstance(a, RaggedTensor) else torch.equal(a.local, b.local)
        for i in saved["state"]
        for a, b in zip(saved["state"][i].values(), again["state"][i].values(), strict=True)
    )
    return same and continue_in_lockstep(opt, twin_opt, params, twin, SHAPES, _set_plain_grads)


def test_state_dict_round_trip_is_exact(pool):
    assert all(pool.run(_round_trip))


def _dcp_run(path: str, mode: str, save: bool) -> dict[str, torch.Tensor]:
    """Train 5 steps saving after 3 (``save``), or load that checkpoint into a model of another
    init and train steps 3-4; returns the final full parameters."""
    init = init_tensors(SHAPES, seed=0 if save else 5)  # the resumed run's is overwritten
    params, gbuf = mode_params(init, AdamW.shard_policy(), mode)
    opt = AdamW(_groups(params), amsgrad=True)
    return train_checkpointed(opt, params, gbuf, SHAPES, path, save)


@pytest.mark.parametrize("mode", ["drop-in", "fsdp"])
def test_dcp_save_at_4_ranks_resumes_bitwise_at_3(dist_pool, tmp_path, mode):
    assert_resumes_bitwise(dist_pool, _dcp_run, str(tmp_path / "ckpt"), mode, names=SHAPES)


# ----------------------------------------------------------------------------- memory
def _state_size(mode: str) -> tuple[int, int, int, int]:
    rank, world = rank_world()
    init = init_tensors(SHAPES)
    if mode == "fsdp":
        params, _ = ragged_params(init, AdamW.shard_policy(), world, rank)
    else:
        params = {n: torch.nn.Parameter(t) for n, t in init.items()}
    opt = AdamW(_groups(params))
    opt.init_state()
    report = opt.state_bytes()
    steps = sum(4 for _ in {id(s["step"]) for s in opt.state.values()})
    return report.state_bytes, steps, report.local_elements, report.global_elements


@pytest.mark.parametrize("mode", ["drop-in", "fsdp"])
def test_fp32_state_is_8_bytes_per_element_over_w(pool, mode):
    results = pool.run(_state_size, mode)
    total = sum(init.numel() for init in init_tensors(SHAPES).values())
    assert sum(local for _, _, local, _ in results) == total
    for state, steps, local, global_ in results:
        assert global_ == total
        assert state - steps == 8 * local  # exp_avg + exp_avg_sq in fp32, this rank's piece only
        # the planner balances pieces: within one aligned unit of the even share
        assert abs(local - total / pool.world_size) <= 4 * len(SHAPES)


# ----------------------------------------------------------------------------- bad input
def test_bad_input_single_process():
    p = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"'w2' .*already in param group 0 \(as 'w'\)"):
        AdamW([{"params": [("w", p)]}, {"params": [("w2", p)]}])
    with pytest.raises(RuntimeError, match="does not support complex parameters"):
        AdamW([torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))])
    with pytest.raises(NotImplementedError, match="differentiable"):
        AdamW([p], differentiable=True)
    opt = AdamW([("emb", p)])
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="'emb' has a sparse gradient"):
        opt.step()
    p.grad = None
    before = p.detach().clone()
    opt.step()  # no gradients: a no-op, no state, no step counted
    assert torch.equal(p, before) and len(opt.state) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"betas": (0.9, torch.tensor(0.99))}, "betas must be either both floats or both Tensors"),
        ({"betas": (torch.tensor(0.9), 0.99)}, "betas must be either both floats or both Tensors"),
        (
            {"betas": (torch.tensor(0.9), torch.tensor(0.99)), "foreach": True},
            r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True",
        ),
        (
            {"lr": torch.tensor(0.01), "foreach": True},
            "lr as a Tensor is not supported for capturable=False and foreach=True",
        ),
    ],
    ids=["float-tensor", "tensor-float", "tensor-betas-foreach", "tensor-lr-foreach"],
)
def test_betas_and_lr_are_refused_at_construction_as_torch_does(kwargs, match):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=match):
        torch.optim.AdamW([p], **kwargs)
    with pytest.raises(ValueError, match=match):
        AdamW([p], **kwargs)
    if "foreach" in kwargs:  # the same tensors are accepted with capturable=True, as by torch
        torch.optim.AdamW([p], **kwargs | {"capturable": True})
        AdamW([p], **kwargs | {"capturable": True})


def test_adam_betas_rule_holds_for_every_adam_type_argument():
    from raggedfsdp.optim import AdamW8bit, Muon

    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="adamw_betas must be either both floats or both"):
        Muon([p], adamw_betas=(0.9, torch.tensor(0.95)))
    with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
        AdamW8bit([p], betas=(torch.tensor(0.9), 0.999))
    with pytest.raises(ValueError, match=r"betas=\(0.9,\): expected two coefficients"):
        AdamW([p], betas=(0.9,))


def _bad_input_distributed() -> list[str]:
    rank, world = rank_world()
    errors = []
    # a parameter only rank 1 has: caught by the fingerprint, naming the first difference
    ps = [torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(3))]
    try:
        AdamW([("a", ps[0]), ("b" if rank == 0 else "c", ps[1])])
    except RuntimeError as e:
        errors.append(str(e))
    try:
        AdamW([("a", ps[0])] + ([("extra", ps[1])] if rank == 1 else []))
    except RuntimeError as e:
        errors.append(str(e))
    # non-contiguous parameter in drop-in mode
    t = torch.nn.Parameter(torch.randn(4, 6).t())
    try:
        AdamW([("t", t)])
    except ValueError as e:
        errors.append(str(e))
    # rebinding p.data after construction would silently detach it from the buffer
    p = torch.nn.Parameter(torch.ones(8))
    opt = AdamW([("p", p)])
    p.grad = torch.ones(8)
    p.data = torch.zeros(8)
    try:
        opt.step()
    except RuntimeError as e:
        errors.append(str(e))
    # stepping twice on gradients the first step already reduced in place
    q = torch.nn.Parameter(torch.ones(8))
    opt = AdamW([("q", q)])
    q.sum().backward()
    opt.step()
    try:
        opt.step()
    except RuntimeError as e:
        errors.append(str(e))
    # FSDP parameter with a gradient split differently (same lengths, other unit)
    spec = RaggedShard.even((6,), world, 1, "r")
    r = torch.nn.Parameter(RaggedTensor(torch.zeros(spec.length(rank)), spec, rank))
    opt = AdamW([("r", r)])
    r.grad = RaggedTensor(
        torch.zeros(spec.length(rank)), RaggedShard.even((6,), world, 3, "r"), rank
    )
    try:
        opt.step()
    except RuntimeError as e:
        errors.append(str(e))
    return errors


@pytest.mark.parametrize("world_size", [2])
def test_bad_input_distributed(pool):
    for errors in pool.run(_bad_input_distributed):
        assert len(errors) == 6, errors
        assert "#1 ('b'" in errors[0] or "#1 ('c'" in errors[0]
        assert "different numbers of optimizer parameters (1 to 2" in errors[1]
        assert "'t' is not contiguous" in errors[2]
        assert "'p' was re-bound" in errors[3]
        assert "'q' is still the one the last step() reduced" in errors[4]
        assert "'r': in FSDP mode the gradient must be a RaggedTensor split like" in errors[5]


def _no_grad_step() -> bool:
    params = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    opt = AdamW(_groups(params))
    before = {n: p.detach().clone() for n, p in params.items()}
    opt.step()
    opt.zero_grad()
    opt.step()
    unchanged = all(torch.equal(p, before[n]) for n, p in params.items())
    return unchanged and all(float(s["step"]) == 0 for s in opt.state.values())


def test_step_without_gradients_is_a_noop(pool):
    assert all(pool.run(_no_grad_step))


def _hsdp(mesh_shape: tuple[int, int]) -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    params = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    opt = AdamW(_groups(params), mesh=mesh)
    ref, ref_opt = _reference({})
    _drive(opt, ref_opt, params, ref, _set_plain_grads, steps=2)
    return [torch.equal(params[n], ref[n]) for n in SHAPES] + [
        opt.state_bytes().local_elements < sum(t.numel() for t in params.values())
    ]


@pytest.mark.parametrize("world_size", [4])
def test_dropin_hsdp_mesh_equals_torch(pool):
    for result in pool.run(_hsdp, (2, 2)):
        assert all(result), result
