"""The recipe tokens/s comparison's arithmetic and refusals (the runs themselves are the
recipe's, tested in tests/recipes; their speed is the machine's, never asserted)."""

from __future__ import annotations

import pytest

from tests.benchmarks.cli import refusal, script


def _run(speeds: list[float], loss: float) -> list[dict]:
    return [{"step": i, "loss": loss, "tokens_per_s": s} for i, s in enumerate(speeds)]


def test_each_pair_is_the_ratio_of_median_speeds_after_warmup() -> None:
    bench = script("recipe_vs_fsdp2")
    pairs = [
        {"raggedfsdp": _run([1, 30, 10, 20], 2.0), "fsdp2": _run([500, 10, 10, 10], 2.5)},
        {"raggedfsdp": _run([1, 12, 12, 12], 2.0), "fsdp2": _run([1, 10, 10, 40], 2.5)},
        {"raggedfsdp": _run([1, 8, 8, 8], 2.0), "fsdp2": _run([1, 10, 10, 10], 2.5)},
    ]
    result = bench.summarize(pairs, warmup=1)
    assert [row["ratio"] for row in result["pairs"]] == [2.0, 1.2, 0.8]
    assert result["ratio"] == 1.2  # the median pair
    assert result["pairs"][0]["final_loss"] == {"raggedfsdp": 2.0, "fsdp2": 2.5}


@pytest.mark.parametrize(
    ("argv", "fix"),
    [(["--pairs", "0"], "run at least one pair"), (["--steps", "5", "--warmup", "5"], "below")],
)
def test_bad_arguments_are_refused(argv: list[str], fix: str) -> None:
    assert fix in refusal("recipe_vs_fsdp2", *argv)
