"""raggedfsdp.optim.Muon against torch.optim.Muon (and torch.optim.AdamW for the aux groups),
bitwise, in all three modes at world sizes 1-4; batched Newton–Schulz bitwise equal to the
per-matrix chain; AdamW groups stepping while the owner exchange is in flight; owner compute
statistics and balance; fp32 NS against a float64 reference; state dicts and DCP resharding;
bad input."""

from __future__ import annotations

import copy
import math
from unittest import mock

import pytest
import torch

from raggedfsdp.optim import Muon, split_muon_params
from raggedfsdp.optim import muon as muon_module
from raggedfsdp.optim.muon import MuonShardPolicy, muon_update, newton_schulz
from raggedfsdp.optim.owner_compute import ExchangePlan
from raggedfsdp.sharding import RaggedShard
from tests.support.optim_helpers import (
    assert_resumes_bitwise,
    average,
    continue_in_lockstep,
    counted_params,
    exact_grads,
    init_tensors,
    local_piece,
    ragged_params,
    rank_world,
    set_ragged_grads,
    train_checkpointed,
)

# Matrices tall, wide and square, a stacked expert tensor, and aux (AdamW) tensors.
SHAPES = {
    "wide": (7, 12),
    "tall": (24, 5),
    "experts": (3, 6, 4),
    "square": (16, 16),
    "bias": (13,),
    "embed": (10, 6),
}
MUON = ("wide", "tall", "experts", "square")
AUX = ("bias", "embed")
MATRICES = ["wide", "tall", "experts[0]", "experts[1]", "experts[2]", "square"]
HYPER = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
AUX_HYPER = {"lr": 0.01, "weight_decay": 0.05}
CONFIGS = [{}, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"}]


def _groups(params: dict) -> list[dict]:
    return [
        {"params": [(n, params[n]) for n in MUON]},
        {"params": [(n, params[n]) for n in AUX], "use_muon": False, **AUX_HYPER},
    ]


class _Reference:
    """torch.optim.Muon per matrix (each expert its own 2-D parameter) + torch.optim.AdamW."""

    def __init__(self, config: dict, seed: int = 0) -> None:
        full = init_tensors(SHAPES, seed)
        self.params = {n: t.clone() for n, t in full.items()}
        self.mats = {
            n: [torch.nn.Parameter(m.clone()) for m in (t if t.dim() == 3 else [t])]
            for n, t in full.items()
            if n in MUON
        }
        self.aux = {n: torch.nn.Parameter(full[n].clone()) for n in AUX}
        mats = [q for n in MUON for q in self.mats[n]]
        self.muon = torch.optim.Muon(mats, **HYPER, **config)
        self.adamw = torch.optim.AdamW(list(self.aux.values()), betas=(0.9, 0.95), **AUX_HYPER)

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        for n in MUON:
            g = grads[n] if grads[n].dim() == 3 else [grads[n]]
            for q, gq in zip(self.mats[n], g, strict=True):
                q.grad = gq.clone()
        for n in AUX:
            self.aux[n].grad = grads[n].clone()
        self.muon.step()
        self.adamw.step()

    def full(self) -> dict[str, torch.Tensor]:
        out = {
            n: torch.stack([q.detach() for q in qs]).reshape(SHAPES[n])
            for n, qs in self.mats.items()
        }
        return out | {n: q.detach() for n, q in self.aux.items()}


def _drive(opt, params, set_grads, config, steps: int = 3, ns_dtype=None) -> _Reference:
    world = rank_world()[1]
    ref = _Reference(config)
    for step in range(steps):
        grads = exact_grads(SHAPES, step, world)
        ref.step({n: average(g) for n, g in grads.items()})
        set_grads(params, grads)
        opt.step()
    return ref


def _set_plain(params, grads) -> None:
    rank = rank_world()[0]
    for n, p in params.items():
        p.grad = grads[n][rank].clone()


def _set_ragged(params, grads) -> None:
    set_ragged_grads(params, {n: average(g) for n, g in grads.items()})


def _summary(opt: Muon) -> dict:
    s = opt.last_step_stats
    return {k: s[k] for k in ("ns_run", "bytes_sent", "matrices", "matrices_local")}


# ----------------------------------------------------------------------------- single process
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "no-nesterov-match-rms"])
def test_single_process_equals_torch_bitwise(config):
    params = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    opt = Muon(_groups(params), **HYPER, **config)
    ref = _drive(opt, params, _set_plain, config)
    for n, t in ref.full().items():
        assert torch.equal(params[n].detach(), t), n
    assert opt.last_step_stats["matrices_local"] == len(MATRICES)
    assert sorted(opt.last_step_stats["ns_run"]) == sorted(MATRICES)


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "no-nesterov-match-rms"])
def test_muon_update_of_one_matrix_equals_torch_bitwise(config):
    """``muon_update``, the one-matrix step the optimizer's pieces compose, is torch's Muon."""
    options = {"nesterov": True, "adjust_lr_fn": None} | config
    for shape in SHAPES["wide"], SHAPES["tall"]:
        ours = init_tensors({"w": shape})["w"]
        theirs = torch.nn.Parameter(ours.clone())
        reference = torch.optim.Muon([theirs], **HYPER, **config)
        buf = torch.zeros_like(ours)
        for step in range(3):
            grad = exact_grads({"w": shape}, step, 1)["w"][0]
            theirs.grad = grad.clone()
            reference.step()
            muon_update(ours, grad, buf, **HYPER, **options)
        assert torch.equal(ours, theirs.detach()), shape
        assert torch.equal(buf, reference.state[theirs]["momentum_buffer"]), shape


