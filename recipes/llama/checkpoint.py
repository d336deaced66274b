"""Atomic DCP checkpoints, resumable at any world size, and stopping cleanly on a signal.

A checkpoint is a directory ``step_NNNNNNNN`` written by ``torch.distributed.checkpoint``: every
rank saves its own shards (no gathering), so it loads at any other world size. It holds the
model, the optimizer state, the step, the tokens seen and the RNG state; the data position is
the step itself (batches are a function of it, see ``data.Batches``).

Saving is atomic: all ranks write into ``step_N.tmp``, then rank 0 writes ``meta.json`` (the
completion marker: model shape, optimizer, the size of every file) and renames the directory.
A crash at any point leaves either a ``.tmp`` directory, which is never loaded, or a complete
checkpoint; ``meta.json`` is checked on load too, so a directory that was copied partially or
truncated is refused rather than half-loaded. Multi-node runs need ``run_dir`` on a filesystem
that every node sees.
"""

from __future__ import annotations

import json
import os
import re
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from raggedfsdp.checkpoint import load as safe_load
from recipes.llama.config import Config
from recipes.llama.parallel import Env

__all__ = ["CheckpointError", "Checkpointer", "GracefulStop", "TrainState", "check_checkpoint"]

MARKER = "meta.json"
FORMAT = "raggedfsdp-recipe-checkpoint-v1"
STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run (the message says why)."""


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


def check_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's meta, or CheckpointError if it is not complete."""
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {MARKER}: the save was interrupted)"
        )
    try:
        meta = json.loads(marker.read_text())
        files = meta["files"] if meta.get("format") == FORMAT else None
        if not isinstance(files, dict):
            raise ValueError(f"format {meta.get('format')!r}")
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"{marker} is not a checkpoint marker ({err})") from None
    for name, size in files.items():
        actual = (path / name).stat().st_size if (path / name).is_file() else None
        if actual != size:
            raise CheckpointError(
                f"{path / name} is {'missing' if actual is None else f'{actual} bytes'} "
                f"but the checkpoint wrote {size} bytes: it is incomplete or corrupt"
            )
    return meta


def _model_mismatch(saved: dict[str, Any], cfg: Config) -> list[str]:
    ours = asdict(cfg.model)
    return [
        f"model.{key}: checkpoint {saved.get(key)!r}, this run {value!r}"
        for key, value in ours.items()
        if saved.get(key) != value
    ]


class Checkpointer:
    """Saves and finds the checkpoints under ``root``; every method is collective.

    ``data_position`` (seed and data fingerprint) is stored with the step: together they
    determine every later batch, and a resume that changes them is warned about.
    """

    def __init__(self, root: Path, env: Env, keep: int, data_position: dict[str, Any]) -> None:
        self.root, self.env, self.keep = root, env, max(1, keep)
        self.data_position = data_position

    def _state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, train: TrainState
    ) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
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
                "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir())},
            }
            with (tmp / MARKER).open("w") as f:  # on disk before the rename publishes it
                f.write(json.dumps(meta, indent=1))
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():  # the same step saved again after a resume
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        dist.barrier()
        return final

    def _prune(self) -> None:
        complete = [p for p in self._candidates() if (p / MARKER).is_file()]
        for old in complete[self.keep :]:
            shutil.rmtree(old)

    def _candidates(self) -> list[Path]:
        """``step_N`` directories, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def _choose(self, resume: str) -> tuple[str | None, dict[str, Any] | None, list[str]]:
        """(checkpoint to load or None, its meta, warnings) as rank 0 sees the filesystem."""
        if resume == "never":
            return None, None, []
        if resume != "auto":
            return resume, check_checkpoint(Path(resume)), []
        warnings = []
        for path in self._candidates():
            try:
                return str(path), check_checkpoint(path), warnings
            except CheckpointError as err:
                warnings.append(f"skipping {path}: {err}")
        return None, None, warnings

    def resume(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config
    ) -> tuple[TrainState, str | None, list[str]]:
        """Load the checkpoint ``cfg.resume`` names (``auto``: the newest complete one here).

        Rank 0 decides and tells the others, so every rank loads the same checkpoint or fails
        with the same message. Returns (state, loaded path or None, warnings).
        """
        decision: list[Any] = [None]
        if self.env.is_main:
            try:
                decision[0] = ("ok", *self._choose(cfg.resume))
            except CheckpointError as err:
                decision[0] = ("error", str(err), None, [])
        dist.broadcast_object_list(decision, src=0)
        kind, path, meta, warnings = decision[0]
        if kind == "error":
            raise CheckpointError(path)
        if path is None:
            return TrainState(), None, warnings
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
        if meta.get("data") != self.data_position:
            warnings.append(
                f"{path} was trained with data position {meta.get('data')}, this run has "
                f"{self.data_position}: batches from here on differ from the original run's"
            )
        state = self._state(model, optimizer, TrainState())
        safe_load(state, str(path))  # metadata read with an allow-list unpickler
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        torch.set_rng_state(state["train"]["rng"])
        train = state["train"]
        return TrainState(int(train["step"]), int(train["tokens_seen"])), path, warnings


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
