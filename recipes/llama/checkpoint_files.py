"""What a complete checkpoint directory is, and checking one before anything is loaded from it.

A checkpoint is ``step_NNNNNNNN`` holding the files ``torch.distributed.checkpoint`` wrote and
``meta.json``, written last (the completion marker): the run's model shape and optimizer, and
every file's size and sha256. DCP checks neither: a truncated shard or a few flipped bytes
either load silently as wrong weights or fail deep inside ``torch.load`` on every rank with a
traceback that names neither the checkpoint nor a way out. So a checkpoint is checked before it
is loaded, in two steps: the sizes on rank 0 (a ``stat`` per file), then the digests, each rank
hashing its share of the files, so the check reads the checkpoint once over all ranks.
Checkpoints written before digests were recorded are checked by size only.

Every function taking part in a collective says so; all of them use the default process group.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from recipes.llama.data import sha256_file

__all__ = [
    "FORMAT",
    "MARKER",
    "CheckpointError",
    "broadcast_from_main",
    "check_checkpoint",
    "file_digests",
    "step_dirs",
    "step_of",
    "verify",
]

MARKER = "meta.json"
# v2 keys the optimizer state by parameter name (pipeline stages hold different groups); a v1
# checkpoint (keyed by group index) is refused by name rather than failing inside DCP.
FORMAT = "raggedfsdp-recipe-checkpoint-v2"
_INDEX_KEYED = "raggedfsdp-recipe-checkpoint-v1"
STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run (the message says why, and the fix)."""


def step_dirs(root: Path) -> list[Path]:
    """The ``step_N`` directories under ``root``, newest (highest step) first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def step_of(path: Path) -> int:
    match = STEP_DIR.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a step_NNNNNNNN directory")
    return int(match.group(1))


def _not_a_checkpoint(path: Path) -> CheckpointError:
    if not path.exists():
        return CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        return CheckpointError(f"{path} is not a directory, so not a checkpoint")
    inside = step_dirs(path) or step_dirs(path / "checkpoints")
    if inside:
        return CheckpointError(
            f"{path} is not a checkpoint but holds some: pass one of them, e.g. {inside[0]}"
        )
    return CheckpointError(
        f"{path} is not a complete checkpoint (no {MARKER}: its save was interrupted, or it "
        "was copied without it)"
    )


def check_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's meta if its marker is valid and every file has the size the save
    wrote; CheckpointError naming the directory and what is wrong otherwise. Cheap (no reads
    beyond the marker): digests are ``verify``'s."""
    marker = path / MARKER
    if not marker.is_file():
        raise _not_a_checkpoint(path)
    try:
        meta = json.loads(marker.read_text())
        if meta.get("format") == _INDEX_KEYED:
            raise CheckpointError(
                f"{path} was saved by an earlier raggedfsdp ({_INDEX_KEYED}: optimizer state keyed "
                "by group index); resume it with that version, or start over with --resume never"
            )
        files = meta["files"] if meta.get("format") == FORMAT else None
        if not isinstance(files, dict):
            raise ValueError(f"format {meta.get('format')!r}")
    except (ValueError, KeyError, AttributeError) as err:
        raise CheckpointError(f"{marker} is not a checkpoint marker ({err})") from None
    for name, size in files.items():
        actual = (path / name).stat().st_size if (path / name).is_file() else None
        if actual != size:
            raise CheckpointError(
                f"{path / name} is {'missing' if actual is None else f'{actual} bytes'} "
                f"but the save wrote {size} bytes: the checkpoint is incomplete or corrupt"
            )
    return meta


def _digest_or_none(path: Path) -> str | None:
    try:
        return sha256_file(path)
    except OSError:
        return None  # reported as a mismatch; raising here would leave the other ranks waiting


def file_digests(directory: Path, names: list[str]) -> dict[str, str | None]:
    """sha256 of every ``directory / name`` (None where it cannot be read), on every rank.

    Collective: rank r hashes ``names[r::world]``, so each rank reads 1/world of the bytes.
    ``names`` must be the same list on every rank (rank 0's listing, broadcast).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {name: _digest_or_none(directory / name) for name in names[rank::world]}
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return {name: digest for part in parts for name, digest in part.items()}


def broadcast_from_main(value: Any) -> Any:
    """Collective: rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def verify(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(meta, None) if ``path`` holds exactly what its save wrote, else (None, what is wrong).

    Collective, with the same answer on every rank: rank 0 checks the marker and the sizes,
    then every rank hashes its share of the files against the digests in the marker.
    """
    found: tuple[dict[str, Any] | None, str | None] = (None, None)
    if dist.get_rank() == 0:
        try:
            found = (check_checkpoint(path), None)
        except CheckpointError as err:
            found = (None, str(err))
    meta, problem = broadcast_from_main(found)
    if meta is None or "sha256" not in meta:
        return meta, problem
    recorded: dict[str, str] = meta["sha256"]
    digests = file_digests(path, sorted(recorded))
    changed = [name for name in sorted(recorded) if digests[name] != recorded[name]]
    if not changed:
        return meta, None
    what = ", ".join(changed)
    verb = "does" if len(changed) == 1 else "do"
    return None, (
        f"{path}: {what} {verb} not match the sha256 its save recorded: the checkpoint is corrupt"
    )