def test_fp32_newton_schulz_matches_float64_reference():
    gen = torch.Generator().manual_seed(0)
    coeffs = (3.4445, -4.7750, 2.0315)
    for shape in [(32, 48), (48, 32), (64, 64)]:
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        want = newton_schulz(g.clone(), coeffs, 5, 1e-7)
        got = newton_schulz(g.float(), coeffs, 5, 1e-7)
        assert (got.double() - want).abs().max() < 1e-6 * max(1.0, want.abs().max().item())


# ----------------------------------------------------------------------------- batched NS
NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(6, 48, 32), (5, 32, 48), (12, 17, 17), (3, 512, 96)])
def test_batched_newton_schulz_equals_per_matrix_bitwise(dtype, shape):
    """On CPU the batched chain (a norm per matrix, bmm / baddbmm) gives each matrix the bits
    of its own chain (norm, mm / addmm) once the smaller side exceeds BATCH_MIN_SIDE: tall,
    wide and square, in the NS dtypes that batch (BATCHED_DTYPES)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        stack = torch.randn(shape, generator=gen).to(dtype)
        want = torch.stack([newton_schulz(m.clone(), *NS) for m in stack])
        assert torch.equal(newton_schulz(stack.clone(), *NS), want)


def test_batched_newton_schulz_of_small_matrices_differs_by_its_measured_bound():
    """At or below BATCH_MIN_SIDE a bf16 batch and one matrix go through different GEMMs that
    round near-ties differently, which is why Muon keeps such matrices one chain each. Measured
    on 13,600 matrices from 8 x 12 to 16 x 64 (docs/optimizers.md): 0.37 % of them differ, by at
    most 3 * 2**-8 (0.0117); here 2 of 600, by 0.0049."""
    gen = torch.Generator().manual_seed(0)
    differing, total, worst = 0, 0, 0.0
    for _ in range(50):
        stack = torch.randn(12, 24, 16, generator=gen).bfloat16()
        want = torch.stack([newton_schulz(m.clone(), *NS) for m in stack])
        diff = (newton_schulz(stack.clone(), *NS).float() - want.float()).abs()
        differing += int(diff.flatten(1).amax(1).gt(0).sum())
        total += len(stack)
        worst = max(worst, diff.max().item())
    assert differing / total <= 0.004 and worst <= 3 * 2.0**-8


def test_stacked_experts_run_in_place_without_a_stacking_copy():
    """The experts of one stacked parameter lie back to back in its NS input, so a batch is a
    view of it (no ``torch.stack`` copy, one copy back): the per-matrix chain's bits."""
    init = init_tensors({"experts": (8, 32, 48)})
    out = {}
    for batched in (True, False):
        p = torch.nn.Parameter(init["experts"].clone())
        opt = Muon([p], **HYPER, batched_ns=batched)
        with mock.patch.object(torch, "stack", wraps=torch.stack) as stack:
            for step in range(2):
                p.grad = exact_grads({"experts": (8, 32, 48)}, step, 1)["experts"][0]
                opt.step()
        assert opt.last_step_stats["ns_calls"] == (1 if batched else 8)
        assert stack.call_count == 0
        out[batched] = p.detach()
    assert torch.equal(out[True], out[False])


