"""Damaged checkpoints at W=4, through ``main`` as torchrun starts it: a corrupt one (flipped
bytes in a shard or in DCP's ``.metadata``, sizes unchanged) is named in one line, then the run
falls back to the previous complete checkpoint or, when the user named it, stops with the fix;
the only checkpoint damaged stops the run until ``--resume never``; rotation keeps the newest
good checkpoints and gives a bad directory no slot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from recipes.llama.checkpoint import check_checkpoint
from tests.support.recipe_runs import args, run_main

WORLD = 4  # four ranks each write a shard and hash a share of the files


@pytest.fixture(scope="module")
def saved_run(dist_pool, data_dir, tmp_path_factory) -> Path:
    """A 4-step run with a checkpoint after every step: step_00000001 .. step_00000004."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    extra = ("--steps", "4", "--checkpoint-every", "1", "--keep-checkpoints", "4")
    results = dist_pool(WORLD).run(run_main, args(data_dir, run_dir, *extra), timeout=120)
    assert [code for code, _, _ in results] == [0] * WORLD, results[0][2]
    return run_dir


def _copy(saved_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    return run_dir, run_dir / "checkpoints"


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _names(checkpoints: Path) -> list[str]:
    return sorted(p.name for p in checkpoints.iterdir())


def _only_rank_0_printed(results: list[tuple[int, str, str]]) -> None:
    assert all(out == err == "" for _, out, err in results[1:]), results[1:]


@pytest.mark.parametrize("damaged", ["__2_0.distcp", ".metadata"])
def test_a_corrupt_checkpoint_is_one_line_then_the_previous_one(
    dist_pool, data_dir, saved_run, tmp_path, damaged
):
    run_dir, checkpoints = _copy(saved_run, tmp_path)
    _flip_a_byte(checkpoints / "step_00000004" / damaged)
    results = dist_pool(WORLD).run(run_main, args(data_dir, run_dir, "--steps", "5"))
    assert [code for code, _, _ in results] == [0] * WORLD, results[0][2]
    _only_rank_0_printed(results)
    warnings = [line for line in results[0][1].splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: {checkpoints / 'step_00000004'}: {damaged} does not match the sha256 its "
        "save recorded: the checkpoint is corrupt; resuming from the previous complete "
        f"checkpoint {checkpoints / 'step_00000003'} instead"
    ]
    assert f"resumed from {checkpoints / 'step_00000003'}" in results[0][1]
    assert _losses(run_dir)[4] == _losses(saved_run)[4]  # step 3's state, loaded exactly


def test_a_corrupt_checkpoint_named_by_resume_stops_with_the_fix(
    dist_pool, data_dir, saved_run, tmp_path
):
    run_dir, checkpoints = _copy(saved_run, tmp_path)
    named = checkpoints / "step_00000004"
    _flip_a_byte(named / ".metadata")
    argv = args(data_dir, run_dir, "--steps", "5", "--resume", str(named))
    results = dist_pool(WORLD).run(run_main, argv)
    assert [code for code, _, _ in results] == [2] * WORLD
    _only_rank_0_printed(results)
    assert results[0][1:] == (
        "",
        f"error: {named}: .metadata does not match the sha256 its save recorded: the "
        "checkpoint is corrupt. Pass another checkpoint to --resume (or --resume auto for the "
        "newest in --run-dir), or start over with --resume never\n",
    )
    assert _losses(run_dir) == _losses(saved_run)  # nothing ran


def test_the_only_checkpoint_damaged_stops_until_told_to_start_over(
    dist_pool, data_dir, saved_run, tmp_path
):
    run_dir, checkpoints = _copy(saved_run, tmp_path)
    for step in (1, 2, 3):
        shutil.rmtree(checkpoints / f"step_0000000{step}")
    shard = checkpoints / "step_00000004" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    pool = dist_pool(WORLD)

    refused = pool.run(run_main, args(data_dir, run_dir, "--steps", "5"))
    assert [code for code, _, _ in refused] == [2] * WORLD
    _only_rank_0_printed(refused)
    (line,) = refused[0][2].splitlines()
    assert line.startswith(f"error: no checkpoint in {checkpoints} can be resumed: {shard} is ")
    assert (
        "incomplete or corrupt" in line and "To start over from step 0 use --resume never" in line
    )
    assert _losses(run_dir) == _losses(saved_run)  # no step was trained again

    extra = ("--resume", "never", "--steps", "1", "--checkpoint-every", "1")
    started_over = pool.run(run_main, args(data_dir, run_dir, *extra, "--keep-checkpoints", "1"))
    assert [code for code, _, _ in started_over] == [0] * WORLD
    assert list(_losses(run_dir)) == [1]
    # the new line's checkpoint is kept; the damaged one of the old line is gone
    assert _names(checkpoints) == ["step_00000001"]


def test_rotation_keeps_the_newest_good_checkpoints(dist_pool, data_dir, saved_run, tmp_path):
    """A bad directory between good ones takes no --keep-checkpoints slot."""
    run_dir, checkpoints = _copy(saved_run, tmp_path)
    shard = checkpoints / "step_00000003" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    extra = ("--steps", "5", "--checkpoint-every", "1", "--keep-checkpoints", "3")
    results = dist_pool(WORLD).run(run_main, args(data_dir, run_dir, *extra))
    assert [code for code, _, _ in results] == [0] * WORLD, results[0][2]
    assert f"resumed from {checkpoints / 'step_00000004'}" in results[0][1]
    assert _names(checkpoints) == [f"step_0000000{s}" for s in (2, 3, 4, 5)]
    for step in (2, 4, 5):  # three good ones; step 3 stays until rotation passes it
        check_checkpoint(checkpoints / f"step_0000000{step}")


def test_a_checkpoint_of_the_index_keyed_format_is_refused_by_name(tmp_path):
    """v1 checkpoints keyed the optimizer state by group index; loading one into today's
    name-keyed state would fail deep inside DCP, so the marker alone refuses it with the fix."""
    old = tmp_path / "step_00000004"
    old.mkdir()
    (old / "meta.json").write_text(json.dumps({"format": "raggedfsdp-recipe-checkpoint-v1"}))
    with pytest.raises(RuntimeError, match=r"earlier raggedfsdp .*--resume never"):
        check_checkpoint(old)
