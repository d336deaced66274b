"""``--pp N`` end to end on the gloo pools: pp 2 x dp 2 trains as one process does with each
schedule (GPipe, 1F1B, interleaved 1F1B), reduces gradients once per step, resumes at
another (pp, dp) from the same DCP checkpoint, trains with every optimizer and with FSDP2 and
HSDP, and each bad ``--pp`` is refused in one line before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest

import raggedfsdp.fsdp.param_group as param_group_module
from recipes.llama.config import ConfigError, parse_args
from recipes.llama.optimizers import CHOICES
from recipes.llama.parallel import distributed
from recipes.llama.pipeline_checks import check_pp_world, microbatches
from recipes.llama.train import RunResult, train
from tests.support.recipe_runs import args, run_main, run_train

# The same global batch and the same mean of equal-sized microbatches' gradients as one
# process: only the order of the float sums differs (microbatches summed by the schedule,
# dp ranks by the reduce-scatter, the norm over stages as a sum of two squares), ~1e-7 a step.
PP_TOLERANCE = 1e-5
# Shampoo's inverse roots amplify last-bit differences by a factor the machine's kernels decide:
# at pp 2 against dp 4, 4.5e-5 / 3.0e-5 on one machine and 1.36e-4 / 1.6e-5 on another, so a
# multiple of the dp 4 gap alone is a coin toss there. The floor still fails a wrong schedule,
# whose gaps are the loss's own scale (1e-2 and more). SOAP's eigenbases amplify more: 8.7e-3 /
# 5.4e-3 on one machine, 8.0e-3 / 1.9e-3 on another (an AVX2-only EPYC), so its floor is at the
# loss's scale and the schedule is checked where nothing is amplified yet: the loss after the
# first update (step 2) is one process's within PP_TOLERANCE for both.
AMPLIFIED_FLOOR = {"shampoo": 4e-4, "soap": 2e-2}
LAYERS = ["--model.n-layers", "4"]  # 2 stages of 2 layers; interleaved: 4 stages of 1


def _pp(*extra: str) -> list[str]:
    return [*LAYERS, "--pp", "2", *extra]


def _counted_run(argv: list[str]) -> tuple[RunResult, list[float], list[tuple[int, int]]]:
    """The run, its logged gradient norms, and per step (reduce-scatters this rank issued,
    distinct gradient buffers among them)."""
    calls: list[int] = []
    original = param_group_module.reduce_scatter_flat

    def counted(*a, **k):
        calls.append(id(a[0]))
        return original(*a, **k)

    norms: list[float] = []
    per_step: list[tuple[int, int]] = []

    def on_step(step: int, metrics: dict) -> None:
        norms.append(metrics["grad_norm"])
        per_step.append((len(calls), len(set(calls))))
        calls.clear()

    cfg = parse_args(argv)
    param_group_module.reduce_scatter_flat = counted
    try:
        with distributed(cfg) as env:
            result = train(cfg, env, on_step=on_step)
    finally:
        param_group_module.reduce_scatter_flat = original
    return result, norms, per_step


STEPS = ["--steps", "4", "--checkpoint-every", "0"]
EVAL_STEPS = [*STEPS, "--eval-every", "2"]  # training goes on after a validation


@pytest.fixture(scope="module")
def one_process(dist_pool, data_dir, tmp_path_factory):
    """The single-process run (4 layers, 4 steps, validation after the 2nd and 4th) the
    schedules, FSDP2 and HSDP stages are compared with: computed once for the module."""
    run_dir = tmp_path_factory.mktemp("pp-one") / "run"
    return dist_pool(1).run(_counted_run, args(data_dir, run_dir, *LAYERS, *EVAL_STEPS))[0]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
def test_pp2_dp2_trains_as_one_process(dist_pool, data_dir, tmp_path, one_process, schedule):
    """4 steps (validation after the 2nd and 4th) at pp 2 x dp 2 against one process on the same
    global batches: the losses, the validation loss and the gradient norm over all stages
    (above --grad-clip 1 at every step here, so clipping by a wrong norm would show in the
    losses). Every rank reduce-scatters each of its 3 groups exactly once per step (2 blocks
    and the embedding, or the norm with the head; interleaved: 1 block in each of 2 stages),
    not once per microbatch (2 here)."""
    one, one_norms, _ = one_process
    argv = args(data_dir, tmp_path / "pp", *_pp("--pp-schedule", schedule, *EVAL_STEPS))
    for result, norms, reduces in dist_pool(4).run(_counted_run, argv, timeout=200):
        assert result.losses.keys() == one.losses.keys() == {1, 2, 3, 4}
        for step, loss in result.losses.items():
            assert abs(loss - one.losses[step]) < PP_TOLERANCE, (schedule, step, loss)
        assert result.val_losses.keys() == one.val_losses.keys() == {2, 4}
        for step, loss in result.val_losses.items():
            assert abs(loss - one.val_losses[step]) < PP_TOLERANCE, (schedule, step, loss)
        assert min(one_norms) > 1.0 and norms == pytest.approx(one_norms, rel=1e-5)
        assert reduces == [(3, 3)] * 4, reduces
    assert one.losses[4] < one.losses[1] - 0.5


def test_checkpoints_resume_across_pp2_dp2_pp1_dp4_and_pp1_dp2(dist_pool, data_dir, tmp_path):
    """A pp 2 x dp 2 checkpoint after 2 of 4 steps resumes at pp 1 x dp 4 and pp 1 x dp 2, and
    a pp 1 x dp 2 one at pp 2 x dp 2, each within PP_TOLERANCE of the run it was saved from:
    DCP restores the weights and AdamW's moments exactly (the keys are the full model's
    names), so only the layouts' float summation order differs (as between the layouts
    themselves, see test_pp2_dp2_trains_as_one_process)."""
    base = [*LAYERS, "--steps", "4", "--checkpoint-every", "2", "--eval-every", "0"]

    def run(world: int, name: str, *extra: str):
        argv = args(data_dir, tmp_path / name, *base, *extra)
        return dist_pool(world).run(run_train, argv, timeout=200)[0]

    saved = {"pp2": run(4, "pp2", "--pp", "2"), "dp2": run(2, "dp2")}
    resumes = [("pp2", 4, []), ("pp2", 2, []), ("dp2", 4, ["--pp", "2"])]
    for source, world, extra in resumes:
        checkpoint = tmp_path / source / "checkpoints" / "step_00000002"
        name = f"{source}-to-w{world}{'-pp2' if extra else ''}"
        resumed = run(world, name, *extra, "--resume", str(checkpoint), "--checkpoint-every", "0")
        assert resumed.resumed_from == str(checkpoint) and list(resumed.losses) == [3, 4]
        for step, loss in resumed.losses.items():
            assert abs(loss - saved[source].losses[step]) < PP_TOLERANCE, (name, step)


# Per optimizer (and FSDP2 with AdamW), one 4-step run at pp 2 x dp 2 saving after step 2:
# test_every_optimizer_trains_at_pp2 checks its losses, the resume test loads its checkpoint.
PP_OPTIMIZERS = [[name] for name in CHOICES if name != "adamw"] + [["adamw", "--fsdp", "fsdp2"]]


def _optimizer_args(optimizer: list[str]) -> list[str]:
    """The 4-step run of both optimizer tests, less the pp, the checkpoints and the resume."""
    steps = ["--steps", "4", "--eval-every", "0", "--preconditioner-dim", "16"]
    return [*LAYERS, *steps, "--optimizer", *optimizer]


@pytest.fixture(scope="module")
def pp2_runs(dist_pool, data_dir, tmp_path_factory):
    """``pp2_runs(optimizer)``: (every rank's result, the run's directory) of that optimizer's
    pp 2 x dp 2 run, made on first use and shared by the tests that need it."""
    runs: dict[str, tuple[list[RunResult], Path]] = {}

    def get(optimizer: list[str]):
        key = "-".join(optimizer)
        if key not in runs:
            run_dir = tmp_path_factory.mktemp(f"pp2-{key}") / "run"
            extra = [*_optimizer_args(optimizer), "--checkpoint-every", "2", "--pp", "2"]
            runs[key] = (dist_pool(4).run(run_train, args(data_dir, run_dir, *extra)), run_dir)
        return runs[key]

    return get


@pytest.mark.slow  # 2 runs at W=4 per optimizer, one shared with the next test
@pytest.mark.parametrize("optimizer", PP_OPTIMIZERS, ids=["-".join(r) for r in PP_OPTIMIZERS])
def test_every_optimizers_pp2_checkpoint_resumes_at_pp1_dp4(
    dist_pool, data_dir, tmp_path, pp2_runs, optimizer
):
    """Each optimizer's state (8-bit codes, Muon's momentum, Shampoo's and SOAP's nested
    factors, FSDP2's DTensors) saved at pp 2 x dp 2 after step 2 loads at pp 1 x dp 4: the
    first resumed loss is the straight run's (the weights come back exactly: within 1e-6,
    the dp mean's rounding), and the next one within 1e-4 (one update at the other layout,
    which Shampoo's inverse roots amplify to 4.3e-5 here; the others stay within 5e-7)."""
    straight, run_dir = pp2_runs(optimizer)
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    base = [*_optimizer_args(optimizer), "--checkpoint-every", "0"]  # nothing more to save
    resumed = dist_pool(4).run(
        run_train, args(data_dir, tmp_path / "dp4", *base, "--resume", str(checkpoint))
    )[0]
    assert resumed.resumed_from == str(checkpoint) and list(resumed.losses) == [3, 4]
    assert abs(resumed.losses[3] - straight[0].losses[3]) < 1e-6
    assert abs(resumed.losses[4] - straight[0].losses[4]) < 1e-4