# Repeated shapes: 6 experts per layer, the same projection in two layers, small experts (one
# chain each: a side <= BATCH_MIN_SIDE), an AdamW head and norm.
MOE_SHAPES = {"l0.experts": (6, 40, 24), "l1.experts": (6, 40, 24), "l0.wq": (24, 24)}
MOE_SHAPES |= {"l1.wq": (24, 24), "l0.small": (3, 16, 8), "head": (40, 24), "l0.norm": (24,)}


def _moe(batched: bool, layout: str) -> tuple[dict[str, torch.Tensor], int]:
    """Parameters after 3 steps at this rank's W, and this rank's number of NS chains."""
    rank, world = rank_world()
    init = init_tensors(MOE_SHAPES)
    policy = Muon.shard_policy(whole_matrices=layout == "whole")
    params, _ = ragged_params(init, policy, world, rank)
    muon = [(n, p) for n, p in params.items() if len(p.shape) > 1 and n != "head"]
    other = [(n, p) for n, p in params.items() if (n, p) not in muon]
    groups = [{"params": muon}, {"params": other, "use_muon": False}]
    opt = Muon(groups, **HYPER, batched_ns=batched)
    calls = 0
    for step in range(3):
        grads = exact_grads(MOE_SHAPES, step, world)
        set_ragged_grads(params, {n: average(g) for n, g in grads.items()})
        opt.step()
        calls += opt.last_step_stats["ns_calls"]
    return {n: p.full_tensor() for n, p in params.items()}, calls


@pytest.mark.parametrize("layout", ["whole", "elements"])
def test_batched_ns_optimizer_equals_per_matrix_bitwise(pool, layout):
    """Whole matrices (each owner batches what it holds) and split ones (batches assembled
    from the exchange): the same bits as one chain per matrix, in fewer chains."""
    batched = pool.run(_moe, True, layout)
    single = pool.run(_moe, False, layout)
    for (got, calls), (want, chains) in zip(batched, single, strict=True):
        assert all(torch.equal(got[n], want[n]) for n in MOE_SHAPES)
        assert calls <= chains
    assert sum(c for _, c in single) == 3 * 17  # 12 + 3 experts, 2 wq: one chain each
    if pool.world_size == 1:
        assert batched[0][1] == 3 * 5  # experts (40, 24), wq (24, 24), and 3 small ones


def _order_of_events() -> list[str]:
    """Instrument one step at W=2 with every matrix split: when does AdamW run?"""
    rank, world = rank_world()
    init = init_tensors(SHAPES)
    params, _ = ragged_params(init, Muon.shard_policy(whole_matrices=False), world, rank)
    opt = Muon(_groups(params), **HYPER)
    set_ragged_grads(params, {n: average(g) for n, g in exact_grads(SHAPES, 0, world).items()})
    events: list[str] = []
    start, adamw = ExchangePlan.start_to_owners, muon_module.adamw_update

    def started(*args, **kwargs):
        finish = start(*args, **kwargs)
        events.append("exchange started")
        return lambda: events.append("exchange waited") or finish()

    def adamw_step(*args, **kwargs):
        events.append("adamw")
        return adamw(*args, **kwargs)

    with (
        mock.patch.object(ExchangePlan, "start_to_owners", started),
        mock.patch.object(muon_module, "adamw_update", adamw_step),
    ):
        opt.step()
    return events


