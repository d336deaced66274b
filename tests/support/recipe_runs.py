"""Running the recipe inside the gloo worker pools: ``train`` itself (results as objects) or
``main`` as torchrun would start it (exit status and what each rank printed)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
from pathlib import Path
from unittest import mock

import torch.distributed as dist

from recipes.llama.checkpoint import CheckpointError
from recipes.llama.config import ConfigError, parse_args
from recipes.llama.parallel import distributed
from recipes.llama.train import RunResult, main, train

# A configured peak for MFU: on CPU the recipe otherwise measures it with 0.2 s of matmuls on
# every rank at the start of every run (metrics.peak_flops), a tenth of a debug run here. The
# runs as launched (test_launch, test_banner, the docs) still measure it.
PEAK_TFLOPS = ["--peak-tflops", "1"]


def args(data_dir: str, run_dir: Path, *extra: str) -> list[str]:
    """The debug run's command line in ``run_dir``, then ``extra``."""
    debug = ["--config", "debug", "--data-dir", data_dir, "--run-dir", str(run_dir)]
    return [*debug, *PEAK_TFLOPS, *extra]


def _signal_at(step: int, at: int) -> None:
    if step == at and dist.get_rank() == 0:  # one rank only: the others must agree to stop
        os.kill(os.getpid(), signal.SIGTERM)


def run_train(argv: list[str], signal_at: int | None = None) -> RunResult:
    cfg = parse_args(argv)
    on_step = None if signal_at is None else lambda step, _: _signal_at(step, signal_at)
    with distributed(cfg) as env:
        return train(cfg, env, on_step=on_step)


class Crash(Exception):
    """Stands for a process killed mid-run (no signal handler, no final save)."""


def _crash_at(step: int, at: int) -> None:
    if step == at:
        raise Crash(f"killed after step {step}")


def train_crashing_after(argv: list[str], step: int) -> str:
    """Train until ``step`` has been logged, then end every rank as a kill would (the pool
    survives: the crash is caught here, on every rank)."""
    cfg = parse_args(argv)
    try:
        with distributed(cfg) as env:
            train(cfg, env, on_step=lambda done, _: _crash_at(done, step))
    except Crash as err:
        return str(err)
    return "no crash"


def train_expecting_error(argv: list[str]) -> str:
    try:
        run_train(argv)
    except (CheckpointError, ConfigError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` on this rank with torchrun's RANK / LOCAL_RANK (one node): (exit status,
    stdout, stderr)."""
    rank = str(dist.get_rank())
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, {"RANK": rank, "LOCAL_RANK": rank}),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()
