"""raggedfsdp.optim.Shampoo: a float64 loop reference, bitwise world-size invariance (drop-in and
FSDP, planned / uneven / empty shards), zero optimizer bytes when blocks are local, owner compute
for layouts that cut blocks, fully_shard, state dicts, DCP resharding, bad input."""

from __future__ import annotations

import copy
import functools
from unittest import mock

import pytest
import torch

from raggedfsdp.optim import AdamW, Shampoo
from raggedfsdp.sharding import RaggedShard, RaggedTensor
from tests.support.blocked_layouts import MODES, layout_options, same_grads, train_on_layout
from tests.support.optim_helpers import (
    assert_resumes_bitwise,
    exact_grads,
    init_tensors,
    mode_params,
    train_checkpointed,
)
from tests.support.shampoo_reference import reference

B = 4  # small blocks: several per matrix, cut edges, a matrix smaller than one block
SHAPES = {
    "w": (10, 6),  # 3 x 2 blocks, edges 2 rows / 2 cols
    "x": (3, 4, 5),  # viewed as 12 x 5 (merged too: 3 dims stay 3)
    "big": (9, 7),
    "bias": (7,),  # 1-D: grafting only, or two vector blocks (4 + 3) with precondition_1d
    "row": (1, 3),  # smaller than a block; merges to a 3-vector
    "conv": (5, 2, 2),  # 10 x 2 unmerged, 5 x 4 merged
    "small": (2, 2),  # merges to one 4-vector block
}
BASE = {"lr": 0.05, "epsilon": 1e-6, "max_preconditioner_dim": B}
#: DistributedShampoo's own layout and defaults where ours differ (no grafting, eps before).
DS_LAYOUT = {"merge_dims": True, "precondition_1d": True}
CONFIGS = {
    "defaults": {},
    "ema-freq2-start3": {
        "betas": (0.8, 0.95),
        "precondition_frequency": 2,
        "start_preconditioning_step": 3,
        "grafting_beta2": 0.9,
        "weight_decay": 0.1,
    },
    "nesterov-l2": {
        "betas": (0.0, 0.99),
        "momentum": 0.5,
        "dampening": 0.1,
        "use_nesterov": True,
        "weight_decay": 0.05,
        "use_decoupled_weight_decay": False,
        "use_bias_correction": False,
        "grafting_beta2": 1.0,
    },
    "momentum": {"momentum": 0.9, "weight_decay": 0.01},
    "no-grafting-eps-before": {
        "grafting": None,
        "epsilon_before_decomposition": True,
        "precondition_frequency": 3,
    },
    "sgd-grafting": {"grafting": "sgd", "momentum": 0.5, "dampening": 0.2},
    "adagrad-grafting": {"grafting": "adagrad", "grafting_epsilon": 1e-3},
    "rmsprop-grafting": {"grafting": "rmsprop", "grafting_beta2": 0.9, "grafting_epsilon": 1e-4},
    "exponent-override": {
        "inverse_exponent_override": {2: {0: 0.0, 1: 0.5}, 1: 0.25},
        "precondition_1d": True,
    },
    "exponent-all-2d": {"inverse_exponent_override": {2: 0.5}},
    "ds-layout": {**DS_LAYOUT, "grafting": None, "epsilon_before_decomposition": True},
    "ds-layout-grafted": {**DS_LAYOUT, "betas": (0.9, 0.999), "grafting": "adam"},
    "vectors": {"precondition_1d": True},
}
#: Configurations the multi-process tests run (every rule that changes which state exists or
#: how blocks are laid out).
SHARDED = ["defaults", "ema-freq2-start3", "vectors", "ds-layout"]


def _grads(steps: int, world: int = 1) -> list[dict[str, torch.Tensor]]:
    return same_grads(SHAPES, steps, world)


