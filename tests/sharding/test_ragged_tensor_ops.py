"""RaggedTensor ops that answer for the whole tensor (reductions, norms, comparisons, Python
values) and broadcasting against plain tensors: every rank gets torch's answer on the gathered
tensor (same value, NaN included, same dtype, same error), or a clear refusal, never a local
answer or another shape."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from raggedfsdp.sharding import RaggedShard, RaggedTensor

NAN, INF = math.nan, math.inf


def _piece(full: torch.Tensor, spec: RaggedShard, rank: int) -> RaggedTensor:
    start, stop = spec.local_range(rank)
    return RaggedTensor(full.reshape(-1)[start:stop].clone(), spec, rank)


def _outcome(fn: Callable[[torch.Tensor], Any], t: torch.Tensor) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's var/std of < 2 elements warn
            return fn(t)
    except Exception as error:  # torch's own refusal is part of its answer
        return error


def _mismatch(name: str, ours: Any, torchs: Any) -> str | None:
    """Why ``ours`` is not torch's answer (None when it is): same exception type and message,
    or tensors of the same dtype and values (NaN where torch has NaN), or equal Python values."""
    if isinstance(torchs, Exception) or isinstance(ours, Exception):
        same = type(ours) is type(torchs) and str(ours) == str(torchs)
        return None if same else f"{name}: ours {ours!r}, torch {torchs!r}"
    if isinstance(torchs, (list, tuple)):
        if len(ours) != len(torchs):
            return f"{name}: {len(ours)} results, torch {len(torchs)}"
        pairs = enumerate(zip(ours, torchs, strict=True))
        return next((p for i, (o, t) in pairs if (p := _mismatch(f"{name}[{i}]", o, t))), None)
    if not isinstance(torchs, torch.Tensor):
        return None if ours == torchs else f"{name}: ours {ours!r}, torch {torchs!r}"
    if type(ours) is not torch.Tensor:
        return f"{name}: ours is a {type(ours).__name__}, torch's a plain tensor"
    try:
        torch.testing.assert_close(ours, torchs, equal_nan=True)
    except AssertionError as error:
        return f"{name}: {error}"
    return None


# ----------------------------------------------------------------------------- NaN and inf
_EXTREMES_AND_NORMS: dict[str, Callable[[torch.Tensor], Any]] = {
    "max": torch.max,
    "min": torch.min,
    "amax": torch.amax,
    "amin": torch.amin,
    "sum": torch.sum,
    "mean": torch.mean,
    "var": torch.var,
    "std": torch.std,
    "count_nonzero": torch.count_nonzero,
    **{
        f"norm({p})": (lambda t, p=p: torch.linalg.vector_norm(t, p))
        for p in (0.0, 1.0, 2.0, INF, -INF, -1.0, 0.5)
    },
    "foreach_norm(2)": lambda t: torch._foreach_norm([t, 2 * t], 2.0),
    "foreach_norm(inf)": lambda t: torch._foreach_norm([t, 2 * t], INF),
    "foreach_max": lambda t: torch._foreach_max([t, -t]),
}


def _special_values(world: int) -> dict[str, torch.Tensor]:
    """Whole tensors with NaN / inf on a middle rank's piece (2 elements per rank)."""
    base = torch.arange(2.0 * world)
    cases = {"finite": base, "negative": -base - 1, "with_zero": base - 3}
    for name, where, value in (("nan", 2, NAN), ("+inf", 2, INF), ("-inf", 3, -INF)):
        cases[name] = base.clone().index_fill_(0, torch.tensor([where]), value)
    cases["nan_and_inf"] = cases["nan"].clone().index_fill_(0, torch.tensor([3]), INF)
    cases["nan_and_-inf"] = cases["-inf"].clone().index_fill_(0, torch.tensor([2]), NAN)
    return cases


def _nan_and_inf_as_torch() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for case, full in _special_values(world).items():
        spec = RaggedShard.even(full.shape, world, 1, case)
        x = _piece(full, spec, rank)
        for name, fn in _EXTREMES_AND_NORMS.items():
            problems.append(_mismatch(f"{case} {name}", _outcome(fn, x), _outcome(fn, full)))
    # pieces empty on some ranks, and a tensor no rank holds any of
    for shape in ((2,), (0,), (3, 0)):
        full = torch.tensor([NAN, 1.0]) if shape == (2,) else torch.empty(shape)
        x = _piece(full, RaggedShard.even(shape, world, 1, "small"), rank)
        for name, fn in _EXTREMES_AND_NORMS.items():
            problems.append(_mismatch(f"{shape} {name}", _outcome(fn, x), _outcome(fn, full)))
    return [p for p in problems if p]


@pytest.mark.parametrize("world_size", [3, 4])
def test_nan_and_inf_propagate_through_whole_tensor_reductions_as_in_torch(pool):
    """A NaN on one middle rank makes max/min/amax/amin/inf-norms NaN on every rank (gloo's
    MAX/MIN all-reduce alone drops it: issue 18, item 1); ±inf, empty pieces and empty tensors
    give torch's values or errors."""
    for rank, problems in enumerate(pool.run(_nan_and_inf_as_torch)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------- dtype rules
_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
)

