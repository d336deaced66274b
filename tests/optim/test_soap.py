"""raggedfsdp.optim.SOAP: a float64 loop of the paper's algorithm and the authors' options
(normalize_grads, unpreconditioned large dims, one factor per dim, shampoo_beta = β₂), bitwise
world-size invariance (drop-in, FSDP planned / uneven / cut layouts, fully_shard), zero optimizer
bytes when blocks are local, owner compute for layouts that cut blocks, state dicts, DCP
resharding, bad input."""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch

from raggedfsdp.optim import SOAP
from raggedfsdp.optim.soap_blocks import SoapBlocks
from raggedfsdp.sharding import RaggedShard, RaggedTensor
from raggedfsdp.sharding.units import merge_small_dims
from tests.support.blocked_layouts import same_grads, train_on_layout
from tests.support.optim_helpers import (
    assert_resumes_bitwise,
    init_tensors,
    mode_params,
    train_checkpointed,
)
from tests.support.soap_reference import authors_merge, reference

B = 4  # several blocks per matrix, cut edges, a matrix smaller than one block
SHAPES = {
    "w": (10, 6),
    "x": (3, 4, 5),
    "bias": (7,),  # plain Adam, or two vector blocks with precondition_1d
    "row": (1, 3),
    "conv": (5, 2, 2),  # 10 x 2, or 5 x 4 merged
    "kernel": (2, 5, 3, 6),  # per_dim: 2 x 1 x 2 blocks per slab at B = 4
}
BASE = {"lr": 0.01, "max_preconditioner_dim": B}
CONFIGS = {
    "defaults": {},
    "freq2": {"precondition_frequency": 2, "betas": (0.9, 0.99), "shampoo_beta": 0.9},
    "no-bias-correction": {"correct_bias": False, "weight_decay": 0.0, "precondition_frequency": 3},
    "vectors": {"precondition_1d": True, "precondition_frequency": 2},
    "merged": {"merge_dims": True, "precondition_1d": True, "precondition_frequency": 2},
    # the authors' options, one at a time, then together
    "normalized": {"normalize_grads": True, "precondition_frequency": 2},
    "shampoo-beta-is-beta2": {"betas": (0.9, 0.99), "precondition_frequency": 2},
    "skip": {
        "large_dims": "skip",
        "max_preconditioner_dim": 6,  # w: R only; bias (7): plain Adam; x, conv, kernel: R only
        "precondition_1d": True,
        "precondition_frequency": 2,
    },
    "per-dim": {"tensor_factors": "per_dim", "precondition_frequency": 2},  # blocked N-D
    "per-dim-merged": {
        "tensor_factors": "per_dim",
        "merge_dims": True,  # the authors' merge_dims=True; row (1, 3) -> a factored (3,)
        "large_dims": "skip",
        "max_preconditioner_dim": 6,
        "precondition_frequency": 2,
    },
    "authors": {
        "tensor_factors": "per_dim",
        "large_dims": "skip",
        "normalize_grads": True,
        "precondition_1d": True,
        "max_preconditioner_dim": 6,
        "precondition_frequency": 3,
        "betas": (0.9, 0.99),  # shampoo_beta unset: 0.99
        "shampoo_beta": -1,
    },
}
#: Configurations whose every parameter's update is divided by its RMS.
NORMALIZING = {name for name, config in CONFIGS.items() if config.get("normalize_grads")}


def _grads(steps: int, world: int = 1) -> list[dict[str, torch.Tensor]]:
    return same_grads(SHAPES, steps, world)


def _run_single(config: dict, dtype: torch.dtype, steps: int = 11) -> dict[str, torch.Tensor]:
    init = init_tensors(SHAPES)
    params = {n: torch.nn.Parameter(t.to(dtype)) for n, t in init.items()}
    opt = SOAP(list(params.items()), **{**BASE, **config})
    for grads in _grads(steps):
        for n, p in params.items():
            p.grad = grads[n].to(dtype)
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def float64_error(config: str) -> float:
    """Largest relative difference over ``SHAPES`` between ours in float64 and the reference,
    after 11 calls."""
    ours = _run_single(CONFIGS[config], torch.float64)
    ref = reference(init_tensors(SHAPES), _grads(11), {**BASE, **CONFIGS[config]})
    return max(float((ours[n] - ref[n]).abs().max() / ref[n].abs().max()) for n in SHAPES)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_float64_matches_the_paper_s_algorithm(config):
    """11 calls (10 Adam steps, bases refreshed on the way) within 1e-10 relative of a float64
    loop written from the paper and the authors' options (tests/support/soap_reference.py, which
    keeps the first moment rotated, as the authors' code does: the two agree at every
    precondition_frequency). Measured: every config within 5e-16."""
    assert float64_error(config) <= 1e-10


