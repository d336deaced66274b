"""The dry run (``raggedfsdp.dry_run``, ``recipes.llama.dry_run``) measures what the runtime does.

The method's checks: the tally and the counter are byte-exact on known allocations and
collectives; fake tensors give the same figures as real ones; and a dry run of rank r of W
gives the figures that a real W-process gloo job measures on its rank r with the same
counters (W = 2, 3, 4, raggedfsdp and FSDP2). Bad input is one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from raggedfsdp.dry_run import CollectiveCounter, MemoryTally, fake_world, measure, tensor_mode
from recipes.llama import dry_run as recipe_dry_run
from recipes.llama import parallel
from recipes.llama.config import ConfigError, parse_args

TINY = ["--config", "debug", "--micro-batch-size", "2", "--seq-len", "32"]
MEMORY = ("params", "grads", "optimizer", "static", "peak_forward", "peak_backward", "peak_step")
TRAFFIC = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "largest_all_gather")


def _cfg(*extra: str):
    return parse_args([*TINY, *extra])


def test_tally_counts_storages_views_frees_and_resizes() -> None:
    with MemoryTally() as tally:
        a = torch.empty(1000)  # 4,000 bytes
        view = a[10:20]
        assert tally.live == 4000
        b = torch.empty(250, dtype=torch.float64)
        assert tally.live == 6000
        del a
        assert tally.live == 6000  # the view keeps the storage alive
        del view
        assert tally.live == 2000
        b.untyped_storage().resize_(0)
        assert tally.live == 0
        b.untyped_storage().resize_(800)
        assert (tally.live, tally.peak) == (800, 6000)
        with tally.phase("p"):
            c = torch.empty(100)
            del c
        assert tally.peaks["p"] == 1200


def test_tally_counts_fake_tensors_without_allocating() -> None:
    with tensor_mode("fake"), MemoryTally() as tally:
        huge = torch.empty(1 << 40, dtype=torch.bfloat16)  # 2 TiB, never allocated
        assert tally.live == 2 << 40
        del huge
        assert tally.live == 0


def test_counter_counts_each_collective_as_its_whole_buffer() -> None:
    with fake_world(rank=1, world_size=4), CollectiveCounter() as counter:
        shard, full = torch.zeros(8), torch.zeros(32)
        dist.all_gather_into_tensor(full, shard)
        dist.reduce_scatter_tensor(shard, full)
        dist.all_reduce(shard)
        dist.all_to_all_single(full, full)
    assert counter.bytes == {
        "all_gather": 128,
        "reduce_scatter": 128,
        "all_reduce": 32,
        "all_to_all": 128,
    }
    assert counter.largest["all_gather"] == 128


def test_measure_reports_the_least_peak_of_the_steady_steps() -> None:
    """A buffer freed late in the last step (as gloo's threads sometimes do) is not the
    runtime's figure: with two steady steps the other one's peak is reported."""
    held: list[torch.Tensor] = []
    calls: list[None] = []
    late_in_call = [0]

    def build(_fully_shard):
        model = torch.nn.Linear(8, 8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.register_step_post_hook(lambda *_: held.clear())
        return model, optimizer

    def loss(model: torch.nn.Module) -> torch.Tensor:
        calls.append(None)
        if len(calls) == late_in_call[0]:  # 4,000 bytes kept through this step's backward
            held.append(torch.empty(1000))
        return model(torch.ones(2, 8)).sum()

    def peak(steps: int, late: int) -> int:
        calls.clear()
        late_in_call[0] = late
        return measure(build, loss, steps=steps).peak_forward

    clean = peak(3, late=0)
    assert peak(3, late=3) == clean == peak(3, late=2)
    assert peak(2, late=2) == clean + 4000  # one steady step: nothing to compare it with


def test_measure_reports_the_least_static_memory_of_the_steady_steps() -> None:
    """The same for what is live after the optimizer step: a buffer still held there in one
    steady step (a late free) is not in ``static``."""
    held: list[torch.Tensor] = []
    calls: list[None] = []

    def build(_fully_shard):
        model = torch.nn.Linear(8, 8)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(model: torch.nn.Module, late: int) -> torch.Tensor:
        held.clear()  # what the previous step left is freed now
        calls.append(None)
        if len(calls) == late:  # 4,000 bytes live from here to the next step's forward
            held.append(torch.empty(1000))
        return model(torch.ones(2, 8)).sum()

    def static(steps: int, late: int) -> int:
        calls.clear()
        return measure(build, lambda model: loss(model, late), steps=steps).static

    clean = static(3, late=0)
    assert static(3, late=2) == clean == static(3, late=3)
    assert static(2, late=2) == clean + 4000  # one steady step: nothing to compare it with


def test_fake_world_answers_rank_list_gathers_as_the_mesh_would() -> None:
    """``product_group`` learns each member's ranks along another mesh dim by gathering rank
    lists; on the fake group each member's are this rank's translated (rank 5 of a (2, 4)
    mesh, its tp group [4..7], gathered over its dp group [1, 5]); other objects refuse."""
    from raggedfsdp.comm.mesh import product_group

    with fake_world(rank=5, world_size=8):
        dp, tp = dist.new_group([1, 5]), dist.new_group([4, 5, 6, 7])
        rows: list = [None, None]
        dist.all_gather_object(rows, [4, 5, 6, 7], group=dp)
        assert rows == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert dist.get_process_group_ranks(product_group(dp, tp)) == list(range(8))
        with pytest.raises(TypeError, match="rank lists only, not dict"):
            dist.all_gather_object(rows, {"a": 1}, group=dp)


def _report(cfg, rank: int, world: int, tensors: str):
    return recipe_dry_run.run(cfg, recipe_dry_run.DryRun(rank, world, tensors))


@pytest.mark.parametrize("fsdp", ["raggedfsdp", "fsdp2"])
def test_fake_tensors_give_the_figures_of_real_ones(fsdp: str) -> None:
    cfg = _cfg("--fsdp", fsdp, "--mixed-precision", "bf16")
    fake, real = (dataclasses.asdict(_report(cfg, 5, 8, t)) for t in ("fake", "real"))
    for key in (*MEMORY, *TRAFFIC):
        assert _close(fake[key], real[key]), (key, fake[key], real[key])
    assert {k: fake[k] for k in TRAFFIC} == {k: real[k] for k in TRAFFIC}
    assert fake["params"] > 0 and fake["all_gather"] > 0
    assert fake["peak_backward"] > fake["static"]


def _gloo_step(args: list[str]) -> dict:
    """One rank of a real gloo job: the recipe's model and optimizer, measured by ``measure``
    over five steady steps (gloo's threads free a finished collective's buffers late now and
    then; the least of five is the runtime's figure)."""
    cfg = parse_args(args)
    env = parallel.make_env(torch.device("cpu"), 0, cfg.dp_replicate, cfg.tp, cfg.ep)
    build = recipe_dry_run._build(cfg, env)
    return dataclasses.asdict(measure(build, recipe_dry_run._loss(cfg), cfg.fsdp, steps=6))


def _close(sim: int, real: int) -> bool:
    return abs(sim - real) <= 0.05 * max(abs(real), 1)


@pytest.mark.parametrize("world_size", [2, 3, 4], ids=lambda w: f"W{w}")
@pytest.mark.parametrize(
    "extra",
    [
        ["--fsdp", "raggedfsdp"],
        ["--fsdp", "fsdp2"],
        ["--fsdp", "raggedfsdp", "--mixed-precision", "bf16", "--optimizer", "muon"],
    ],
    ids=["ours", "fsdp2", "ours-bf16-muon"],
)
def test_dry_run_matches_a_real_gloo_job(pool, world_size: int, extra: list[str]) -> None:
    args = [*TINY, *extra]
    real = pool.run(_gloo_step, args)
    for rank in range(world_size):
        sim = dataclasses.asdict(_report(parse_args(args), rank, world_size, "fake"))
        for key in MEMORY:
            assert _close(sim[key], real[rank][key]), (rank, key, sim[key], real[rank][key])
        # raggedfsdp's gloo path reduce-scatters by an in-place all-reduce: compare the sum
        assert _close(sim["all_gather"], real[rank]["all_gather"]), rank
        sim_rs = sim["reduce_scatter"] + sim["all_reduce"]
        real_rs = real[rank]["reduce_scatter"] + real[rank]["all_reduce"]
        assert _close(sim_rs, real_rs), (rank, sim_rs, real_rs)
        assert _close(sim["all_to_all"], real[rank]["all_to_all"]), rank


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        (["--dry-run", "4/4"], "outside [0, 4): simulate a rank from 0 to 3"),
        (["--dry-run", "3"], "give RANK/WORLD"),
        (["--dry-run", "0/6", "--dp-replicate", "4"], "dp_replicate=4 must divide"),
        (["--dry-run", "0/5", "--tp", "2"], "--tp 2 does not divide the 5 processes"),
        (["--dry-run", "0/4", "--dry-run-tensors", "paper"], "use fake or real"),
        (["--dry-run-tensors", "fake"], "needs --dry-run RANK/WORLD"),
        (["--dry-run", "0/4", "--pp", "2"], "--dry-run with --pp 2: the dry run builds"),
    ],
)
def test_bad_input_is_one_line(capsys, argv: list[str], fix: str) -> None:
    assert recipe_dry_run.main([*TINY, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert fix in err and "\n" not in err, err


def test_real_tensors_that_cannot_hold_one_block_are_refused(capsys, monkeypatch) -> None:
    monkeypatch.setattr(recipe_dry_run, "free_bytes", lambda: 1000)
    argv = [*TINY, "--dry-run", "0/4", "--dry-run-tensors", "real"]
    assert recipe_dry_run.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "use --dry-run-tensors fake" in err and "\n" not in err, err


def test_a_dry_run_needs_a_fresh_process_group() -> None:
    with fake_world(0, 2):
        inner = fake_world(0, 2)
        with pytest.raises(RuntimeError, match="already initialised"):
            inner.__enter__()


def test_split_argv_leaves_the_recipe_options() -> None:
    request, rest = recipe_dry_run.split_argv(["--dry-run=2/8", "--config", "debug"])
    assert tuple(request) == (2, 8, "fake") and rest == ["--config", "debug"]
    with pytest.raises(ConfigError):
        recipe_dry_run.parse_dry_run("a/b")
