"""Every script in ``examples/`` runs, at toy sizes, the way its docstring says to launch it."""

from __future__ import annotations

import re

import pytest

from tests.docs.ranks import ROOT, failures, run_ranks

EXAMPLES = ROOT / "examples"
TP_ARGS = ["--steps", "6", "--dim", "32", "--layers", "1", "--seq", "8", "--vocab", "64"]
# script -> [(ranks as torchrun would start them, 0 = one plain process; arguments)]
RUNS = {
    "demo.py": [(0, ["--world-size", "3", "--rows", "32"])],  # its own ranks; odd W, 32-row units
    "fully_shard_llama.py": [
        (0, ["--steps", "6", "--dim", "64", "--layers", "1", "--seq", "8", "--vocab", "64"]),
        (2, ["--steps", "6", "--dim", "64", "--layers", "1", "--seq", "8", "--vocab", "64"]),
    ],
    "tensor_parallel.py": [(0, TP_ARGS), (4, ["--tp", "2", *TP_ARGS])],  # 1 x 1; dp 2 x tp 2
}
CASES = [(name, nproc, args) for name, runs in RUNS.items() for nproc, args in runs]


def test_every_example_has_a_smoke_run():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize(
    ("name", "nproc", "args"), CASES, ids=[f"{n}-{p or 'plain'}" for n, p, _ in CASES]
)
def test_example_runs(name: str, nproc: int, args: list[str]):
    results = run_ranks([str(EXAMPLES / name), *args], nproc)
    if failed := failures(results):
        pytest.fail(failed, pytrace=False)
    output = results[0].output
    if name == "demo.py":
        assert output.count("[ok]") == 4 and "FAILED" not in output, output
        assert "units per rank" in output, output
    else:  # the loss falls and rank 0 says on how many ranks
        found = re.search(r"(\d+) rank\(s\), \d+ steps: loss ([\d.]+) -> ([\d.]+)", output)
        assert found, output
        ranks, first, last = int(found[1]), float(found[2]), float(found[3])
        assert ranks == max(nproc, 1) and last < first, output
