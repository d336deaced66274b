"""``--ep N`` end to end on the gloo pools, on the moe_tiny model (6 experts, top-2, two MoE
blocks): ep 2 trains as ep 1 at W=2, every optimizer trains with EP, checkpoints resume across
ep 2 and ep 1, and each bad ``--ep`` is refused in one line before anything runs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from recipes.llama.config import ConfigError, parse_args
from recipes.llama.optimizers import CHOICES
from recipes.llama.parallel import check_ep_world, distributed
from recipes.llama.train import train
from tests.support.recipe_runs import args, run_main, run_train

# EP computes each expert's rows on another rank and sums the combined output in the same order,
# but the reductions run over other groups (experts over dp_shard_mod_ep): float rounding only.
EP_TOLERANCE = 1e-5
# Muon's Newton-Schulz iterations amplify that rounding: over the 8 debug steps plain FSDP at
# W=2 is up to 3.7e-4 from W=1, and ep 2 up to 5.3e-4 from ep 1 at W=2 (measured).
MUON_TOLERANCE = 1e-3
EP_METRICS = ("moe/ep_tokens_max", "moe/ep_tokens_mean", "moe/ep_max_load", "all_to_all_mib")


def moe_args(data_dir: str, run_dir: Path, *extra: str) -> list[str]:
    """The debug run (tiny batches) on the moe_tiny model."""
    return args(data_dir, run_dir, "--config", "moe_tiny", *extra)


def _train_recording(argv: list[str]) -> dict[str, Any]:
    """Losses, gradient norms and the banner's mesh of one run on this rank."""
    cfg = parse_args(argv)
    norms: dict[int, float] = {}
    ep_keys: dict[str, float] = {}

    def record(step: int, metrics: dict[str, Any]) -> None:
        norms[step] = metrics["grad_norm"]
        ep_keys.update({k: v for k, v in metrics.items() if k in EP_METRICS})

    with distributed(cfg) as env:
        result = train(cfg, env, on_step=record)
        mesh = env.mesh_shape()
        dp = (env.dp_rank, env.dp_size)
    return {"losses": result.losses, "norms": norms, "mesh": mesh, "dp": dp, "ep": ep_keys}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--config", "moe_tiny", "--ep", "4"],
            "--ep 4 does not divide model.n_experts=6 (each EP rank holds n_experts / ep whole "
            "experts): use --ep 1, 2, 3 or 6",
        ),
        (["--ep", "2"], "--ep 2 with a dense model: expert parallelism splits a MoE model's"),
        (["--config", "moe_tiny", "--ep", "0"], "ep=0 must be >= 1"),
    ],
    ids=["experts", "dense", "zero"],
)
def test_a_bad_ep_is_refused_while_parsing(data_dir, tmp_path, extra, message):
    with pytest.raises(ConfigError) as err:
        parse_args(args(data_dir, tmp_path, *extra))
    assert str(err.value).startswith(message), err.value
    assert "\n" not in str(err.value)


def test_an_ep_that_does_not_divide_the_processes_is_refused_before_the_group():
    with pytest.raises(ConfigError) as err:
        check_ep_world(4, 6, n_experts=6)
    assert str(err.value) == (
        "--ep 4 does not divide the 6 processes (the mesh is (processes / ep, ep)): use --ep "
        "1, 2, 3 or 6, or launch a multiple of 4 processes"
    )
    check_ep_world(2, 4)
    with pytest.raises(ConfigError) as err:
        check_ep_world(2, 6, n_experts=6, replicate=2)
    assert str(err.value) == (
        "--ep 2 x --dp-replicate 2 does not divide the 6 processes (the mesh is (dp_replicate, "
        "processes / (dp_replicate * ep), ep)): launch a multiple of 4 processes, or lower "
        "--dp-replicate or --ep"
    )
    check_ep_world(2, 4, replicate=2)


def test_ep_not_dividing_the_world_ends_every_rank_with_one_line(dist_pool, data_dir, tmp_path):
    argv = moe_args(data_dir, tmp_path / "run", "--ep", "3")
    results = dist_pool(2).run(run_main, argv)
    assert [code for code, _, _ in results] == [2, 2], results
    assert results[0][1:] == (
        "",
        "error: --ep 3 does not divide the 2 processes (the mesh is (processes / ep, ep)): use "
        "--ep 1 or 2, or launch a multiple of 3 processes\n",
    )
    assert results[1][1:] == ("", "")


