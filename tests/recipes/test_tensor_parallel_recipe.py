"""``--tp N`` end to end on the gloo pools: dp 2 x tp 2 trains as plain FSDP does and as FSDP2 x
TP does, HSDP x TP with bf16 and activation checkpointing, checkpoints that resume at another
(dp, tp), every optimizer training with TP (and blocks a TP split cuts computed on owners),
and each bad ``--tp`` refused in one line before anything runs."""

from __future__ import annotations

import shutil

import pytest

from recipes.llama.config import ConfigError, parse_args
from recipes.llama.optimizers import CHOICES
from recipes.llama.parallel import check_world
from tests.support.recipe_runs import args, run_main, run_train

# TP sums the row-wise layers' and the sequence-parallel norms' partial products in another
# order than one process does (as FSDP2 x TP does): losses agree to float rounding.
TP_TOLERANCE = 1e-5


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--tp", "3"],
            "--tp 3 does not divide model.n_heads=4, model.n_kv_heads=2, model.vocab_size=256, "
            "seq_len=32 (TP splits each into 3 equal parts): use --tp 1 or 2, or change those "
            "sizes",
        ),
        (
            ["--tp", "2", "--model.tie-embeddings"],
            "--tp 2 with --model.tie-embeddings: the TP plan shards the embedding and the head "
            "as two parameters",
        ),
        (["--tp", "2", "--all-gather", "fp8"], "--tp 2 with --all-gather fp8: raggedfsdp's FP8"),
        (
            ["--tp", "2", "--config", "moe_tiny", "--model.moe-hidden", "47"],
            "--tp 2 does not divide model.moe_hidden=47 (TP splits each into 2 equal parts): "
            "use --tp 1, or change those sizes",
        ),
        (["--tp", "0"], "tp=0 must be >= 1"),
    ],
    ids=["heads", "tied", "fp8", "moe", "zero"],
)
def test_a_tp_the_model_cannot_split_is_refused_while_parsing(data_dir, tmp_path, extra, message):
    with pytest.raises(ConfigError) as err:
        parse_args(args(data_dir, tmp_path, *extra))
    assert str(err.value).startswith(message), err.value


def test_a_tp_that_does_not_divide_the_processes_is_refused_before_the_group():
    with pytest.raises(ConfigError) as err:
        check_world(4, 1, 6)
    assert str(err.value) == (
        "--tp 4 does not divide the 6 processes into data-parallel groups: use --tp 1, 2, 3 or "
        "6, or launch a multiple of 4 processes"
    )
    check_world(2, 2, 4)  # (dp_replicate 2, dp_shard 1, tp 2)


def test_tp_not_dividing_the_world_ends_every_rank_with_one_line(dist_pool, data_dir, tmp_path):
    argv = args(data_dir, tmp_path / "run", "--tp", "4", "--model.n-kv-heads", "4")
    results = dist_pool(2).run(run_main, argv)
    assert [code for code, _, _ in results] == [2, 2], results
    assert results[0][1:] == (
        "",
        "error: --tp 4 does not divide the 2 processes into data-parallel groups: use --tp 1 "
        "or 2, or launch a multiple of 4 processes\n",
    )
    assert results[1][1:] == ("", "")


@pytest.fixture(scope="module")
def tp_run(dist_pool, data_dir, tmp_path_factory):
    """(rank results, run directory) of the debug run at dp 2 x tp 2 (8 steps, checkpoints
    after steps 4 and 8): the trained model of one test, the checkpoint of the next."""
    run_dir = tmp_path_factory.mktemp("dp2-tp2") / "run"
    return dist_pool(4).run(run_train, args(data_dir, run_dir, "--tp", "2"), timeout=180), run_dir


