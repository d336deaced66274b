"""A run that cannot start ends every rank at once with one line, printed by rank 0 alone: bad
arguments, a batch the processes cannot divide (naming the sizes that work), a missing
``--resume`` directory, a data error that only one rank hits. ``main`` runs on W=4 pools with
the RANK / LOCAL_RANK that torchrun sets."""

from __future__ import annotations

from unittest import mock

import pytest
import torch.distributed as dist

from recipes.llama.data import DataError, TokenData
from tests.support.recipe_runs import args, run_main

WORLD = 4


def _expect_one_line(results: list[tuple[int, str, str]], line: str) -> None:
    assert [code for code, _, _ in results] == [2] * WORLD, results
    assert results[0][1:] == ("", f"error: {line}\n")
    assert all(out == err == "" for _, out, err in results[1:]), results[1:]


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (["--lr"], "argument --lr: expected one argument (see --help)"),
        (
            ["--batch-size", "6"],
            "--batch-size 6 cannot be split over 4 processes: use a multiple of 4 "
            "(e.g. --batch-size 4 or 8) or another number of processes",
        ),
        (
            ["--micro-batch-size", "3"],
            "--micro-batch-size 3 does not divide the 2 sequences each process gets per step "
            "(--batch-size 8 over 4 processes): use --micro-batch-size 1 or 2",
        ),
    ],
    ids=["lr-without-a-value", "batch-over-processes", "micro-batch"],
)
def test_an_error_is_printed_once(dist_pool, data_dir, tmp_path, extra, line):
    results = dist_pool(WORLD).run(run_main, args(data_dir, tmp_path / "run", *extra))
    _expect_one_line(results, line)


def test_resume_of_a_missing_directory_says_it_does_not_exist(dist_pool, data_dir, tmp_path):
    missing = tmp_path / "nowhere"
    results = dist_pool(WORLD).run(
        run_main, args(data_dir, tmp_path / "run", "--resume", str(missing))
    )
    _expect_one_line(
        results,
        f"{missing} does not exist. Pass another checkpoint to --resume (or --resume auto for "
        "the newest in --run-dir), or start over with --resume never",
    )


def _main_with_data_missing_on_rank_2(argv: list[str]) -> tuple[int, str, str]:
    if dist.get_rank() != 2:
        return run_main(argv)

    def missing(*_: object) -> TokenData:
        raise DataError("train.bin is missing on this node: copy the data directory here")

    with mock.patch.object(TokenData, "open", missing):
        return run_main(argv)


def test_a_data_error_on_one_rank_ends_every_rank(dist_pool, data_dir, tmp_path):
    """Without agreeing, rank 2 would leave and the others wait in the next collective."""
    argv = args(data_dir, tmp_path / "run")
    results = dist_pool(WORLD).run(_main_with_data_missing_on_rank_2, argv, timeout=30)
    _expect_one_line(
        results,
        "train.bin is missing on this node: copy the data directory here "
        "(on 1 of 4 ranks, the first rank 2)",
    )
