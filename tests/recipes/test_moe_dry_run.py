"""An MoE dry run in fp32 and in bf16: ``expert_impl="auto"`` takes a path fake tensors can run
(``recipes.llama.dry_run.expert_impl_for``), and fake tensors give real tensors' figures."""

from __future__ import annotations

import dataclasses

import pytest

from recipes.llama import dry_run
from recipes.llama.config import parse_args

MEMORY = ("params", "grads", "optimizer", "static", "peak_forward", "peak_backward", "peak_step")
TRAFFIC = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "largest_all_gather")


def _report(args: list[str], tensors: str) -> dict:
    cfg = parse_args(["--config", "moe_tiny", "--run-dir", "/tmp/moe-dry-run", *args])
    return dataclasses.asdict(dry_run.run(cfg, dry_run.DryRun(0, 4, tensors), steps=1))


@pytest.mark.parametrize(
    ("precision", "impl"), [("none", "loop"), ("bf16", "grouped_mm")], ids=["fp32", "bf16"]
)
def test_moe_dry_run_runs_and_fake_matches_real(precision: str, impl: str) -> None:
    cfg = parse_args(["--config", "moe_tiny", "--mixed-precision", precision])
    assert dry_run.expert_impl_for(cfg) == impl
    args = ["--mixed-precision", precision]
    fake, real = (_report(args, t) for t in ("fake", "real"))
    assert {k: fake[k] for k in TRAFFIC} == {k: real[k] for k in TRAFFIC}
    for key in MEMORY:
        assert abs(fake[key] - real[key]) <= 0.05 * max(real[key], 1), (key, fake, real)
    assert fake["peak_backward"] > fake["static"] > 0


def test_an_ep_dry_run_gives_the_expert_rank_every_ranks_tokens() -> None:
    """Under ``--ep 2`` the routing counts travel by an all-to-all the fake process group does
    not perform: the dry run takes every EP peer to send this rank what it sends them (the
    counts' receive buffer is no uninitialised memory read as splits), so rank 0, holding
    expert 0, computes both EP ranks' rows: more expert activations at the forward summit
    than the same rank without EP, which computes its own rows only."""
    plain = _report([], "fake")
    ep = _report(["--ep", "2"], "fake")
    assert ep["all_to_all"] > 0 == plain["all_to_all"]
    assert ep["peak_forward"] > plain["peak_forward"] > ep["static"] > 0