_WITH_DTYPE_RULES: dict[str, Callable[[torch.Tensor], Any]] = {
    "sum": torch.sum,
    "sum(dtype=float64)": lambda t: torch.sum(t, dtype=torch.float64),
    "mean": torch.mean,
    "mean(dtype=float32)": lambda t: torch.mean(t, dtype=torch.float32),
    "max": torch.max,
    "amin": torch.amin,
    "var": torch.var,
    "std(correction=0)": lambda t: torch.std(t, correction=0),
    "count_nonzero": torch.count_nonzero,
    "any": torch.any,
    "all": torch.all,
    "norm": torch.linalg.vector_norm,
    "norm(inf)": lambda t: torch.linalg.vector_norm(t, INF),
    "norm(dtype=float64)": lambda t: torch.linalg.vector_norm(t, dtype=torch.float64),
    "foreach_norm": lambda t: torch._foreach_norm([t]),
}


def _dtype_rules_as_torch() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    spec = RaggedShard.even((3, 4), world, 1, "w")
    values = torch.arange(12.0).view(3, 4) % 7 - 2  # small integers: exact in every dtype
    for dtype in _DTYPES:
        full = values.to(dtype)
        x = _piece(full, spec, rank)
        for name, fn in _WITH_DTYPE_RULES.items():
            problems.append(_mismatch(f"{dtype} {name}", _outcome(fn, x), _outcome(fn, full)))
    # float64 accumulates in float64: sqrt(10) * 1e30 where float32 squares overflow
    big_spec = RaggedShard.even((10,), world, 1, "big")
    big = torch.full((10,), 1e30, dtype=torch.float64)
    x = _piece(big, big_spec, rank)
    for name in ("norm", "foreach_norm", "sum"):
        fn = _WITH_DTYPE_RULES[name]
        problems.append(_mismatch(f"1e30 {name}", _outcome(fn, x), _outcome(fn, big)))
    return [p for p in problems if p]