def test_the_defaults_are_the_paper_s():
    p = torch.nn.Parameter(torch.zeros(3, 3))
    opt = SOAP([p])
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["shampoo_beta"], g["eps"]) == (3e-3, (0.95, 0.95), None, 1e-8)
    assert (g["weight_decay"], g["precondition_frequency"], g["correct_bias"]) == (0.01, 10, True)
    assert (g["max_preconditioner_dim"], opt.merge_dims, opt.precondition_1d) == (
        1024,
        False,
        False,
    )
    assert (opt.normalize_grads, opt.large_dims, opt.tensor_factors) == (False, "block", "matrix")


def _trained(**kwargs) -> torch.Tensor:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, 5))
    opt = SOAP([p], max_preconditioner_dim=B, precondition_frequency=2, **kwargs)
    for step in range(5):
        p.grad = torch.randn(6, 5, generator=torch.Generator().manual_seed(step))
        opt.step()
    return p.detach()


def test_shampoo_beta_unset_or_negative_is_beta2_and_an_explicit_value_is_kept():
    betas = (0.9, 0.99)
    beta2 = _trained(betas=betas, shampoo_beta=0.99)
    assert torch.equal(_trained(betas=betas), beta2)
    assert torch.equal(_trained(betas=betas, shampoo_beta=-1), beta2)
    assert not torch.equal(_trained(betas=betas, shampoo_beta=0.95), beta2)


@pytest.mark.parametrize("limit", [1, 2, 3, 4, 6, 12, 100])
def test_per_dim_merging_is_the_authors(limit):
    """``merge_dims`` with ``tensor_factors="per_dim"`` is the authors' ``merge_dims=True``:
    DistributedShampoo's merging (ours) gives the same shapes as theirs."""
    for n in (1, 2, 3, 4):
        for shape in itertools.product((1, 2, 3, 5, 7, 13), repeat=n):
            assert merge_small_dims(shape, limit) == tuple(authors_merge(shape, limit)), shape


def test_each_option_keeps_the_factors_it_says():
    """State per block: one factor per dim with per_dim (dims 1..N-1 blocked), none for a dim
    above B with skip, no blocks at all with skip."""
    cube = torch.nn.Parameter(torch.zeros(3, 4, 5))
    opt = SOAP([cube], max_preconditioner_dim=4, tensor_factors="per_dim")
    opt.init_state()
    shapes = {k: tuple(v.shape) for k, v in opt.state[cube].items() if k != "step"}
    assert shapes == {
        "exp_avg": (3, 4, 5),
        "exp_avg_sq": (1, 3, 20),
        **{f"{kind}_0": (1, 2, 3, 3) for kind in ("factor", "basis")},
        **{f"{kind}_{d}": (1, 2, 4, 4) for kind in ("factor", "basis") for d in (1, 2)},
    }
    tall = torch.nn.Parameter(torch.zeros(10, 6))
    opt = SOAP([tall], max_preconditioner_dim=6, large_dims="skip")
    opt.init_state()
    shapes = {k: tuple(v.shape) for k, v in opt.state[tall].items() if k != "step"}
    assert shapes == {
        "exp_avg": (10, 6),
        "exp_avg_sq": (1, 10, 6),
        "factor_R": (1, 1, 6, 6),
        "basis_R": (1, 1, 6, 6),
    }
    wide = torch.nn.Parameter(torch.zeros(10, 7))  # both sides above B: plain Adam
    opt = SOAP([wide], max_preconditioner_dim=6, large_dims="skip")
    opt.init_state()
    assert set(opt.state[wide]) == {"step", "exp_avg", "exp_avg_sq"}


def test_the_shard_policy_follows_the_options():
    def unit(shape: tuple[int, ...], **options) -> int:
        return SOAP.shard_policy(4, **options)("p", torch.empty(shape))

    assert unit((10, 6)) == 4 * 6 and unit((7,)) == 1  # a slab of B rows; elements
    assert unit((10, 4), large_dims="skip") == 40  # one slab: the whole tensor (R only)
    assert unit((10, 7), large_dims="skip") == 1  # nothing factored: elements
    assert unit((7,), normalize_grads=True) == 7  # summed whole on one rank
    assert unit((5, 3, 6), tensor_factors="per_dim") == 4 * 18  # 4 slices of dim 0


