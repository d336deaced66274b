"""Atomic DCP checkpoints, resumable at any world size, and stopping cleanly on a signal.

A checkpoint is a directory ``step_NNNNNNNN`` written by ``torch.distributed.checkpoint``: every
rank saves its own shards (no gathering), so it loads at any other world size. It holds the
model, the optimizer state, the step, the tokens seen and the RNG state; the data position is
the step itself (batches are a function of it, see ``data.Batches``).

Saving is atomic: all ranks write into ``step_N.tmp``, then rank 0 writes ``meta.json`` (the
completion marker: model shape, optimizer, every file's size and sha256) and renames the
directory. A crash at any point leaves either a ``.tmp`` directory, which is never loaded, or a
complete checkpoint. A checkpoint is verified against its marker before it is loaded
(``checkpoint_files.verify``): one that was truncated, copied partially or corrupted is never
half-loaded. ``--resume auto`` then falls back to the newest older checkpoint that verifies and
says so in one line; when none does, or the checkpoint was named with ``--resume PATH``, the run
stops with one line naming the checkpoint, what is wrong and the fix. It never restarts from
step 0 on its own: that takes ``--resume never``. Multi-node runs need ``run_dir`` on a
filesystem that every node sees.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from raggedfsdp.checkpoint import load as safe_load
from recipes.llama.checkpoint_files import (
    FORMAT,
    MARKER,
    CheckpointError,
    broadcast_from_main,
    check_checkpoint,
    file_digests,
    step_dirs,
    step_of,
    verify,
)
from recipes.llama.config import Config
from recipes.llama.parallel import Env

__all__ = ["CheckpointError", "Checkpointer", "GracefulStop", "TrainState", "check_checkpoint"]

# The optimizer state keyed by parameter name, hyperparameters included
# (``param_groups.<fqn>.lr``), not by group index: a pipeline stage holds some of the groups'
# parameters only, so index-keyed groups would differ between ranks and between (pp, dp)
# layouts; keyed by name, a checkpoint saved at --pp 2 loads at --pp 1 and back (torchtitan's
# choice for pipeline parallelism).
OPTIM_BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class TrainState:
    """Where training continues: ``step`` optimizer steps and ``tokens_seen`` tokens done."""

    step: int = 0
    tokens_seen: int = 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _model_mismatch(saved: dict[str, Any], cfg: Config) -> list[str]:
    """What differs between the checkpoint's model config and this run's; a dense model against
    a MoE one (whose config has the expert keys) is said in those words, not key by key."""
    ours = asdict(cfg.model)
    family = {True: "a MoE model", False: "a dense model"}
    if ("n_experts" in saved) != ("n_experts" in ours):
        return [
            f"checkpoint {family['n_experts' in saved]}, this run {family['n_experts' in ours]}"
        ]
    return [
        f"model.{key}: checkpoint {saved.get(key)!r}, this run {value!r}"
        for key, value in ours.items()
        if saved.get(key) != value
    ]


def _one_line(err: BaseException) -> str:
    """The first line of an error DCP raised (its multi-rank report runs to pages)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