def _run_single(config: dict, dtype: torch.dtype, steps: int = 10) -> dict[str, torch.Tensor]:
    init = init_tensors(SHAPES)
    params = {n: torch.nn.Parameter(t.to(dtype)) for n, t in init.items()}
    opt = Shampoo(list(params.items()), **{**BASE, **config})
    for grads in _grads(steps):
        for n, p in params.items():
            p.grad = grads[n].to(dtype)
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("config", list(CONFIGS))
def test_float64_matches_the_loop_reference(config):
    """Every rule, after 10 steps, within 1e-10 relative of a float64 loop written from
    DistributedShampoo's description (tests/support/shampoo_reference.py)."""
    ours = _run_single(CONFIGS[config], torch.float64)
    ref = reference(init_tensors(SHAPES), _grads(10), {**BASE, **CONFIGS[config]})
    for n in SHAPES:
        assert _relative(ours[n], ref[n]) <= 1e-10, (n, _relative(ours[n], ref[n]))


@pytest.mark.parametrize("config", ["defaults", "ema-freq2-start3", "nesterov-l2", "ds-layout"])
def test_float32_matches_the_loop_reference(config):
    ours = _run_single(CONFIGS[config], torch.float32, steps=5)
    ref = reference(init_tensors(SHAPES), _grads(5), {**BASE, **CONFIGS[config]})
    for n in SHAPES:
        torch.testing.assert_close(ours[n].double(), ref[n], rtol=1e-4, atol=1e-4, msg=n)


def test_newton_roots_match_eigh_roots_in_float64():
    """Coupled Newton (tolerance 1e-6 on max|M - I|) against the eigh reference with epsilon
    added first, as Newton adds it: the parameters agree to the iteration's tolerance."""
    config = {"root_method": "newton", "epsilon": 1e-3, "precondition_1d": True}
    ours = _run_single(config, torch.float64)
    ref = reference(init_tensors(SHAPES), _grads(10), {**BASE, **config})
    for n in SHAPES:
        assert _relative(ours[n], ref[n]) <= 1e-5, (n, _relative(ours[n], ref[n]))


def test_dampened_nesterov_is_distributed_shampoo_s():
    """``m = μ·m + (1-δ)·d`` then ``(1-δ)·d + μ·m``: not torch SGD's ``d + μ·m`` (issue 21)."""
    from raggedfsdp.optim.shampoo import add_momentum_

    d, m = torch.tensor([2.0]), torch.tensor([1.0])
    out = add_momentum_(d, m, momentum=0.5, dampening=0.25, nesterov=True)
    assert m.item() == 0.5 * 1.0 + 0.75 * 2.0
    assert out.item() == 0.75 * 2.0 + 0.5 * m.item()


def test_roots_at_the_start_step_then_at_multiples_and_never_before():
    """freq 2, start 3: roots at t = 3 (the start), 4 and 6; none at t = 1, 2 (issue 19: no
    eigendecomposition before the start step) nor at t = 5."""
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = Shampoo([p], precondition_frequency=2, start_preconditioning_step=3)
    counts = []
    for step in range(6):
        p.grad = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        opt.step()
        counts.append(opt.last_step_stats["eigendecompositions"])
    assert counts == [0, 0, 2, 2, 0, 2]


def test_the_defaults_and_their_sources():
    p = torch.nn.Parameter(torch.zeros(3, 3))
    g = Shampoo([p]).param_groups[0]
    assert (g["lr"], g["betas"], g["epsilon"]) == (1e-2, (0.9, 1.0), 1e-12)
    assert (g["max_preconditioner_dim"], g["precondition_frequency"]) == (1024, 1)
    assert g["start_preconditioning_step"] == 1  # -1 means precondition_frequency
    assert (g["momentum"], g["weight_decay"], g["use_decoupled_weight_decay"]) == (0, 0, True)
    assert (g["grafting"], g["grafting_beta2"], g["grafting_epsilon"]) == ("adam", 0.99, 1e-10)
    assert (g["root_method"], g["epsilon_before_decomposition"]) == ("eigh", False)
    assert g["inverse_exponent_override"] == {}
    opt = Shampoo([p])
    assert (opt.merge_dims, opt.precondition_1d, opt.batch_roots) == (False, False, None)