@pytest.mark.parametrize("world_size", [2])
def test_adamw_groups_step_while_the_exchange_is_in_flight(pool):
    for events in pool.run(_order_of_events):
        assert events == ["exchange started", "adamw", "exchange waited"], events


# ----------------------------------------------------------------------------- drop-in, W=1..4
def _dropin(config: dict, whole) -> tuple[list[bool], dict]:
    params = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    opt = Muon(_groups(params), **HYPER, **config, whole_matrices=whole)
    ref = _drive(opt, params, _set_plain, config)
    return [torch.equal(params[n].detach(), t) for n, t in ref.full().items()], _summary(opt)


def _check_owners(results: list[tuple[list[bool], dict]]) -> None:
    for rank, (equal, _) in enumerate(results):
        assert all(equal), (rank, dict(zip(SHAPES, equal, strict=True)))
    run = [m for _, stats in results for m in stats["ns_run"]]
    assert sorted(run) == sorted(MATRICES), "each matrix's NS runs on exactly one rank"


@pytest.mark.parametrize("whole", [False, "auto"])
def test_dropin_equals_torch_bitwise(pool, whole):
    for config in CONFIGS:
        results = pool.run(_dropin, config, whole)
        _check_owners(results)
        if len(results) > 1 and whole is False:
            assert any(stats["bytes_sent"] for _, stats in results)


# ----------------------------------------------------------------------------- FSDP, W=1..4
def _fsdp(layout: str, ns_dtype=torch.bfloat16) -> tuple[list[bool], dict]:
    rank, world = rank_world()
    init = init_tensors(SHAPES)
    if layout == "uneven":  # everything on the last rank but 'wide' (element-wise, cut)
        counts = {
            n: RaggedShard.even(t.shape, world, 1, n)
            if n == "wide"
            else RaggedShard.from_counts(t.shape, 1, [0] * (world - 1) + [t.numel()], n)
            for n, t in init.items()
        }
        counts["square"] = RaggedShard.from_counts(  # rows 0-2 on rank 0, the rest on the last
            (16, 16), 16, [3] + [0] * (world - 2) + [13] if world > 1 else [16], "square"
        )
        params = counted_params(init, counts, rank)
    else:
        policy = Muon.shard_policy(whole_matrices=layout == "whole")
        params, _ = ragged_params(init, policy, world, rank)
    opt = Muon(_groups(params), **HYPER, ns_dtype=ns_dtype)
    ref = _drive(opt, params, _set_ragged, {})
    if ns_dtype == torch.float32:  # vs float64 NS: the reference is only the bf16 one; see below
        return [], _summary(opt) | {"params": {n: p.full_tensor() for n, p in params.items()}}
    full = ref.full()
    return [torch.equal(*local_piece(params[n], full[n])) for n in SHAPES], _summary(opt)


@pytest.mark.parametrize("layout", ["elements", "whole", "uneven"])
def test_fsdp_equals_torch_bitwise(pool, layout):
    results = pool.run(_fsdp, layout)
    _check_owners(results)
    if layout == "whole":
        assert all(stats["bytes_sent"] == 0 for _, stats in results)
        # a figure over all ranks, from the plan: every rank reports it
        assert [stats["matrices_local"] for _, stats in results] == [len(MATRICES)] * len(results)