class Checkpointer:
    """Saves, rotates and finds the checkpoints under ``root``; every method is collective.

    ``data_position`` (seed and data fingerprint) is stored with the step: together they
    determine every later batch, and a resume that changes them is warned about. ``bad`` holds
    the directories that failed verification when resuming, so rotation never counts them.
    """

    def __init__(self, root: Path, env: Env, keep: int, data_position: dict[str, Any]) -> None:
        self.root, self.env, self.keep = root, env, max(1, keep)
        self.data_position = data_position
        self.bad: set[Path] = set()

    def _state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, train: TrainState
    ) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIM_BY_NAME)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "train": {
                "step": torch.tensor(train.step),
                "tokens_seen": torch.tensor(train.tokens_seen),
                "rng": torch.get_rng_state(),
            },
        }

    def save(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, train: TrainState, cfg: Config
    ) -> Path:
        final = self.root / f"step_{train.step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save(self._state(model, optimizer, train), checkpoint_id=tmp)
        dist.barrier()  # every rank's files are on disk (DCP fsyncs them)
        listing = sorted(p.name for p in tmp.iterdir()) if self.env.is_main else None
        names = broadcast_from_main(listing)  # one list on every rank
        digests = file_digests(tmp, names)  # each rank hashes its share
        if self.env.is_main:
            meta = {
                "format": FORMAT,
                "step": train.step,
                "tokens_seen": train.tokens_seen,
                "world_size": self.env.world_size,
                "optimizer": cfg.optimizer,
                "fsdp": cfg.fsdp,
                "model": asdict(cfg.model),
                "data": self.data_position,
                "files": {name: (tmp / name).stat().st_size for name in names},
                "sha256": digests,
            }
            with (tmp / MARKER).open("w") as f:  # on disk before the rename publishes it
                f.write(json.dumps(meta, indent=1))
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():  # the same step saved again (after a resume or a fallback)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._rotate(final)
        dist.barrier()
        return final

    def _loadable(self, path: Path) -> bool:
        if path in self.bad:
            return False
        try:
            check_checkpoint(path)
        except CheckpointError:
            return False
        return True

    def _rotate(self, saved: Path) -> None:
        """Keep ``saved`` and the newest ``keep - 1`` older checkpoints that can be loaded.

        The run's history is the line that ends at ``saved``: directories of later steps are
        from a line it left (a fallback past a bad checkpoint, a resume from an older one,
        ``--resume never``) and would otherwise be resumed by ``--resume auto`` instead of
        this run, so they go. Older ones are walked newest first: a directory that cannot be
        loaded never takes one of the ``keep`` slots, and once they are filled everything
        older goes, so the newest good checkpoints are never deleted to keep a bad one.
        """
        kept = 1
        for path in step_dirs(self.root):
            if path == saved:
                continue
            if step_of(path) > step_of(saved) or kept >= self.keep:
                shutil.rmtree(path)
            elif self._loadable(path):
                kept += 1

    def find(self, resume: str) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
        """The checkpoint ``resume`` names (``auto``: the newest here that verifies), verified
        but not loaded, so a launch can decide from its meta (its step) before building the
        model: (path or None, its meta, warnings for the log). Collective, the same on every
        rank."""
        if resume == "never":
            return None, None, []
        if resume != "auto":
            meta, problem = verify(Path(resume))
            if problem is not None:
                raise CheckpointError(
                    f"{problem}. Pass another checkpoint to --resume (or --resume auto for the "
                    "newest in --run-dir), or start over with --resume never"
                )
            return Path(resume), meta, []
        skipped: list[str] = []
        for path in broadcast_from_main(step_dirs(self.root) if self.env.is_main else None):
            meta, problem = verify(path)
            if problem is None:
                fallback = f"; resuming from the previous complete checkpoint {path} instead"
                return path, meta, ["; ".join(skipped) + fallback] if skipped else []
            self.bad.add(path)
            skipped.append(problem)
        if skipped:
            raise CheckpointError(
                f"no checkpoint in {self.root} can be resumed: {'; '.join(skipped)}. To start "
                f"over from step 0 use --resume never (or delete {self.root}); to resume from "
                "a copy, --resume PATH"
            )
        return None, None, []

    @staticmethod
    def check_compatible(path: Path, meta: dict[str, Any], cfg: Config) -> None:
        """Refuse a checkpoint of another model shape or optimizer, from its marker alone (so
        before the model is built), naming the differing fields."""
        mismatch = _model_mismatch(meta["model"], cfg)
        if mismatch:
            raise CheckpointError(
                f"{path} was saved from another model shape ({'; '.join(mismatch)}); use the "
                "same model config, another run_dir, or --resume never"
            )
        if meta["optimizer"] != cfg.optimizer:
            raise CheckpointError(
                f"{path} holds {meta['optimizer']} optimizer state but this run uses "
                f"--optimizer {cfg.optimizer}; use the same optimizer or --resume never"
            )

    def load(
        self,
        path: Path,
        meta: dict[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: Config,
    ) -> tuple[TrainState, list[str]]:
        """Load the checkpoint ``find`` returned (and ``check_compatible`` accepted) into
        ``model`` and ``optimizer``; every rank loads it or fails with the same message.
        Returns (state, warnings for the log)."""
        warnings: list[str] = []
        if meta.get("data") != self.data_position:
            warnings.append(
                f"{path} was trained with data position {meta.get('data')}, this run has "
                f"{self.data_position}: batches from here on differ from the original run's"
            )
        state = self._state(model, optimizer, TrainState())
        try:
            safe_load(state, str(path))  # metadata read with an allow-list unpickler
        except Exception as err:  # DCP raises on every rank when any rank fails
            raise CheckpointError(
                f"{path} cannot be loaded ({_one_line(err)}); resume from another checkpoint "
                "(--resume PATH) or start over with --resume never"
            ) from err
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=OPTIM_BY_NAME,
        )
        torch.set_rng_state(state["train"]["rng"])
        train = state["train"]
        return TrainState(int(train["step"]), int(train["tokens_seen"])), warnings


class GracefulStop:
    """Turns SIGINT and SIGTERM into a request to stop after the current step.

    Killing a rank mid-step would leave the others blocked in a collective and lose the work
    since the last checkpoint; instead the loop sees ``requested``, all ranks agree on it in
    the step's one all-reduce, save a checkpoint and return. Ctrl-C under torchrun reaches a
    worker twice (from the terminal, then forwarded by torchrun), so signals within
    ``REPEAT_WINDOW_S`` of the first count as one; a later one interrupts at once
    (KeyboardInterrupt). torchrun itself kills workers 30 s after forwarding a signal.
    Handlers are restored on exit; outside the main thread (where Python cannot install them)
    this does nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_WINDOW_S = 5.0

    def __init__(self) -> None:
        self.requested: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested, self._first_at = name, time.monotonic()
        elif time.monotonic() - self._first_at > self.REPEAT_WINDOW_S:
            raise KeyboardInterrupt(f"{name} again while stopping: stopping at once")