def test_the_first_step_builds_the_bases_and_moves_nothing():
    p = torch.nn.Parameter(torch.randn(6, 4))
    before = p.detach().clone()
    opt = SOAP([p], max_preconditioner_dim=B)
    p.grad = torch.randn(6, 4)
    opt.step()
    assert torch.equal(p.detach(), before)
    stats = opt.last_step_stats
    assert stats["eigendecompositions"] == 4 and stats["blocks"] == 0  # 2 blocks, L and R each
    basis = opt.state[p]["basis_L"][0, 0]
    torch.testing.assert_close(basis.T @ basis, torch.eye(4))
    p.grad = torch.randn(6, 4)
    opt.step()
    assert opt.last_step_stats["blocks"] == 2 and not torch.equal(p.detach(), before)


# ----------------------------------------------------------------------------- world sizes
def _train(mode: str, config: dict, steps: int = 5) -> tuple[dict, list[dict]]:
    block = config.get("max_preconditioner_dim", B)
    return train_on_layout(SOAP, block, SHAPES, BASE, mode, config, steps)


@functools.cache
def _single(config: str) -> tuple[dict, list[dict]]:
    """One process's run of ``CONFIGS[config]``: the reference of every mode and world size,
    computed once (the tests only read it)."""
    return _train("single", CONFIGS[config])


def _norm_entries(config: dict) -> int:
    """Entries of normalize_grads' all-reduce: one per slab, one per tensor not preconditioned."""
    c = {**BASE, **config}
    options = [c.get(k, d) for k, d in (("merge_dims", False), ("precondition_1d", False))]
    options += [c.get("large_dims", "block"), c.get("tensor_factors", "matrix")]
    blocks = [SoapBlocks.of(s, c["max_preconditioner_dim"], *options) for s in SHAPES.values()]
    return sum(1 if b is None else b.num_slabs for b in blocks)


WORLD_CASES = [
    *((mode, "freq2") for mode in ("planned", "uneven", "drop-in", "cut")),
    ("planned", "merged"),
    ("cut", "vectors"),
    ("planned", "normalized"),
    ("drop-in", "normalized"),
    ("uneven", "skip"),
    ("cut", "skip"),
    ("planned", "per-dim"),
    ("cut", "per-dim"),
    ("planned", "per-dim-merged"),
    ("drop-in", "authors"),
]


@pytest.mark.parametrize(("mode", "config"), WORLD_CASES)
def test_every_world_size_equals_one_process_bitwise(pool, mode, config):
    """Parameters and every state tensor bitwise equal to one process at W = 1..4 (bases
    refreshed twice on the way); no optimizer byte moves unless the layout cuts blocks (or,
    with normalize_grads, the per-slab sums of squares: one float64 all-reduce)."""
    expected, single_stats = _single(config)
    results = pool.run(_train, mode, CONFIGS[config])
    for rank, (result, _) in enumerate(results):
        assert result.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(result[key], value), (rank, key)
    for step, single in enumerate(single_stats):
        per_rank = [stats[step] for _, stats in results]
        for key in ("eigendecompositions", "blocks", "basis_refreshes"):
            assert sum(s[key] for s in per_rank) == single[key], key
        moved = sum(s["bytes_communicated"] for s in per_rank)
        if mode == "cut" and pool.world_size > 1:
            assert moved > 0 and sum(s["owner_slabs"] for s in per_rank) > 0
        elif config in NORMALIZING and step > 0 and pool.world_size > 1:
            sums = 2 * 8 * _norm_entries(CONFIGS[config])  # sent and received, per rank
            assert [s["bytes_communicated"] for s in per_rank] == [sums] * pool.world_size
        else:
            assert moved == 0


def _fully_shard_train() -> list[tuple[str, bool, bool, int]]:
    from raggedfsdp.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.GELU(), torch.nn.Linear(10, 6))
    reference_model = copy.deepcopy(model)
    policy = SOAP.shard_policy(B)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, shard_policy=policy)
    fully_shard(model, shard_policy=policy)
    opt = SOAP(model.parameters(), **BASE, precondition_frequency=2)
    ref_opt = SOAP(reference_model.parameters(), **BASE, precondition_frequency=2)
    moved = 0
    for step in range(4):
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