# ----------------------------------------------------------------------------- batched roots
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_eigendecompositions_equal_per_block_ones_bitwise(dtype):
    """Equal-size roots share one batched eigh where slots are 64-byte aligned; every root is
    bitwise the per-block path's, so batching cannot change results (or W-invariance)."""
    from raggedfsdp.optim.matrix_roots import RootJob, batchable, inverse_roots_

    gen = torch.Generator().manual_seed(0)
    sizes = [4, 4, 4, 8, 8, 5, 5, 16, 16, 16, 12, 12]
    factors = []
    for n in sizes:
        x = torch.randn(n, n + 2, generator=gen, dtype=dtype)
        factors.append(x @ x.T)
    roots = {}
    for batched in (True, False):
        stats = dict.fromkeys(
            ("eigendecompositions", "eigh_cost", "eigh_batched", "fp64_retries", "root_failures"), 0
        )
        outs = [torch.zeros_like(f) for f in factors]
        jobs = [RootJob(f, o, 0.25) for f, o in zip(factors, outs, strict=True)]
        inverse_roots_(jobs, 1e-6, False, "eigh", stats, batched)
        roots[batched] = (outs, stats)
    for a, b in zip(roots[True][0], roots[False][0], strict=True):
        assert torch.equal(a, b)
    expected = sum(1 for n in sizes if batchable(n, dtype) and sizes.count(n) > 1)
    assert roots[True][1]["eigh_batched"] == expected > 0
    assert roots[False][1]["eigh_batched"] == 0


# Blocks of 32: equal 32x32 blocks within and across matrices, 32x16 blocks (a batch of their
# own), 8-row edge blocks (not 64-byte sides: one by one) and vectors (one by one).
BATCH_SHAPES = {"a": (64, 96), "b": (64, 96), "c": (40, 32), "d": (64, 48), "v": (40,)}


def _batched_run(config: dict, dtype: torch.dtype, batch: bool, threads: int) -> dict:
    params = {n: torch.nn.Parameter(t.to(dtype)) for n, t in init_tensors(BATCH_SHAPES).items()}
    opt = Shampoo(list(params.items()), **{**BASE, **config, "max_preconditioner_dim": 32},
                  batch_blocks=batch)  # fmt: skip
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(5):
            for n, g in exact_grads(BATCH_SHAPES, step, 1).items():
                params[n].grad = g[0].to(dtype)
            opt.step()
    finally:
        torch.set_num_threads(before)
    out = {n: p.detach().clone() for n, p in params.items()}
    for n, p in params.items():
        out |= {f"{n}.{k}": v.clone() for k, v in opt.state[p].items()}
    return out | {"stats": opt.last_step_stats}


@pytest.mark.parametrize(
    ("config", "dtype", "threads"),
    [
        ("defaults", torch.float32, 1),
        ("ema-freq2-start3", torch.float32, 2),
        ("exponent-override", torch.float64, 1),
        ("no-grafting-eps-before", torch.float32, 2),
    ],
)
def test_batched_block_products_equal_per_block_ones_bitwise(config, dtype, threads):
    """``batch_blocks=True`` (one ``bmm`` per product and group of equal-size blocks, one
    norm per group): parameters, every state tensor and the step's counts bitwise those of the
    per-block path, on one and two threads (``raggedfsdp.optim.block_batches``)."""
    per_block = _batched_run(CONFIGS[config], dtype, False, threads)
    with mock.patch.object(torch, "bmm", wraps=torch.bmm) as bmm:
        batched = _batched_run(CONFIGS[config], dtype, True, threads)
    shapes = {tuple(call.args[0].shape) for call in bmm.call_args_list}
    assert {(15, 32, 32), (2, 32, 16)} <= shapes, shapes  # 32x32 blocks of a, b, c, d; 32x16
    assert batched.keys() == per_block.keys()
    for key, value in per_block.items():
        if key == "stats":
            assert batched[key] == value
        else:
            assert torch.equal(batched[key], value), key