def _gap(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys() == {1, 2, 3, 4}
    return max(abs(a[step] - b[step]) for step in a)


@pytest.mark.slow  # 2 runs of 4 steps per optimizer (1 at W=4) and the shared pp 2 run
@pytest.mark.parametrize("optimizer", [name for name in CHOICES if name != "adamw"])
def test_every_optimizer_trains_at_pp2(dist_pool, data_dir, tmp_path, pp2_runs, optimizer):
    """AdamW8bit, Muon, Shampoo and SOAP over pp 2 x dp 2: the loss falls, and the gap to one
    process is within 3x (plus 1e-5) the gap plain FSDP at dp 4 has to one process on the same
    run. The optimizers whose math amplifies the last bits of the gradients (Muon's bf16
    Newton-Schulz, Shampoo's inverse roots, SOAP's eigenbases) move away from one process by
    any change of summation order (measured: Muon 1.1e-4 at pp 2, 5.9e-5 at dp 4; Shampoo
    4.5e-5 and 3.0e-5; SOAP 8.7e-3 and 5.4e-3): for Shampoo and SOAP the bound has a floor
    (AMPLIFIED_FLOOR) and the loss after the first update must match; AdamW8bit stays within
    1e-6. (The pp 2 run
    also saves a checkpoint for the resume test: saving does not change the training.)"""
    extra = [*_optimizer_args([optimizer]), "--checkpoint-every", "0"]
    one = dist_pool(1).run(run_train, args(data_dir, tmp_path / "one", *extra))[0].losses
    dp4 = dist_pool(4).run(run_train, args(data_dir, tmp_path / "dp4", *extra))[0].losses
    bound = max(3 * _gap(dp4, one) + PP_TOLERANCE, AMPLIFIED_FLOOR.get(optimizer, 0.0))
    for result in pp2_runs([optimizer])[0]:
        assert _gap(result.losses, one) < bound, (optimizer, result.losses, one)
        if optimizer in AMPLIFIED_FLOOR:
            assert abs(result.losses[2] - one[2]) < PP_TOLERANCE, (optimizer, result.losses, one)
        assert result.losses[4] < result.losses[1] - 0.2


@pytest.mark.slow  # two 4-step runs at W=4
def test_fsdp2_stages_and_hsdp_train_as_one_process(dist_pool, data_dir, tmp_path, one_process):
    """``--fsdp fsdp2`` (torch's PipelineStage and fully_shard) and HSDP stages (pp 2 x
    dp_replicate 2 x dp_shard 1, recomputing each block's activations) against one process,
    losses and both validations."""
    one = one_process[0]
    hsdp = ["--dp-replicate", "2", "--activation-checkpointing"]
    for name, extra in (("fsdp2", ["--fsdp", "fsdp2"]), ("hsdp", hsdp)):
        argv = args(data_dir, tmp_path / name, *_pp(*extra, *EVAL_STEPS))
        for result in dist_pool(4).run(run_train, argv):
            assert _gap(result.losses, one.losses) < PP_TOLERANCE, name
            assert result.val_losses.keys() == {2, 4}, name
            for step, loss in result.val_losses.items():
                assert abs(loss - one.val_losses[step]) < PP_TOLERANCE, (name, step)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--pp", "3"],
            "--pp 3 makes 3 stages, which do not divide model.n_layers=4: use --pp 1, 2 or 4, "
            "or a layer count that 3 divides",
        ),
        (
            ["--pp", "2", "--pp-schedule", "interleaved", "--pp-stages-per-rank", "4"],
            "--pp 2 x --pp-stages-per-rank 4 makes 8 stages, which do not divide "
            "model.n_layers=4: use --pp 1, or a layer count that 8 divides",
        ),
        (["--pp", "2", "--tp", "2"], "--pp 2 with --tp 2: PP x TP is not supported yet"),
        (["--pp", "2", "--config", "moe_tiny"], "--pp 2 with a MoE model:"),
        (["--pp", "2", "--model.tie-embeddings"], "--pp 2 with --model.tie-embeddings:"),
        (["--pp", "2", "--export-weights"], "--pp 2 with --export-weights:"),
        (["--pp", "0"], "pp=0 must be >= 1"),
        (["--microbatches", "-1"], "microbatches=-1 must be >= 0"),
        (["--microbatches", "2"], "--microbatches 2 without --pp: it sets a pipeline's"),
    ],
    ids=[
        "layers",
        "interleaved-layers",
        "tp",
        "moe",
        "tied",
        "export",
        "zero",
        "negative",
        "without-pp",
    ],
)
def test_a_pp_the_model_cannot_split_is_refused_while_parsing(data_dir, tmp_path, extra, message):
    with pytest.raises(ConfigError) as err:
        parse_args(args(data_dir, tmp_path, *LAYERS, *extra))
    assert str(err.value).startswith(message), err.value
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("extra", "dp", "message"),
    [
        (
            ["--microbatches", "3"],
            2,
            "--microbatches 3 does not divide the 4 sequences each data-parallel rank gets per "
            "step (--batch-size 8 over 2 data-parallel ranks (--pp 2)): use --microbatches "
            "1, 2 or 4",
        ),
        (
            ["--micro-batch-size", "3"],
            2,
            "--micro-batch-size 3 does not divide the 4 sequences each data-parallel rank",
        ),
        (
            ["--microbatches", "1"],
            2,
            "--microbatches 1 is fewer than --pp 2: --pp-schedule 1f1b needs at least one "
            "microbatch per stage; use --microbatches 2 or 4",
        ),
        (["--batch-size", "6"], 4, "--batch-size 6 cannot be split over 4 data-parallel ranks"),
    ],
    ids=["microbatches", "micro-batch-size", "1f1b-fewer", "batch"],
)
def test_microbatches_that_do_not_fit_are_refused(data_dir, tmp_path, extra, dp, message):
    cfg = parse_args(args(data_dir, tmp_path, *_pp(*extra)))
    with pytest.raises(ConfigError) as err:
        microbatches(cfg, dp)
    assert str(err.value).startswith(message), err.value
    gpipe = parse_args(args(data_dir, tmp_path, *_pp("--pp-schedule", "gpipe")))
    assert microbatches(gpipe, 2) == 2  # 4 rows per dp rank / --micro-batch-size 2


def test_a_pp_that_does_not_divide_the_world_ends_every_rank_in_one_line(
    dist_pool, data_dir, tmp_path
):
    with pytest.raises(ConfigError) as err:
        check_pp_world(2, 2, 6)
    assert str(err.value) == (
        "--pp 2 x --dp-replicate 2 does not divide the 6 processes: use --pp 1 or 3, or launch "
        "a multiple of 4 processes"
    )
    results = dist_pool(2).run(run_main, args(data_dir, tmp_path / "run", *LAYERS, "--pp", "4"))
    assert [code for code, _, _ in results] == [2, 2], results
    assert results[0][2] == (
        "error: --pp 4 does not divide the 2 processes: use --pp 1 or 2, or launch a multiple "
        "of 4 processes\n"
    )
    assert results[1][1:] == ("", "")
