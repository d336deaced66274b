"""RaggedTensor's element-wise dispatch: math on the local pieces, wrapped back with the same
spec; refusals for anything that would need other ranks' data or mixes layouts."""

from __future__ import annotations

import pytest
import torch

from raggedfsdp.sharding import RaggedShard, RaggedTensor

SPEC = RaggedShard.even((4, 6), 2, 6, "w")  # rank 1 holds the last two rows: 12 elements


def _ragged(values: torch.Tensor, spec: RaggedShard = SPEC) -> RaggedTensor:
    return RaggedTensor(values, spec, rank=1)


def test_pointwise_ops_run_on_the_local_pieces():
    a_local, b_local = torch.randn(12), torch.randn(12)
    a, b = _ragged(a_local.clone()), _ragged(b_local)
    out = torch.add(a, b, alpha=2.0)  # a keyword scalar
    assert isinstance(out, RaggedTensor) and out.ragged_shard == SPEC and out.shape == (4, 6)
    assert torch.equal(out.local, torch.add(a_local, b_local, alpha=2.0))
    weight = torch.tensor(0.25)  # a 0-d tensor operand broadcasts, as in torch.optim
    assert torch.equal(torch.lerp(a, b, weight).local, torch.lerp(a_local, b_local, weight))
    returned = a.addcdiv_(b, b.abs() + 1, value=-0.5)  # in place: the same object back
    assert returned is a
    assert torch.equal(a.local, a_local.addcdiv(b_local, b_local.abs() + 1, value=-0.5))
    assert torch.equal(torch.where(b > 0, a, b).local, torch.where(b_local > 0, a.local, b_local))


def test_rank_and_group_are_public_and_read_only():
    a = _ragged(torch.randn(12))
    assert a.rank == 1 and a.group is None  # None: the default group / a single process
    assert _ragged(a.local + 1).rank == 1  # results keep them
    assert (a * 2).rank == 1 and (a * 2).group is None
    for name in ("rank", "group"):
        with pytest.raises(AttributeError):
            setattr(a, name, 0)


def test_ops_needing_other_ranks_or_other_layouts_are_refused():
    a = _ragged(torch.randn(12))
    with pytest.raises(NotImplementedError, match=r"needs the whole tensor.*full_tensor\(\)"):
        a.cumsum(0)
    with pytest.raises(NotImplementedError, match=r"over some dims .* needs whole rows"):
        a.amax(dim=0)
    with pytest.raises(NotImplementedError, match=r"norm over some dims .* needs whole rows"):
        torch.linalg.vector_norm(a, dim=0)
    with pytest.raises(ValueError, match=r"mixing a RaggedTensor \('w'\) with a plain tensor"):
        a + torch.ones(4, 6)
    other = _ragged(torch.randn(12), RaggedShard.even((4, 6), 2, 1, "w"))  # element units
    with pytest.raises(ValueError):
        a + other


@pytest.mark.parametrize(
    "fill",
    [
        lambda t, g: t.uniform_(-0.5, 2.0, generator=g),
        lambda t, g: t.normal_(1.0, 0.3, generator=g),
        lambda t, g: t.bernoulli_(0.3, generator=g),
        lambda t, g: t.random_(generator=g),
        lambda t, g: t.random_(5, generator=g),
        lambda t, g: t.random_(-3, 9, generator=g),
        lambda t, g: t.exponential_(2.0, generator=g),
        lambda t, g: t.cauchy_(generator=g),
        lambda t, g: t.log_normal_(generator=g),
        lambda t, g: t.geometric_(0.4, generator=g),
        lambda t, g: torch.nn.init.kaiming_uniform_(t, a=5**0.5, generator=g),
    ],
    ids=[
        "uniform",
        "normal",
        "bernoulli",
        "random",
        "random_to",
        "random_from_to",
        "exponential",
        "cauchy",
        "log_normal",
        "geometric",
        "kaiming_uniform",
    ],
)
def test_random_fills_draw_what_one_process_draws(fill):
    """Each rank keeps its piece of the whole tensor that one process would draw with the same
    generator, and the generator ends where it would: initialising after sharding gives the
    unsharded model's weights at any world size (``trunc_normal_``, which also needs a global
    ``any()``, is checked across processes in test_fsdp_meta_init)."""
    full = torch.empty(4, 6)
    fill(full, torch.Generator().manual_seed(7))
    for rank in (0, 1):
        spec = RaggedShard.even((4, 6), 2, 1, "w")
        gen = torch.Generator().manual_seed(7)
        ragged = RaggedTensor(torch.zeros(spec.length(rank)), spec, rank)
        assert fill(ragged, gen) is ragged
        start, stop = ragged.local_range
        assert torch.equal(ragged.local, full.view(-1)[start:stop])
        after = torch.Generator().manual_seed(7)
        fill(torch.empty(4, 6), after)
        assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=after))