def test_ep2_trains_as_ep1_at_w2(dist_pool, data_dir, tmp_path):
    extra = ["--steps", "4", "--checkpoint-every", "0"]
    plain = dist_pool(2).run(_train_recording, moe_args(data_dir, tmp_path / "ep1", *extra))
    ours = dist_pool(2).run(
        _train_recording, moe_args(data_dir, tmp_path / "ep2", "--ep", "2", *extra)
    )
    assert ours[0]["mesh"] == {"dp_shard_mod_ep": 1, "ep": 2}
    assert [r["dp"] for r in ours] == [(0, 2), (1, 2)]  # every rank reads its own rows
    assert all(r["losses"] == ours[0]["losses"] for r in ours)
    assert plain[0]["ep"] == {}  # the EP metrics appear with --ep only
    ep = ours[0]["ep"]
    # 256 tokens a step, top-2, two EP ranks: 256 token-expert pairs per EP rank on average
    assert ep["moe/ep_tokens_mean"] == 256 and 256 <= ep["moe/ep_tokens_max"] <= 512, ep
    assert ep["moe/ep_max_load"] == ep["moe/ep_tokens_max"] / 256, ep  # every block's mean
    assert all(0 < r["ep"]["all_to_all_mib"] < 1 for r in ours), [r["ep"] for r in ours]
    losses, reference = ours[0]["losses"], plain[0]["losses"]
    assert list(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    for step, loss in losses.items():
        assert abs(loss - reference[step]) < EP_TOLERANCE, (step, loss, reference[step])
        norm, ref_norm = ours[0]["norms"][step], plain[0]["norms"][step]
        assert abs(norm - ref_norm) < EP_TOLERANCE * max(1.0, ref_norm), (step, norm, ref_norm)


@pytest.mark.parametrize("optimizer", list(CHOICES))
def test_every_optimizer_trains_with_ep(dist_pool, data_dir, tmp_path, optimizer):
    """Two steps with the experts split over ep 2 at W=2, on both ranks, exit status 0."""
    extra = ["--ep", "2", "--optimizer", optimizer, "--steps", "2", "--checkpoint-every", "0"]
    extra += ["--eval-every", "0", "--preconditioner-dim", "8"]
    results = dist_pool(2).run(run_main, moe_args(data_dir, tmp_path / optimizer, *extra))
    assert [r[0] for r in results] == [0, 0], results
    assert results[0][2] == "", results[0][2]


def test_blocks_an_ep_split_cuts_are_computed_on_owners(dist_pool, data_dir, tmp_path):
    """Shampoo's default 1024-side blocks span experts of both EP ranks: each slab is
    computed on one owner over dp x ep (the TP path, ``raggedfsdp.optim.tp_slabs``), and the
    run trains."""
    extra = ["--ep", "2", "--optimizer", "shampoo", "--steps", "2", "--checkpoint-every", "0"]
    results = dist_pool(2).run(run_main, moe_args(data_dir, tmp_path / "run", *extra))
    assert [r[0] for r in results] == [0, 0] and results[0][2] == "", results


def test_ep2_with_bf16_and_activation_checkpointing(dist_pool, data_dir, tmp_path):
    extra = ["--ep", "2", "--mixed-precision", "bf16", "--activation-checkpointing"]
    extra += ["--checkpoint-every", "0", "--steps", "4"]
    results = dist_pool(2).run(run_train, moe_args(data_dir, tmp_path / "run", *extra))
    losses = results[0].losses
    assert all(r.losses == losses for r in results)
    assert list(losses) == [1, 2, 3, 4] and losses[4] < losses[1] - 0.5


W4_STEPS = ["--steps", "4", "--checkpoint-every", "0"]


@pytest.fixture(scope="module")
def ep1_w4(dist_pool, data_dir, tmp_path_factory) -> dict[str, Any]:
    """Rank 0's record of the 4-step ep 1 run at W=4 that every W=4 EP layout is compared
    with, trained once for the module."""
    run_dir = tmp_path_factory.mktemp("ep1-w4") / "run"
    argv = moe_args(data_dir, run_dir, *W4_STEPS)
    return dist_pool(4).run(_train_recording, argv, timeout=240)[0]


def test_dp2_ep2_trains_as_ep1_at_w4(dist_pool, data_dir, tmp_path, ep1_w4):
    """(dp_shard_mod_ep 2, ep 2): each EP rank's experts also sharded over 2 ranks."""
    plain = ep1_w4
    ours = dist_pool(4).run(
        _train_recording, moe_args(data_dir, tmp_path / "ep2", "--ep", "2", *W4_STEPS), timeout=240
    )
    assert ours[0]["mesh"] == {"dp_shard_mod_ep": 2, "ep": 2}
    assert [r["dp"] for r in ours] == [(rank, 4) for rank in range(4)]
    assert list(ours[0]["losses"]) == list(plain["losses"]) == [1, 2, 3, 4]
    for step, loss in ours[0]["losses"].items():
        assert abs(loss - plain["losses"][step]) < EP_TOLERANCE, (step, loss, plain["losses"])
        norm, ref_norm = ours[0]["norms"][step], plain["norms"][step]
        assert abs(norm - ref_norm) < EP_TOLERANCE * max(1.0, ref_norm), (step, norm, ref_norm)


@pytest.mark.slow
def test_fsdp2_and_hsdp_with_ep_train_as_ep1_at_w4(dist_pool, data_dir, tmp_path, ep1_w4):
    """``--fsdp fsdp2 --ep 2`` (torchtitan's FSDP2 x EP: ``shard_ep_block_fsdp2``) and HSDP x
    EP (``--dp-replicate 2 --ep 2``: experts reduce-scattered over dp_shard_mod_ep, all-reduced
    over dp_replicate) with both FSDPs, each within 1e-5 of ep 1 at W=4, losses and norms."""
    extra, plain = W4_STEPS, ep1_w4
    runs = {
        "fsdp2": (["--fsdp", "fsdp2"], {"dp_shard_mod_ep": 2, "ep": 2}),
        "hsdp": (["--dp-replicate", "2"], {"dp_replicate": 2, "dp_shard_mod_ep": 1, "ep": 2}),
        "fsdp2-hsdp": (
            ["--fsdp", "fsdp2", "--dp-replicate", "2"],
            {"dp_replicate": 2, "dp_shard_mod_ep": 1, "ep": 2},
        ),
    }
    for name, (options, mesh) in runs.items():
        argv = moe_args(data_dir, tmp_path / name, "--ep", "2", *options, *extra)
        ours = dist_pool(4).run(_train_recording, argv, timeout=240)
        assert ours[0]["mesh"] == mesh, name
        assert [r["dp"] for r in ours] == [(rank, 4) for rank in range(4)], name
        for step, loss in ours[0]["losses"].items():
            assert abs(loss - plain["losses"][step]) < EP_TOLERANCE, (name, step, loss)
            norm, ref_norm = ours[0]["norms"][step], plain["norms"][step]
            assert abs(norm - ref_norm) < EP_TOLERANCE * max(1.0, ref_norm), (name, step, norm)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_checkpoints_resume_across_ep2_and_ep1(
    dist_pool, data_dir, tmp_path, moe_w2_run, optimizer
):
    """Saved at ep 2 (W=2) and resumed at ep 1 (W=2), and the reverse: the rest of the run
    within 1e-5 of the run that went straight on (DCP boxes are global; Muon within what plain
    FSDP shows across world sizes). AdamW at ep 1 is the session's plain moe_tiny run."""
    straight: dict[int, Any] = {}
    for ep in (1, 2):
        run_dir = tmp_path / f"ep{ep}"
        if ep == 1 and optimizer == "adamw":  # the same command line
            straight[ep], run_dir = moe_w2_run
        else:
            straight[ep] = dist_pool(2).run(
                run_train,
                moe_args(data_dir, run_dir, "--ep", str(ep), "--optimizer", optimizer),
                timeout=180,
            )[0]
        shutil.copytree(run_dir / "checkpoints" / "step_00000004", tmp_path / f"saved-ep{ep}")
    for saved_ep, resume_ep in ((2, 1), (1, 2)):
        saved = tmp_path / f"saved-ep{saved_ep}"
        resumed = dist_pool(2).run(
            run_train,
            moe_args(
                data_dir,
                tmp_path / f"ep{saved_ep}-to-ep{resume_ep}",
                "--ep",
                str(resume_ep),
                "--resume",
                str(saved),
                "--optimizer",
                optimizer,
                "--checkpoint-every",
                "0",  # nothing more to save
            ),
            timeout=180,
        )[0]
        assert resumed.resumed_from == str(saved)
        assert list(resumed.losses) == [5, 6, 7, 8]
        for step, loss in resumed.losses.items():
            reference = straight[saved_ep].losses[step]
            tolerance = MUON_TOLERANCE if optimizer == "muon" else EP_TOLERANCE
            assert abs(loss - reference) < tolerance, (saved_ep, resume_ep, step)


@pytest.mark.slow
def test_fsdp2_ep2_checkpoint_resumes_at_ep1_and_ep2(dist_pool, data_dir, tmp_path):
    """``--fsdp fsdp2 --ep 2`` saves DTensors on two meshes (experts on (dp_shard_mod_ep, ep),
    the rest on dp_shard); DCP's global boxes load them at ep 1 and ep 2: the rest of the run
    is the straight run's (measured: the same losses, bit for bit)."""
    fsdp2 = ["--fsdp", "fsdp2"]
    straight = dist_pool(2).run(
        run_train, moe_args(data_dir, tmp_path / "straight", "--ep", "2", *fsdp2), timeout=180
    )[0]
    saved = tmp_path / "saved"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step_00000004", saved)
    for ep in ("1", "2"):
        resume = ["--resume", str(saved), "--checkpoint-every", "0"]
        argv = moe_args(data_dir, tmp_path / f"ep{ep}", "--ep", ep, *fsdp2, *resume)
        resumed = dist_pool(2).run(run_train, argv, timeout=180)[0]
        assert list(resumed.losses) == [5, 6, 7, 8], ep
        for step, loss in resumed.losses.items():
            assert abs(loss - straight.losses[step]) < EP_TOLERANCE, (ep, step)