def test_newton_roots_are_within_1e_5_of_eigh_roots_in_fp32():
    """Coupled Newton on well-conditioned fp32 blocks (condition number 10): within 1e-5
    (relative, max-norm) of eigh's roots, and its iteration count is reported."""
    from raggedfsdp.optim.matrix_roots import RootJob, inverse_roots_

    gen = torch.Generator().manual_seed(1)
    stats = {}
    for n in (8, 32, 64):
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        a = ((q * torch.linspace(1, 10, n, dtype=torch.float64)) @ q.T).float()
        outs = {}
        for method in ("eigh", "newton"):
            stats[method] = dict.fromkeys(
                (
                    "eigendecompositions",
                    "eigh_cost",
                    "eigh_batched",
                    "fp64_retries",
                    "root_failures",
                    "newton_roots",
                    "newton_iterations",
                    "newton_fallbacks",
                ),
                0,
            )
            outs[method] = torch.zeros_like(a)
            inverse_roots_([RootJob(a, outs[method], 0.25)], 1e-6, True, method, stats[method])
        err = (outs["newton"] - outs["eigh"]).abs().max() / outs["eigh"].abs().max()
        assert err <= 1e-5, (n, float(err))
        assert stats["newton"]["newton_fallbacks"] == 0
        assert 0 < stats["newton"]["newton_iterations"] <= 100


# ----------------------------------------------------------------------------- world sizes
def _train(mode: str, config: dict, steps: int = 4) -> tuple[dict, list[dict]]:
    """Full parameters and states after ``steps`` steps (identical gradients on every rank) and
    the per-step stats."""
    return train_on_layout(Shampoo, B, SHAPES, BASE, mode, config, steps)


@functools.cache
def _single(config: str) -> tuple[dict, list[dict]]:
    """One process's run of ``CONFIGS[config]``: the reference of every mode and world size,
    computed once (the tests only read it)."""
    return _train("single", CONFIGS[config])


WORLD_CASES = [
    *((mode, config) for config in ("defaults", "ema-freq2-start3") for mode in MODES),
    *((mode, "ds-layout") for mode in ("planned", "uneven", "drop-in")),  # merged blocks
    ("cut", "vectors"),  # vector blocks cut by the layout: computed by their owners
]


@pytest.mark.parametrize(("mode", "config"), WORLD_CASES)
def test_every_world_size_equals_one_process_bitwise(pool, mode, config):
    """Parameters and every state tensor bitwise equal to one process at W = 1..4, the work
    spread (eigendecompositions, blocks) and no optimizer byte moved unless a layout cuts
    blocks (batched eigendecompositions on: which blocks share a rank cannot matter)."""
    expected, single_stats = _single(config)
    results = pool.run(_train, mode, CONFIGS[config])
    for rank, (result, _) in enumerate(results):
        assert result.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(result[key], value), (rank, key)
    for step, single in enumerate(single_stats):
        per_rank = [stats[step] for _, stats in results]
        for key in ("eigendecompositions", "blocks", "eigh_cost"):  # the work is spread
            assert sum(s[key] for s in per_rank) == single[key], key
        moved = sum(s["bytes_communicated"] for s in per_rank)
        if mode == "cut" and pool.world_size > 1:
            assert moved > 0 and sum(s["owner_slabs"] for s in per_rank) > 0
        else:
            assert moved == 0  # blocks are local: no optimizer communication at all