def _float64_reference(world: int, steps: int = 3) -> dict[str, torch.Tensor]:
    """Muon with float64 NS, written out: the accuracy oracle for the fp32-NS path."""
    full = {n: t.double() for n, t in init_tensors(SHAPES).items() if n in MUON}
    bufs = {n: torch.zeros_like(t) for n, t in full.items()}
    coeffs, mu, lr, wd = (3.4445, -4.7750, 2.0315), HYPER["momentum"], HYPER["lr"], 0.1
    for step in range(steps):
        grads = exact_grads(SHAPES, step, world)
        for n, p in full.items():
            g = average(grads[n]).double()
            bufs[n].lerp_(g, 1 - mu)
            upd = g.lerp(bufs[n], mu)
            mats = upd if upd.dim() == 3 else upd[None]
            o = torch.stack([newton_schulz(m.clone(), coeffs, 5, 1e-7) for m in mats])
            m, k = p.shape[-2:]
            p.mul_(1 - lr * wd).add_(o.reshape(p.shape), alpha=-lr * math.sqrt(max(1, m / k)))
    return full


def test_fp32_ns_path_matches_float64_reference(dist_pool):
    want = _float64_reference(3)
    for rank, (_, summary) in enumerate(dist_pool(3).run(_fsdp, "elements", torch.float32)):
        for n, t in want.items():
            assert (summary["params"][n].double() - t).abs().max() < 1e-6, (rank, n)


# ----------------------------------------------------------------------------- fully_shard
def _fully_shard_train() -> tuple[list[bool], dict]:
    from raggedfsdp.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 32),
        torch.nn.Linear(32, 96),
        torch.nn.GELU(),
        torch.nn.Linear(96, 32),
        torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 7),
    )
    reference = copy.deepcopy(model)
    policy = Muon.shard_policy(whole_matrices="auto")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, shard_policy=policy)
    fully_shard(model, shard_policy=policy)
    opt = Muon(split_muon_params(model, lr=0.01), lr=0.02)
    groups = split_muon_params(reference)
    ref_muon = torch.optim.Muon([p for _, p in groups[0]["params"]], lr=0.02)
    ref_adamw = torch.optim.AdamW(
        [p for _, p in groups[1]["params"]], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1
    )
    for step in range(3):
        x = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(step))
        for m, opts in ((model, [opt]), (reference, [ref_muon, ref_adamw])):
            m(x).square().mean().backward()
            for o in opts:
                o.step()
                o.zero_grad()
    equal = [
        torch.equal(p.full_tensor(), q.detach())
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    ]
    return equal, _summary(opt)


@pytest.mark.parametrize("world_size", [2, 4])  # W identical gradients average exactly
def test_fully_shard_training_equals_one_process_bitwise(pool):
    results = pool.run(_fully_shard_train)
    for rank, (equal, _) in enumerate(results):
        assert all(equal), (rank, equal)
    assert sorted(m for _, s in results for m in s["ns_run"]) == [
        "1.weight",
        "3.weight",
        "5.weight",
    ]


def test_split_muon_params():
    model = torch.nn.Sequential(
        torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    )
    model.lm_head = torch.nn.Linear(4, 5, bias=False)
    muon, aux = split_muon_params(model, lr=3e-4)
    assert [n for n, _ in muon["params"]] == ["1.weight"] and muon["use_muon"]
    assert [n for n, _ in aux["params"]] == [
        "0.weight",
        "1.bias",
        "2.weight",
        "2.bias",
        "lm_head.weight",
    ]
    assert aux["use_muon"] is False and aux["lr"] == 3e-4


# ----------------------------------------------------------------------------- balance
def _transformer_balance() -> tuple[float, float, int]:
    rank, world = rank_world()
    d, layers = 64, 4
    shapes = {}
    for i in range(layers):
        shapes |= {f"{i}.{k}": (d, d) for k in ("q", "k", "v", "o")}
        shapes |= {f"{i}.up": (4 * d, d), f"{i}.gate": (4 * d, d), f"{i}.down": (d, 4 * d)}
    init = init_tensors(shapes)
    params, _ = ragged_params(init, Muon.shard_policy(whole_matrices=False), world, rank)
    opt = Muon(list(params.items()), lr=0.02)
    set_ragged_grads(params, {n: average(g) for n, g in exact_grads(shapes, 0, world).items()})
    opt.step()
    s = opt.last_step_stats
    return s["ns_flops_max"], s["ns_flops_mean"], len(s["ns_run"])