def test_zero_optimizer_state_bytes_beyond_the_blocks_on_the_default_layout():
    """One process: state is M like the parameter, V per slab, and L, R, Q_L, Q_R per block."""
    p = torch.nn.Parameter(torch.zeros(10, 6))
    opt = SOAP([p], max_preconditioner_dim=B)
    opt.init_state()
    keys = {k: tuple(v.shape) for k, v in opt.state[p].items()}
    assert keys == {
        "step": (),
        "exp_avg": (10, 6),
        "exp_avg_sq": (3, 4, 6),
        "factor_L": (3, 2, 4, 4),
        "factor_R": (3, 2, 4, 4),
        "basis_L": (3, 2, 4, 4),
        "basis_R": (3, 2, 4, 4),
    }


# ----------------------------------------------------------------------------- checkpoints
def test_state_dict_round_trip_single_process():
    init = init_tensors(SHAPES)
    config = {**BASE, **CONFIGS["freq2"]}
    a = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    b = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt_a, opt_b = SOAP(list(a.values()), **config), SOAP(list(b.values()), **config)
    for step, g in enumerate(_grads(6)):
        if step == 3:
            for n in SHAPES:
                b[n].data.copy_(a[n])
            opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
        for params, opt in ((a, opt_a), (b, opt_b)) if step >= 3 else ((a, opt_a),):
            for n, p in params.items():
                p.grad = g[n].clone()
            opt.step()
    for n in SHAPES:
        assert torch.equal(a[n], b[n]), n


def _dcp(path: str, mode: str, save: bool) -> dict[str, torch.Tensor]:
    init = init_tensors(SHAPES, seed=0 if save else 3)
    params, gbuf = mode_params(init, SOAP.shard_policy(B), mode)
    opt = SOAP(list(params.items()), **BASE, precondition_frequency=2)
    return train_checkpointed(opt, params, gbuf, SHAPES, path, save, steps=5, at=3)


@pytest.mark.parametrize("mode", ["fsdp", "drop-in"])
def test_dcp_save_at_4_ranks_resumes_bitwise_at_3(dist_pool, tmp_path, mode):
    assert_resumes_bitwise(dist_pool, _dcp, str(tmp_path / "ckpt"), mode, names=SHAPES)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "learning rate"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"betas": (0.9,)}, "betas"),
        ({"shampoo_beta": 1.0}, "shampoo_beta"),
        ({"shampoo_beta": float("nan")}, "shampoo_beta"),
        ({"large_dims": "none"}, "large_dims"),
        ({"tensor_factors": "tucker"}, "tensor_factors"),
        ({"eps": 0.0}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"precondition_frequency": -1}, "precondition_frequency"),
        ({"precondition_frequency": 2.5}, "precondition_frequency"),
        ({"max_preconditioner_dim": 0}, "max_preconditioner_dim"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SOAP([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)


def test_merge_dims_refuses_a_layout_that_cuts_merged_blocks():
    spec = RaggedShard.from_counts((2, 2), 1, [3, 1], "small")
    p = torch.nn.Parameter(RaggedTensor(torch.zeros(1), spec, 1))
    with pytest.raises(ValueError, match=r"'small'.*merged blocks"):
        SOAP([("small", p)], merge_dims=True, precondition_1d=True)


def test_normalize_grads_refuses_a_layout_that_cuts_a_tensor_it_does_not_precondition():
    """Its update's sum of squares must come from one rank to be the same at every world size."""
    spec = RaggedShard.from_counts((7,), 1, [3, 4], "bias")
    p = torch.nn.Parameter(RaggedTensor(torch.zeros(3), spec, 0))
    with pytest.raises(ValueError, match=r"'bias'.*normalize_grads=True"):
        SOAP([("bias", p)], normalize_grads=True)
    SOAP([("bias", p)])  # without it, element-wise Adam takes any split


def test_soap_trains_an_ill_conditioned_regression():
    """100 full-batch steps of least squares (inputs of condition number 100) at lr 0.1: the
    loss falls below 5 % of its start (measured 0.086, AdamW 0.020 at the same lr). On a
    deterministic full-batch problem the eigenbasis is the gradient's singular vectors and the
    step is close to an orthogonalized gradient, smaller than Adam's at equal lr."""
    g = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    inputs = torch.randn(512, 64, generator=g) @ (basis * torch.logspace(0, -2, 64)) @ basis.T
    targets = inputs @ torch.randn(64, 32, generator=g)
    torch.manual_seed(1)
    model = torch.nn.Linear(64, 32, bias=False)
    opt = SOAP(model.parameters(), lr=0.1, weight_decay=0.0)
    start = ((model(inputs) - targets) ** 2).mean().item()
    for _ in range(100):
        ((model(inputs) - targets) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert ((model(inputs) - targets) ** 2).mean().item() < 0.05 * start
