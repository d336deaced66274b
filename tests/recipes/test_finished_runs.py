"""A finished run stays finished, and no launch loses a metrics row (issue 28).

The issue's sequence at W=2: a Ctrl-C (a checkpoint), the same command to the end with
``--checkpoint-every 0`` (no checkpoint there), the same command again: it trains nothing and
leaves every output as it was; more ``--steps`` stop with the fix, since the only way on would
train the finished steps again. A finished run with its final checkpoint continues to more
steps. A launch that trains steps again (an explicit ``--resume PATH`` of an earlier step, a
crash after the last checkpoint) moves their old rows to ``metrics.superseded.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

from recipes.llama.metrics import SUPERSEDED
from recipes.llama.run_record import MARKER
from tests.support.recipe_runs import args, run_main, run_train, train_crashing_after

OUTPUTS = ("metrics.jsonl", "summary.json", "loss.png", MARKER)


def _rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def _outputs(run_dir: Path) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in OUTPUTS}


def _codes(results: list[tuple[int, str, str]]) -> list[int]:
    return [code for code, _, _ in results]


def test_a_finished_run_without_a_final_checkpoint_is_never_trained_again(
    dist_pool, data_dir, tmp_path
):
    pool = dist_pool(2)
    run_dir = tmp_path / "run"
    argv = args(data_dir, run_dir, "--steps", "6", "--checkpoint-every", "0", "--eval-every", "0")
    stopped = pool.run(run_train, argv, signal_at=2)[0]  # Ctrl-C: a checkpoint of step 3
    step_3 = run_dir / "checkpoints" / "step_00000003"
    assert stopped.checkpoint == str(step_3)
    finished = pool.run(run_main, argv)
    assert _codes(finished) == [0, 0], finished[0][2]
    assert json.loads((run_dir / "summary.json").read_text())["checkpoint"] is None
    before, rows = _outputs(run_dir), _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))

    again = pool.run(run_main, argv)
    assert again == [
        (
            0,
            f"{run_dir} finished at step 6 (--steps 6): nothing to train; it wrote no "
            "checkpoint of step 6 (--checkpoint-every 0), so it cannot continue; to train "
            "longer, start a new run with another --run-dir\n",
            "",
        ),
        (0, "", ""),
    ]
    assert _outputs(run_dir) == before

    longer = pool.run(run_main, [*argv, "--steps", "8"])
    assert _codes(longer) == [2, 2]
    assert longer[0][2] == (
        f"error: {run_dir} finished at step 6 but wrote no checkpoint of that step "
        "(--checkpoint-every 0), so it cannot continue to --steps 8. To train again from its "
        f"step-3 checkpoint with --resume {step_3}, or start over with --resume never (the "
        "metrics rows a restart replaces move to metrics.superseded.jsonl), or use another "
        "--run-dir\n"
    )
    assert _outputs(run_dir) == before

    branched = pool.run(run_main, [*argv, "--steps", "8", "--resume", str(step_3)])
    assert _codes(branched) == [0, 0], branched[0][2]
    assert (
        f"{run_dir / 'metrics.jsonl'}: the rows of steps 4-6, which this launch trains again "
        f"from step 3, moved to {run_dir / SUPERSEDED}\n"
    ) in branched[0][1]
    assert [r["step"] for r in _rows(run_dir)] == list(range(1, 9))
    assert _rows(run_dir, SUPERSEDED) == rows[3:]
    assert _rows(run_dir)[:3] == rows[:3]  # (steps 4-6 differ: the schedule spans 8 steps)


def test_a_finished_run_with_its_final_checkpoint_continues_to_more_steps(
    dist_pool, data_dir, tmp_path
):
    pool = dist_pool(1)
    run_dir = tmp_path / "run"
    argv = args(data_dir, run_dir, "--steps", "4", "--eval-every", "0")  # a checkpoint at 4
    assert _codes(pool.run(run_main, argv)) == [0]
    step_4 = run_dir / "checkpoints" / "step_00000004"
    before = _outputs(run_dir)

    again = pool.run(run_main, [*argv, "--steps", "3"])
    assert again == [
        (
            0,
            f"{run_dir} finished at step 4 (--steps 3): nothing to train; raise --steps to "
            f"continue from {step_4}\n",
            "",
        )
    ]
    assert _outputs(run_dir) == before
    ((code, _, err),) = pool.run(run_main, [*argv, "--model.dim", "64"])  # not this run
    assert code == 2 and "saved from another model shape (model.dim: checkpoint 32" in err, err

    ((code, out, err),) = pool.run(run_main, [*argv, "--steps", "6"])
    assert code == 0, err
    assert f"resumed from {step_4}" in out
    assert [r["step"] for r in _rows(run_dir)] == list(range(1, 7))
    assert not (run_dir / SUPERSEDED).exists()
    marker = json.loads((run_dir / MARKER).read_text())
    assert (marker["step"], marker["checkpoint"]) == (6, str(step_4.with_name("step_00000006")))


def test_rows_past_the_checkpoint_of_a_crashed_run_are_kept(dist_pool, data_dir, tmp_path):
    """A crash after step 5 with the last checkpoint at step 4: the resumed launch trains step
    5 again; the crashed launch's row of it is moved, not deleted."""
    pool = dist_pool(1)
    run_dir = tmp_path / "run"
    argv = args(data_dir, run_dir, "--steps", "6", "--eval-every", "0")  # checkpoints at 4, 6
    assert pool.run(train_crashing_after, argv, 5) == ["killed after step 5"]
    crashed = _rows(run_dir)
    assert [r["step"] for r in crashed] == list(range(1, 6))
    assert not (run_dir / MARKER).exists()

    ((code, out, err),) = pool.run(run_main, argv)
    assert code == 0, err
    assert "the rows of step 5, which this launch trains again from step 4, moved to" in out
    assert _rows(run_dir, SUPERSEDED) == crashed[4:]
    assert [r["step"] for r in _rows(run_dir)] == list(range(1, 7))
    assert _rows(run_dir)[4]["loss"] == crashed[4]["loss"]  # the same step, trained again