@pytest.mark.parametrize("world_size", [3])
def test_whole_tensor_reductions_follow_torchs_dtype_rules(pool):
    """Integer mean/var/std raise torch's errors (issue 18, item 4: they returned truncated
    integers), result dtypes are torch's for every dtype, and float64 norms and sums
    accumulate in float64 (1e30 entries: 3.16e30, not inf)."""
    for rank, problems in enumerate(pool.run(_dtype_rules_as_torch)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------- global answers
def _global_answers() -> dict[str, tuple[Any, Any]]:
    """Each op's answer on this rank's pieces, next to torch's on the whole tensors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = RaggedShard.even((world, 4), world, 4, "w")  # one row per rank
    a_full = torch.arange(4.0 * world).view(world, 4)
    b_full = a_full.clone()
    b_full[-1, 1] += 1  # differs in the last rank's piece only
    a, b = _piece(a_full, spec, rank), _piece(b_full, spec, rank)
    ops: dict[str, Callable[[Any, Any], Any]] = {
        "equal": torch.equal,
        "equal_to_itself": lambda x, y: torch.equal(x, x.clone()),
        "equal_to_plain": lambda x, y: torch.equal(x, b_full),
        "equal_other_shape": lambda x, y: torch.equal(x, torch.zeros(3)),
        "allclose": torch.allclose,
        "allclose_atol": lambda x, y: torch.allclose(x, y, atol=1.0),
        "allclose_to_plain": lambda x, y: torch.allclose(x, b_full),
        "isclose_all": lambda x, y: bool(torch.isclose(x, y).all()),
        "eq_all": lambda x, y: bool((x == y).all()),
        "ne_any": lambda x, y: bool((x != y).any()),
        "count_nonzero": lambda x, y: int(torch.count_nonzero(x - y)),
        "foreach_max": lambda x, y: [t.item() for t in torch._foreach_max([x, y])],
        "is_same_size": lambda x, y: x.is_same_size(y),
    }
    answers = {
        name: (_outcome(lambda x, op=op: op(x, b), a), op(a_full, b_full))
        for name, op in ops.items()
    }
    # one element, held by rank 0 only
    one_spec = RaggedShard.even((1,), world, 1, "scalar")
    for value in (2.5, 0.0, -0.0, NAN):
        full = torch.tensor([value])
        one = _piece(full, one_spec, rank)
        for name, fn in {
            "item": lambda t: t.item(),
            "bool": bool,
            "float": float,
            "int": lambda t: int(t) if not math.isnan(float(t)) else "nan",
            "is_nonzero": lambda t: t.is_nonzero(),
        }.items():
            answers[f"{name}({value})"] = (repr(_outcome(fn, one)), repr(fn(full)))
    return answers


@pytest.mark.parametrize("world_size", [3])
def test_ops_returning_python_values_answer_for_the_whole_tensor(pool):
    """torch.equal of tensors differing on rank 2 only said True on ranks 0 and 1 (issue 18,
    item 2): every comparison, count and Python value is now the whole tensor's, on every
    rank."""
    for rank, answers in enumerate(pool.run(_global_answers)):
        wrong = {name: pair for name, pair in answers.items() if pair[0] != pair[1]}
        assert not wrong, f"rank {rank}: (ours, torch's) {wrong}"


SPEC = RaggedShard.even((4, 6), 3, 1, "w")  # 8 elements per rank: pieces cut rows


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("nonzero", torch.nonzero),
        ("argmax", torch.argmax),
        ("argmin", torch.argmin),
        ("aminmax", torch.aminmax),
        ("median", torch.median),
        ("prod", torch.prod),
        ("nansum", torch.nansum),
        ("var_mean", torch.var_mean),
        ("logsumexp", lambda t: torch.logsumexp(t, 0)),
        ("count_nonzero", lambda t: torch.count_nonzero(t, 0)),
        ("max", lambda t: torch.max(t, 0)),
        ("amax", lambda t: torch.amax(t, 0)),
        ("sum", lambda t: torch.sum(t, 1)),
        ("_foreach_powsum", lambda t: torch._foreach_powsum([t], 2)),
    ],
)
def test_ops_without_a_global_answer_refuse_with_the_way_out(name, op):
    """Whatever would answer from this rank's piece alone refuses, naming the op and the fix."""
    x = _piece(torch.randn(4, 6), SPEC, 1)
    with pytest.raises(NotImplementedError, match=rf"{name}.*\.full_tensor\(\)"):
        op(x)


def test_python_values_of_many_elements_raise_as_torch():
    x = _piece(torch.randn(4, 6), SPEC, 1)
    with pytest.raises(RuntimeError, match="a Tensor with 24 elements cannot be converted"):
        x.item()
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
        bool(x)


# ----------------------------------------------------------------------------- broadcasting
def test_broadcasting_with_plain_tensors_gives_torchs_shape_dtype_and_values():
    """A one-element plain tensor broadcasts as torch broadcasts it (``x * ones(1, 1)`` was a
    plain (1, 8) tensor: issue 18, item 3), keeping torch's type promotion (a (1,) float64
    operand promotes, a 0-d one does not); every rank's piece is its piece of torch's result."""
    full = torch.randn(4, 6)
    operands = {
        "ones(1, 1)": torch.ones(1, 1),
        "(1,) float64": torch.full((1,), 0.5, dtype=torch.float64),
        "0-d float64": torch.tensor(0.5, dtype=torch.float64),
        "0-d int": torch.tensor(3),
    }
    for name, other in operands.items():
        for op in (torch.mul, torch.add, lambda a, b: torch.where(a > 0, a, b)):
            expected = op(full, other)
            for rank in range(SPEC.world_size):
                got = op(_piece(full, SPEC, rank), other)
                assert isinstance(got, RaggedTensor), name
                assert (got.shape, got.dtype) == (expected.shape, expected.dtype), name
                start, stop = SPEC.local_range(rank)
                assert torch.equal(got.local, expected.reshape(-1)[start:stop]), name
    scalar_spec = RaggedShard.even((), 2, 1, "s")  # a 0-d RaggedTensor: 0-d operands promote
    scalar = _piece(torch.tensor(1.5), scalar_spec, 0)
    got, expected = scalar * torch.tensor(2.0, dtype=torch.float64), torch.tensor(3.0).double()
    assert (got.shape, got.dtype, got.local.tolist()) == ((), expected.dtype, [3.0])


@pytest.mark.parametrize(
    ("other", "match"),
    [
        (torch.ones(1, 1, 1), r"gives shape \(1, 4, 6\), which a RaggedTensor .* cannot hold"),
        (torch.ones(6), r"mixing a RaggedTensor \('w'\) with a plain tensor of shape \(6,\)"),
        (torch.ones(4, 1), r"mixing .* takes scalars"),
        (torch.ones(0), r"mixing .* shape \(0,\)"),
    ],
)
def test_broadcasts_a_piece_cannot_hold_are_refused(other, match):
    x = _piece(torch.randn(4, 6), SPEC, 1)
    with pytest.raises(ValueError, match=match):
        x * other
    with pytest.raises(ValueError, match=match):
        torch._foreach_mul([x], [other])


def test_list_ops_refuse_results_that_are_not_pieces():
    x = _piece(torch.randn(4, 6), SPEC, 1)
    with pytest.raises(NotImplementedError, match=r"_foreach_add.*shape \(1, 8\)"):
        torch._foreach_add([x], [torch.ones(1, 1)])


def test_copy_broadcasts_plain_tensors_to_the_whole_shape():
    row, full = torch.arange(6.0), torch.arange(6.0).expand(4, 6)
    for rank in range(SPEC.world_size):
        x = _piece(torch.zeros(4, 6), SPEC, rank)
        x.copy_(row)
        start, stop = SPEC.local_range(rank)
        assert torch.equal(x.local, full.reshape(-1)[start:stop])
        x.copy_(torch.tensor([[7.0]]))
        assert torch.equal(x.local, torch.full((8,), 7.0))
    with pytest.raises(RuntimeError):
        x.copy_(torch.ones(1, 1, 1))  # torch refuses more dims than the destination's
    with pytest.raises(RuntimeError):
        x.copy_(torch.ones(3))
