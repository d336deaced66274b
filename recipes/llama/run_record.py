"""What a run directory says about the run in it besides its checkpoints: that it finished.

Checkpoints alone cannot say it: with ``--checkpoint-every 0`` a run that reaches ``--steps``
writes none at the end, so its newest checkpoint can be an old one (from a Ctrl-C), and the
next ``--resume auto`` would train again from there and rewrite the finished run's metrics,
summary and plot. So a run that reaches ``--steps`` writes ``finished.json`` (the step, and
the checkpoint of that step or null), and the next launch with ``--resume auto`` honours it:

* ``--steps`` not above the finished step: nothing to train, said in one line, before
  anything is built;
* more ``--steps``: the run continues from its checkpoint of the finished step. When it has
  none (``--checkpoint-every 0``, or the directory was deleted), resuming an older one would
  silently train again steps the finished run already did, so the launch stops with one line
  naming the ways on (``--resume PATH`` of that older checkpoint, ``--resume never``, another
  ``--run-dir``). A checkpoint of the finished step that fails verification is handled as any
  damaged checkpoint: ``--resume auto`` falls back to an older one and says so.

A launch that trains deletes the marker before its first step and writes it again when it
reaches ``--steps``, so a launch that is stopped or crashes never leaves a marker claiming
more than the checkpoints hold. The marker names the model and optimizer: a launch with
another one is not told "nothing to train" but goes on to the checkpoint checks, which refuse
it naming what differs. ``--resume never`` and ``--resume PATH`` start where they are
told; the marker does not apply to them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from recipes.llama.checkpoint_files import CheckpointError, broadcast_from_main
from recipes.llama.config import Config

__all__ = ["MARKER", "Finished", "clear_finished", "mark_finished", "read_finished"]

MARKER = "finished.json"


@dataclass(frozen=True)
class Finished:
    """A run that reached its ``--steps``: the step, the checkpoint of that step (None:
    ``--checkpoint-every 0`` wrote none at the end), and the model and optimizer it trained,
    which tell a re-run of it from another run started in the same directory."""

    step: int
    checkpoint: str | None
    model: dict[str, Any]
    optimizer: str

    @classmethod
    def of(cls, cfg: Config, step: int, checkpoint: str | None) -> Finished:
        return cls(step, checkpoint, asdict(cfg.model), cfg.optimizer)

    def same_run(self, cfg: Config) -> bool:
        """Whether ``cfg`` trains the model and optimizer that finished here. Another one is
        not told "nothing to train": it goes on to the checkpoint checks, which name what
        differs."""
        return self.model == asdict(cfg.model) and self.optimizer == cfg.optimizer

    def nothing_to_train(self, run_dir: str, steps: int) -> str:
        """The one line a launch that has nothing to do prints instead of training."""
        if self.checkpoint is None:
            how = (
                f"it wrote no checkpoint of step {self.step} (--checkpoint-every 0), so it "
                "cannot continue; to train longer, start a new run with another --run-dir"
            )
        else:
            how = f"raise --steps to continue from {self.checkpoint}"
        return f"{run_dir} finished at step {self.step} (--steps {steps}): nothing to train; {how}"

    def check_continues(
        self, run_dir: str, steps: int, start: Path | None, step: int, damaged: bool
    ) -> None:
        """Refuse to continue this finished run to ``steps`` from ``start``, a checkpoint of a
        step before the one it finished at (None, 0: no checkpoint at all): that would train
        its last steps again, which ``--resume auto`` must not decide on its own when the run
        has no checkpoint of its last step. ``damaged``: it has one, but it failed
        verification; then the usual fallback to an older one applies (and was warned about).
        """
        if step >= self.step or damaged:
            return
        why = (
            "wrote no checkpoint of that step (--checkpoint-every 0)"
            if self.checkpoint is None
            else f"its checkpoint of that step, {self.checkpoint}, is gone"
        )
        restart = "start over with --resume never"
        if start is not None:
            older = f"train again from its step-{step} checkpoint with --resume {start}"
            restart = f"{older}, or {restart}"
        raise CheckpointError(
            f"{run_dir} finished at step {self.step} but {why}, so it cannot continue to "
            f"--steps {steps}. To {restart} (the metrics rows a restart replaces move to "
            "metrics.superseded.jsonl), or use another --run-dir"
        )


def read_finished(run_dir: Path) -> Finished | None:
    """The run's marker, or None when it has not finished. Collective: rank 0 reads it and
    every rank gets its answer (or its error), so all ranks decide alike (``run_dir`` must be
    on a filesystem every node sees, as for checkpoints)."""
    found: tuple[Finished | None, str | None] = (None, None)
    if dist.get_rank() == 0:
        found = _read(run_dir / MARKER)
    finished, problem = broadcast_from_main(found)
    if problem is not None:
        raise CheckpointError(problem)
    return finished


def mark_finished(run_dir: Path, finished: Finished) -> None:
    """Write the marker (rank 0, after the summary): to a temporary name, then renamed, so a
    crash never leaves half a marker."""
    tmp = run_dir / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(asdict(finished), indent=1))
    os.replace(tmp, run_dir / MARKER)


def clear_finished(run_dir: Path) -> None:
    """Delete the marker (rank 0, before a launch trains its first step)."""
    (run_dir / MARKER).unlink(missing_ok=True)


def _read(path: Path) -> tuple[Finished | None, str | None]:
    """(marker or None, None), or (None, the one-line error) for a file that is no marker."""
    if not path.is_file():
        return None, None
    try:
        record = json.loads(path.read_text())
        finished = Finished(
            int(record["step"]), record["checkpoint"], record["model"], record["optimizer"]
        )
        return finished, None
    except (ValueError, KeyError, TypeError) as err:
        return None, f"{path} is not a finished-run marker ({err!r}): delete it and run again"