# ----------------------------------------------------------------------------- fully_shard
def _fully_shard_train() -> list[tuple[str, bool, bool, int]]:
    from raggedfsdp.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 10), torch.nn.GELU(), torch.nn.Linear(10, 6), torch.nn.Linear(6, 3)
    )
    reference_model = copy.deepcopy(model)
    policy = Shampoo.shard_policy(B)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, shard_policy=policy)
    fully_shard(model, shard_policy=policy)
    opt = Shampoo(model.parameters(), **BASE)
    ref_opt = Shampoo(reference_model.parameters(), **BASE)
    moved = 0
    for step in range(3):
        x = torch.randn(16, 12, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (reference_model, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        moved += opt.last_step_stats["bytes_communicated"]
    return [
        (n, isinstance(p, RaggedTensor), torch.equal(p.full_tensor(), q.detach()), moved)
        for (n, p), q in zip(model.named_parameters(), reference_model.parameters(), strict=True)
    ]


@pytest.mark.parametrize("world_size", [2])
def test_fully_shard_training_equals_one_process_bitwise(pool):
    for rank, result in enumerate(pool.run(_fully_shard_train)):
        for name, ragged, equal, moved in result:
            assert ragged and equal and moved == 0, (rank, name)


# ----------------------------------------------------------------------------- checkpoints
def test_state_dict_round_trip_single_process():
    init = init_tensors(SHAPES)
    config = {**BASE, **CONFIGS["momentum"]}
    a = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    b = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt_a, opt_b = Shampoo(list(a.values()), **config), Shampoo(list(b.values()), **config)
    grads = _grads(5)
    for step, g in enumerate(grads):
        if step == 2:
            for n in SHAPES:
                b[n].data.copy_(a[n])
            opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
        for params, opt in ((a, opt_a), (b, opt_b)) if step >= 2 else ((a, opt_a),):
            for n, p in params.items():
                p.grad = g[n].clone()
            opt.step()
    for n in SHAPES:
        assert torch.equal(a[n], b[n]), n
    keys = set(opt_a.state_dict()["state"][0])
    assert keys == {
        "step",
        "filtered_grad",
        "grafting_v",
        "momentum",
        "factor_L",
        "factor_R",
        "inv_root_L",
        "inv_root_R",
    }


def _dcp(path: str, mode: str, config: str, save: bool) -> dict[str, torch.Tensor]:
    """Save after 2 steps then run 2 more (save=True), or load and run the last 2."""
    init = init_tensors(SHAPES, seed=0 if save else 3)
    options = {**BASE, **CONFIGS[config], "momentum": 0.5}
    params, gbuf = mode_params(init, Shampoo.shard_policy(B, **layout_options(options)), mode)
    opt = Shampoo(list(params.items()), **options)
    return train_checkpointed(opt, params, gbuf, SHAPES, path, save, steps=4, at=2)


@pytest.mark.parametrize(
    ("mode", "config"), [("fsdp", "defaults"), ("drop-in", "defaults"), ("fsdp", "ds-layout")]
)
def test_dcp_save_at_4_ranks_resumes_bitwise_at_3(dist_pool, tmp_path, mode, config):
    path = str(tmp_path / "ckpt")
    assert_resumes_bitwise(dist_pool, _dcp, path, mode, config, names=SHAPES)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_preconditioner_dim": 0}, "max_preconditioner_dim"),
        ({"max_preconditioner_dim": 2.5}, "max_preconditioner_dim"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": -1e-6}, "epsilon"),
        ({"precondition_frequency": 4, "start_preconditioning_step": 2}, "start_precondition"),
        ({"precondition_frequency": 0}, "precondition_frequency"),
        ({"betas": (1.0, 1.0)}, "index 0"),
        ({"betas": (0.9, 0.0)}, "index 1"),
        ({"lr": -1.0}, "learning rate"),
        ({"momentum": 1.0}, "momentum"),
        ({"grafting_epsilon": 0.0}, "grafting_epsilon"),
        ({"precondition_frequency": -2}, "precondition_frequency"),
        ({"root_method": "eigen"}, "root_method"),
        ({"grafting": "lamb"}, "grafting"),
        ({"inverse_exponent_override": {2: -0.5}}, "inverse_exponent_override"),
        ({"inverse_exponent_override": {2: {2: 0.5}}}, "dims must be"),
        ({"inverse_exponent_override": {2: 0.3}, "root_method": "newton"}, "integer r"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Shampoo([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)


def test_bad_parameters_are_rejected():
    with pytest.raises(RuntimeError, match="does not support complex parameters"):
        Shampoo([torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="max_preconditioner_dim"):
        Shampoo.shard_policy(0)
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="decides the shard layout"):
        Shampoo([{"params": [p], "max_preconditioner_dim": 8}], max_preconditioner_dim=4)


def test_merge_dims_refuses_a_layout_that_cuts_merged_blocks():
    """A 2 x 2 weight merges to one 4-vector block; a (hand-made) split of it over two ranks
    cuts that block: refused, naming the parameter and the fix (rank 1 of a W=2 layout built
    without a process group)."""
    spec = RaggedShard.from_counts((2, 2), 1, [3, 1], "small")
    p = torch.nn.Parameter(RaggedTensor(torch.zeros(1), spec, 1))
    with pytest.raises(ValueError, match=r"'small'.*merged blocks.*shard_policy"):
        Shampoo([("small", p)], merge_dims=True, precondition_1d=True)
    Shampoo([("small", p)], precondition_1d=True)  # unmerged 2 x 2 blocks: owner compute


def test_failing_eigendecomposition_retries_in_fp64_then_keeps_the_old_roots(monkeypatch):
    eigh = torch.linalg.eigh
    calls = {"fail": "fp32"}

    def flaky(a: torch.Tensor):
        if calls["fail"] == "all" or (calls["fail"] == "fp32" and a.dtype == torch.float32):
            raise torch.linalg.LinAlgError("simulated eigh failure")
        return eigh(a)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    init = init_tensors(SHAPES)
    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt = Shampoo(list(params.values()), **BASE)
    opt.init_state()
    for step, grads in enumerate(_grads(3)):
        calls["fail"] = "fp32" if step < 2 else "all"
        roots = {n: opt.state[p]["inv_root_L"].clone() for n, p in params.items() if p.dim() > 1}
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
        stats = opt.last_step_stats
        if step < 2:  # the fp64 retry succeeds
            assert stats["fp64_retries"] == stats["eigendecompositions"] > 0
            assert stats["root_failures"] == 0
        else:  # fails too: counted, previous roots kept, parameters finite
            assert stats["root_failures"] == stats["eigendecompositions"] > 0
            for n, p in params.items():
                if p.dim() > 1:
                    assert torch.equal(opt.state[p]["inv_root_L"], roots[n]), n
    assert all(torch.isfinite(p).all() for p in params.values())
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    ref = _run_single({}, torch.float32, steps=2)  # fp64 roots cast back: close to fp32 ones
    fresh = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt = Shampoo(list(fresh.values()), **BASE)
    for grads in _grads(2):
        for n, p in fresh.items():
            p.grad = grads[n].clone()
        opt.step()
    for n in SHAPES:
        torch.testing.assert_close(fresh[n].detach(), ref[n])


def test_non_finite_gradients_never_reach_the_roots():
    p = torch.nn.Parameter(torch.ones(4, 4))
    opt = Shampoo([p], **BASE)
    p.grad = torch.full((4, 4), 0.5)
    opt.step()
    roots = opt.state[p]["inv_root_L"].clone()
    p.grad = torch.full((4, 4), float("inf"))
    opt.step()
    assert opt.last_step_stats["root_failures"] == 2
    assert torch.equal(opt.state[p]["inv_root_L"], roots)


def _ill_conditioned_regression(steps: int, make_optimizer) -> float:
    """Least squares with inputs of condition number 100: where Shampoo's preconditioning pays."""
    g = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    inputs = torch.randn(512, 64, generator=g) @ (basis * torch.logspace(0, -2, 64)) @ basis.T
    targets = inputs @ torch.randn(64, 32, generator=g) + 0.01 * torch.randn(512, 32, generator=g)
    torch.manual_seed(1)
    model = torch.nn.Linear(64, 32, bias=False)
    opt = make_optimizer(model.parameters())
    for _ in range(steps):
        ((model(inputs) - targets) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return ((model(inputs) - targets) ** 2).mean().item()


def test_shampoo_reaches_a_lower_loss_than_adamw_at_equal_steps():
    """Shampoo with its documented defaults (lr 1e-2) against AdamW at the same lr and no weight
    decay, 100 steps: measured 0.359 vs 0.508 (and 0.015 vs 0.087 at lr 3e-2)."""
    shampoo = _ill_conditioned_regression(100, lambda p: Shampoo(p))
    adamw = _ill_conditioned_regression(100, lambda p: AdamW(p, lr=1e-2, weight_decay=0.0))
    assert shampoo < 0.8 * adamw, (shampoo, adamw)