@pytest.mark.slow  # 8-step runs at W=4 (FSDP2 x TP; ours is tp_run) and W=1, with w2_reference
def test_dp2_tp2_trains_as_plain_fsdp_and_as_fsdp2_tp(
    dist_pool, data_dir, tmp_path, w2_reference, tp_run
):
    plain = w2_reference[0].losses
    ours = tp_run[0]
    assert all(r.losses == ours[0].losses for r in ours)  # every rank logs the agreed loss
    fsdp2_args = ["--tp", "2", "--fsdp", "fsdp2", "--checkpoint-every", "0"]
    fsdp2 = dist_pool(4).run(
        run_train, args(data_dir, tmp_path / "fsdp2", *fsdp2_args), timeout=180
    )
    losses = ours[0].losses
    assert list(losses) == list(range(1, 9)) and losses[8] < losses[1] - 1.0
    assert list(plain) == list(fsdp2[0].losses) == list(losses)
    for step, loss in losses.items():
        assert abs(loss - plain[step]) < TP_TOLERANCE, (step, loss, plain[step])
        assert abs(loss - fsdp2[0].losses[step]) < TP_TOLERANCE, (step, loss, fsdp2[0].losses)
    one = dist_pool(1).run(run_train, args(data_dir, tmp_path / "w1", "--checkpoint-every", "0"))
    assert ours[0].val_losses[8] == pytest.approx(one[0].val_losses[8], abs=TP_TOLERANCE)


def test_a_dp2_tp2_checkpoint_resumes_at_dp4_and_at_dp1_tp2(dist_pool, data_dir, tmp_path, tp_run):
    straight = tp_run[0][0]
    saved = tmp_path / "step4"
    shutil.copytree(tp_run[1] / "checkpoints" / "step_00000004", saved)
    resume = ["--resume", str(saved), "--checkpoint-every", "0"]  # nothing more to save
    for world, tp in ((4, 1), (2, 2)):
        resumed = dist_pool(world).run(
            run_train,
            args(data_dir, tmp_path / f"w{world}-tp{tp}", "--tp", str(tp), *resume),
            timeout=180,
        )[0]
        assert resumed.resumed_from == str(saved)
        assert list(resumed.losses) == [5, 6, 7, 8]
        for step, loss in resumed.losses.items():
            assert abs(loss - straight.losses[step]) < TP_TOLERANCE, (world, tp, step)


def test_hsdp_tp_bf16_activation_checkpointing(dist_pool, data_dir, tmp_path):
    extra = ["--tp", "2", "--dp-replicate", "2", "--mixed-precision", "bf16"]
    extra += ["--activation-checkpointing", "--checkpoint-every", "0", "--steps", "4"]
    results = dist_pool(4).run(run_train, args(data_dir, tmp_path / "hsdp", *extra), timeout=180)
    losses = results[0].losses
    assert all(r.losses == losses for r in results)
    assert list(losses) == [1, 2, 3, 4] and losses[4] < losses[1] - 0.5


@pytest.mark.parametrize("optimizer", [name for name in CHOICES if name != "adamw"])
def test_every_optimizer_trains_with_tp(tp2_optimizer_run, optimizer):
    """Muon, AdamW8bit, Shampoo and SOAP step TP parameters as one process would (Shampoo and
    SOAP with blocks that divide every TP block): two steps on both ranks."""
    results, losses = tp2_optimizer_run(optimizer)
    assert [r[0] for r in results] == [0, 0], results
    assert results[0][2] == "", results[0][2]
    assert list(losses) == [1, 2], losses


def test_blocks_a_tp_split_cuts_are_computed_on_owners(dist_pool, data_dir, tmp_path):
    """Shampoo's default 1024-side blocks are whole matrices here, which TP splits: each is
    computed on one owner over dp x tp (``raggedfsdp.optim.tp_slabs``), and the run trains."""
    extra = ["--tp", "2", "--optimizer", "shampoo", "--steps", "2", "--checkpoint-every", "0"]
    results = dist_pool(2).run(run_main, args(data_dir, tmp_path / "run", *extra))
    assert [r[0] for r in results] == [0, 0] and results[0][2] == "", results