def test_ns_cost_is_balanced_for_a_transformer_at_w4(dist_pool):
    results = dist_pool(4).run(_transformer_balance)
    # max and mean over ranks come from the plan each rank computes: all must agree
    assert len({(peak, mean) for peak, mean, _ in results}) == 1, results
    for peak, mean, _ in results:
        assert peak <= 1.3 * mean, (peak, mean)
    assert sum(r[2] for r in results) == 4 * 7


def test_auto_policy_keeps_matrices_whole_without_extra_padding():
    tensors = [("a", (64, 64), torch.float32), ("b", (64, 64), torch.float32), ("c", (7,), None)]
    units = MuonShardPolicy("auto").units_for_group(tensors, 2)
    assert units == {"a": 4096, "b": 4096, "c": 1}
    assert MuonShardPolicy(False).units_for_group(tensors, 2)["a"] == 1


# ----------------------------------------------------------------------------- state dicts
def _round_trip() -> bool:
    world = rank_world()[1]
    params = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    twin = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES, seed=1).items()}
    opt, twin_opt = Muon(_groups(params), **HYPER), Muon(_groups(twin), **HYPER)
    for step in range(2):
        _set_plain(params, exact_grads(SHAPES, step, world))
        opt.step()
    saved = opt.state_dict()
    twin_opt.load_state_dict(saved)
    return continue_in_lockstep(opt, twin_opt, params, twin, SHAPES, _set_plain)


def test_state_dict_round_trip_is_exact(pool):
    assert all(pool.run(_round_trip))


def _dcp(path: str, save: bool) -> dict[str, torch.Tensor]:
    """save: train 3 steps, save, train 2 more; else load and train the same 2 steps."""
    rank, world = rank_world()
    init = init_tensors(SHAPES, seed=0 if save else 5)
    params, gbuf = ragged_params(init, Muon.shard_policy(whole_matrices=False), world, rank)
    opt = Muon(_groups(params), **HYPER)
    return train_checkpointed(opt, params, gbuf, SHAPES, path, save)


def test_dcp_save_at_4_ranks_resumes_bitwise_at_3(dist_pool, tmp_path):
    assert_resumes_bitwise(dist_pool, _dcp, str(tmp_path / "ckpt"), names=SHAPES)


# ----------------------------------------------------------------------------- bad input
def test_bad_input():
    vec, cube = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, 2, 2, 2))
    with pytest.raises(ValueError, match=r"'bias'.*shape \(4,\)"):
        Muon([("bias", vec)])
    with pytest.raises(ValueError, match=r"'conv'.*\(2, 2, 2, 2\)"):
        Muon([("conv", cube)])
    with pytest.raises(ValueError, match="adjust_lr_fn='bogus'"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], adjust_lr_fn="bogus")
    Muon([{"params": [vec, cube], "use_muon": False}])  # fine in an AdamW group


def test_a_complex_parameter_raises_torchs_runtime_error():
    """torch's Muon raises RuntimeError("Muon does not support complex parameters") at the first
    step; ours at construction, the same type and words (a user's ``except RuntimeError``
    catches both), naming the parameter and the fix."""
    z = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.complex64))
    with pytest.raises(RuntimeError, match=r"'z'.*Muon does not support complex.*view_as_real"):
        Muon([("z", z)])


def test_non_finite_gradient_poisons_only_its_matrix():
    """Documented behaviour (as torch): NaN in a matrix's gradient makes that matrix NaN."""
    params = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    ref = _Reference({})
    opt = Muon(_groups(params), **HYPER)
    grads = {n: g[0] for n, g in exact_grads(SHAPES, 0, 1).items()}
    grads["wide"][0, 0] = float("nan")
    _set_plain(params, {n: g[None] for n, g in grads.items()})
    ref.step(grads)
    opt.step()
    assert params["wide"].isnan().all()
    for n, t in ref.full().items():
        if n != "wide":
            assert torch.equal(params[n].detach(), t), n
