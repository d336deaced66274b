"""torch's own optimizer conformance cases (``optim_db`` in
``torch.testing._internal.common_optimizers``) against our ``AdamW`` and ``Muon``.

Every error case must be refused as torch's tests require of torch's optimizer (type, message,
construction or step), and every behaviour configuration must train bitwise like torch's, or be
refused with torch's exception and message where torch refuses it on CPU (then the case is
reported skipped: its training is not compared here). The
cases run in one subprocess (``tests/support/torch_optim_db.py``: importing torch's test module
changes process-wide state). A deliberate difference is skipped here by name with its reason,
and documented in docs/optimizers.md ("Differences from torch"); the case list itself is
checked against torch's, so a case torch adds fails until it is listed here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

ERROR_CASES = {
    "AdamW": [
        "invalid param type",
        "a param group cannot have duplicate parameters",
        "duplicate parameters should not occur across param groups either",
        "Tensor lr must be 1-element",
        "all optimizer params should be with/without names",
        "all optimizer param groups should be with/without names.",
        "beta1 should be between 0 and 1",
        "weight_decay should > 0",
        "lr as Tensor doesn't work with foreach & not capturable",
        "betas must be either both floats or both Tensors",  # two cases: (float, T), (T, float)
        r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True",
    ],
    "Muon": [
        "invalid param type",
        "a param group cannot have duplicate parameters",
        "duplicate parameters should not occur across param groups either",
        "Tensor lr must be 1-element",
        "all optimizer params should be with/without names",
        "all optimizer param groups should be with/without names.",
        "only support 2D parameters",
        "only support `original` and `match_rms_adamw`",
        "does not support complex parameters",
    ],
}
BEHAVIOUR_CASES = {
    "AdamW": [
        "default",
        "non-default lr",
        "nonzero weight_decay",
        "maximize",
        "amsgrad",
        "capturable",
        "capturable, amsgrad",
        "Tensor lr with capturable and amsgrad",
        "Tensor lr, Tensor betas, with capturable and amsgrad",
        "Tensor lr, Tensor betas, with capturable",
    ],
    "Muon": [
        "default",
        "non-default lr",
        "Tensor lr",
        "non-default weight_decay",
        "non-default momentum",
        "passing alternative ns_steps",
        "passing alternative ns_coefficients",
    ],
}
_DUPLICATE = (
    "torch only warns about a parameter listed twice in one group (and steps it twice); a "
    "sharded optimizer would plan it twice into its buffers, so ours refuses it at "
    "construction (ValueError, with torch's words and the parameter's name)"
)
DIFFERENCES = {
    ("AdamW", "a param group cannot have duplicate parameters"): _DUPLICATE,
    ("Muon", "a param group cannot have duplicate parameters"): _DUPLICATE,
    ("Muon", "only support 2D parameters"): (
        "ours also takes stacked (E, m, n) experts, one matrix per expert (MoE weights); "
        "other shapes are refused with torch's words"
    ),
    ("Muon", "does not support complex parameters"): (
        "ours refuses complex parameters at construction, torch at the first step; the same "
        "RuntimeError and words (ours names the parameter and the view_as_real fix)"
    ),
}
#: Differences of timing only: ours raises torch's exception type with torch's words, earlier.
SAME_ERROR = {("Muon", "does not support complex parameters")}


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], list[dict]]:
    """Every case's record, keyed by (optimizer, kind, desc); one subprocess for the module."""
    out = tmp_path_factory.mktemp("optim_db") / "cases.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.torch_optim_db", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found: dict[tuple[str, str, str], list[dict]] = {}
    for record in json.loads(out.read_text()):
        found.setdefault((record["optimizer"], record["kind"], record["desc"]), []).append(record)
    return found


def _cases(table: dict[str, list[str]]) -> list[Any]:
    return [
        pytest.param(
            optimizer,
            desc,
            id=f"{optimizer}-{desc}",
            marks=[pytest.mark.skip(reason=DIFFERENCES[optimizer, desc])]
            if (optimizer, desc) in DIFFERENCES
            else [],
        )
        for optimizer, descs in table.items()
        for desc in descs
    ]


pytestmark = pytest.mark.slow  # one subprocess importing torch's test suite: ~5-10 s


@pytest.mark.parametrize(("optimizer", "desc"), _cases(ERROR_CASES))
def test_error_case_is_refused_as_torch_refuses_it(records, optimizer: str, desc: str) -> None:
    for record in records[optimizer, "error", desc]:
        assert record["torch_passes"], f"the harness fails torch itself: {record['torch']}"
        assert record["ours_passes"], (
            f"torch's case expects {record['expected']}; torch: {record['torch']}; "
            f"ours: {record['ours']}"
        )


@pytest.mark.parametrize(("optimizer", "desc"), _cases(BEHAVIOUR_CASES))
def test_behaviour_case_trains_bitwise_like_torch(records, optimizer: str, desc: str) -> None:
    """Bitwise where torch trains; where torch refuses the configuration on CPU, the same
    exception and message (compared in full, so two different refusals of one type differ),
    and the case is reported skipped unless some run trained."""
    (record,) = records[optimizer, "behaviour", desc]
    failed = [run for run in record["runs"] if not run["match"]]
    assert not failed, failed
    if all(run["refused"] for run in record["runs"]):
        pytest.skip(
            "torch refuses this configuration on CPU in every implementation "
            f"({record['runs'][0]['what'].split('; ours')[0]}); ours refuses it with the same "
            "exception and message, so only the refusal is compared (training needs a device)"
        )


def test_the_case_list_is_torchs_and_every_difference_still_differs(records) -> None:
    listed = {(o, "error", d) for o, ds in ERROR_CASES.items() for d in ds} | {
        (o, "behaviour", d) for o, ds in BEHAVIOUR_CASES.items() for d in ds
    }
    assert set(records) == listed, (
        f"torch's cases changed: new {sorted(set(records) - listed)}, "
        f"gone {sorted(listed - set(records))}; list them here (and match or document them)"
    )
    for optimizer, desc in DIFFERENCES:
        for record in records[optimizer, "error", desc]:
            assert record["torch_passes"] and not record["match"], (
                f"{optimizer} now matches torch on {desc!r}: drop it from DIFFERENCES and "
                "docs/optimizers.md"
            )


@pytest.mark.parametrize(("optimizer", "desc"), sorted(SAME_ERROR))
def test_an_earlier_refusal_raises_torchs_exception_and_words(records, optimizer, desc) -> None:
    """Where ours refuses at construction what torch refuses at the first step, a user's
    ``except`` written for torch still catches ours: same type, message matching torch's."""
    for record in records[optimizer, "error", desc]:
        assert record["ours_type_and_message"], (record["expected"], record["ours"])
