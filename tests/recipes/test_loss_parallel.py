"""``--loss-parallel`` on the gloo pools: the logits stay vocabulary-sharded over TP and the
cross-entropy runs under ``loss_parallel()``; dp 2 x tp 2 then trains as one process does and as
the same run with replicated logits does, on raggedfsdp and FSDP2 and with activation
checkpointing, every optimizer steps as with replicated logits, the dry run's peak drops by the
logits it no longer holds whole, and without ``--tp`` the flag is refused in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from recipes.llama import dry_run
from recipes.llama.config import ConfigError, parse_args
from recipes.llama.optimizers import CHOICES
from recipes.llama.parallel import build_model, distributed
from tests.support.recipe_runs import args, run_main, run_train

# The sharded softmax sums each row's exponentials per TP rank, then over TP (one all-reduce),
# another order than one process's: losses agree to float rounding, as TP's do.
TOLERANCE = 1e-5


def _losses(
    dist_pool, world: int, data_dir: str, run_dir: Path, *extra: str, steps: int = 4
) -> dict[int, float]:
    """The training losses of a short run at ``world`` ranks (every rank logs the same)."""
    argv = args(data_dir, run_dir, "--steps", str(steps), "--checkpoint-every", "0", *extra)
    results = dist_pool(world).run(run_train, argv, timeout=180)
    assert all(r.losses == results[0].losses for r in results)
    assert list(results[0].losses) == list(range(1, steps + 1))
    return results[0].losses


def _assert_close(losses: dict[int, float], reference: dict[int, float]) -> None:
    assert list(losses) == list(reference)
    worst = max(abs(losses[step] - reference[step]) for step in losses)
    assert worst < TOLERANCE, (worst, losses, reference)


def _logits(argv: list[str]) -> tuple[bool, tuple, tuple[int, ...]]:
    """(a DTensor?, its placements, this rank's shape) of the recipe's model's logits."""
    cfg = parse_args(argv)
    with distributed(cfg) as env, torch.no_grad():
        logits = build_model(cfg, env, None)(torch.zeros(2, cfg.seq_len, dtype=torch.long))
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    return isinstance(logits, DTensor), getattr(logits, "placements", ()), tuple(local.shape)


def test_each_tp_rank_keeps_its_vocabulary_columns(dist_pool, data_dir, tmp_path):
    """With the flag the head's logits are ``Shard(-1)`` DTensors of ``vocab_size / tp``
    columns a rank; without it, plain full-vocabulary tensors."""
    argv = args(data_dir, tmp_path, "--tp", "2")
    for flag, expected in (
        ([], (False, (), (2, 32, 256))),
        (["--loss-parallel"], (True, (Shard(2),), (2, 32, 128))),
    ):
        assert dist_pool(2).run(_logits, [*argv, *flag]) == [expected, expected]


@pytest.fixture(scope="module")
def one_process(dist_pool, data_dir, tmp_path_factory) -> dict[int, float]:
    """The single-process run the dp 2 x tp 2 runs are compared with."""
    return _losses(dist_pool, 1, data_dir, tmp_path_factory.mktemp("w1") / "run")


@pytest.mark.parametrize(
    "extra",
    [[], ["--fsdp", "fsdp2"], ["--activation-checkpointing"]],
    ids=["raggedfsdp", "fsdp2", "ac"],
)
def test_dp2_tp2_trains_as_one_process_and_as_replicated_logits(
    dist_pool, data_dir, tmp_path, one_process, extra
):
    """Two 4-step runs at W=4 (about 5 s on 2 idle cores): with the flag, within 1e-5 of one
    process and of the same run with replicated logits (4.8e-7 measured)."""
    tp = ["--tp", "2", *extra]
    sharded = _losses(dist_pool, 4, data_dir, tmp_path / "lp", *tp, "--loss-parallel")
    assert sharded[4] < sharded[1] - 0.3  # it trains
    _assert_close(sharded, one_process)
    _assert_close(sharded, _losses(dist_pool, 4, data_dir, tmp_path / "rep", *tp))


@pytest.mark.parametrize("optimizer", [name for name in CHOICES if name != "adamw"])
def test_every_optimizer_steps_as_with_replicated_logits(
    dist_pool, data_dir, tmp_path, tp2_optimizer_run, optimizer
):
    """Muon, AdamW8bit, Shampoo and SOAP at dp 1 x tp 2: the loss after the first step is the
    replicated-logits run's (the output weight is the same ``Shard(0)`` parameter either way;
    that run is the TP test's, launched once per session). Two steps: from the third,
    Shampoo's and SOAP's roots amplify any reduction order's last bits (plain FSDP at W=2
    against W=1 differs by 4e-5 and 5e-3 at step 4)."""
    extra = ["--tp", "2", "--optimizer", optimizer, "--preconditioner-dim", "8"]
    lp = _losses(dist_pool, 2, data_dir, tmp_path / "lp", *extra, "--loss-parallel", steps=2)
    _assert_close(lp, tp2_optimizer_run(optimizer)[1])


def test_the_dry_run_holds_a_tp_rank_s_share_of_the_logits(data_dir, tmp_path):
    """Rank 0 of dp 2 x tp 2 on the fake group, vocabulary 32768: the same static memory, and
    a forward peak lower by at least the half of the fp32 logits (8 MiB) it no longer holds."""
    argv = args(data_dir, tmp_path, "--tp", "2", "--model.vocab-size", "32768")
    plain, lp = (
        dataclasses.asdict(dry_run.run(parse_args([*argv, *flag]), dry_run.DryRun(0, 4, "fake"), 1))
        for flag in ([], ["--loss-parallel"])
    )
    logits = 2 * 32 * 32768 * 4  # micro-batch x seq_len x vocab, fp32
    assert lp["static"] == plain["static"]
    assert plain["peak_forward"] - lp["peak_forward"] >= logits // 2, (plain, lp)


@pytest.mark.parametrize("extra", [[], ["--tp", "1"]], ids=["no-tp", "tp1"])
def test_loss_parallel_without_tp_is_refused_while_parsing(data_dir, tmp_path, extra):
    with pytest.raises(ConfigError) as err:
        parse_args(args(data_dir, tmp_path, "--loss-parallel", *extra))
    assert str(err.value) == (
        "--loss-parallel needs --tp N > 1 (it shards the logits over the TP ranks): add --tp 2 "
        "(or another degree) or drop --loss-parallel"
    )


def test_loss_parallel_without_tp_ends_every_rank_with_one_line(dist_pool, data_dir, tmp_path):
    results = dist_pool(2).run(run_main, args(data_dir, tmp_path / "run", "--loss-parallel"))
    assert [code for code, _, _ in results] == [2, 2], results
    assert results[0][1:] == (
        "",
        "error: --loss-parallel needs --tp N > 1 (it shards the logits over the TP ranks): add "
        "--tp 2 (or another degree) or drop --loss-parallel\n",
    )
    assert results[1][1:] == ("", "")
