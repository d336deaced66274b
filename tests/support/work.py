"""Deterministic work counts for complexity tests: how many lines of raggedfsdp's Python ran.

A scale test ("set-up at 100,000 ranks is linear in W") used to assert CPU seconds, and CPU
seconds depend on what else the machine runs: on a loaded 2-core machine a budget either flakes
or is so loose that it proves nothing. The number of lines the package executes does not depend
on the machine, and it still tells the complexities apart: a per-rank Python loop at W = 100,000
runs hundreds of thousands of lines, a numpy pass over W runs a handful, an O(jobs x W) scan runs
hundreds of millions. Timings belong to ``benchmarks/`` (rank_queries.py, planner_scale.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import raggedfsdp

__all__ = ["LineCount", "counted_lines"]

_PACKAGE = str(Path(raggedfsdp.__file__).resolve().parent)


@dataclass
class LineCount:
    """Lines of ``raggedfsdp`` code executed inside a ``counted_lines`` block."""

    lines: int = 0


@contextmanager
def counted_lines() -> Iterator[LineCount]:
    """Count the lines of ``raggedfsdp`` code that run in this thread inside the block.

    Only frames whose code lives in the package are traced (the test's own loops and torch's
    Python are not counted), so the count is the package's work, independent of the caller.
    """
    count = LineCount()

    def in_package(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            count.lines += 1
        return in_package

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        return in_package if frame.f_code.co_filename.startswith(_PACKAGE) else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield count
    finally:
        sys.settrace(previous)
