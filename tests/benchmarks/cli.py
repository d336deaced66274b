"""A benchmark script's argument refusals, checked in this process.

The scripts refuse bad arguments in their ``parse_args(argv)``, before any rank starts, so a
test of a refusal calls that function here instead of paying a subprocess (a Python start and a
torch import, seconds on a loaded 2-core machine) for the same one-line error.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as the module ``name``, as when it runs: its siblings
    (``measure``, ...) are imported by their bare names, from benchmarks/ put first on the path
    for the import only (the scripts import them at module level)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def refusal(name: str, *argv: str) -> str:
    """The last line ``benchmarks/<name>.py``'s ``parse_args(argv)`` writes to stderr as it
    exits with argparse's usage error (status 2), as the script's command line would."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        script(name).parse_args(list(argv))
    assert exit_.value.code == 2, err.getvalue()
    return err.getvalue().splitlines()[-1]
