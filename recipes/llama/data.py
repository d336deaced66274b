"""Token files (nanoGPT's format plus a meta file) and deterministic, rank-sliced batches.

A data directory holds ``train.bin`` and ``val.bin`` (flat little-endian ``uint16`` tokens, or
``uint32`` for vocabularies over 65,536) and ``meta.json`` (the tokenizer's name, sha256,
vocabulary size and special tokens, dtype, token and document counts, sha256 of each file).
``recipes.llama.prepare`` writes them from documents; ``TokenData.open`` memory-maps them after
checking that they are what ``meta.json`` says and that the model's vocabulary covers the
data's, so a missing, truncated or foreign file fails with a message that says what to do
instead of training on garbage.

Batches are a function of ``(seed, step)`` alone: the starts of step s's sequences come from
``numpy.random.default_rng([seed, split, s])``, and each rank reads only its rows of that global
batch. Resuming at step s therefore continues with exactly the batches a straight run would have
seen, at any world size, with nothing but the step to store.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "DEFAULT_DATA_DIR",
    "Batches",
    "DataError",
    "TokenData",
    "sha256_file",
    "write_atomic",
]

DEFAULT_DATA_DIR = "runs/data/default"
FORMAT = "raggedfsdp-tokens-v1"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
CHECKSUM_LIMIT_BYTES = 256 << 20  # larger files get size and range checks only (fast starts)
RANGE_CHECK_TOKENS = 1 << 22
TRAIN, VAL = 0, 1  # seeds the split's batch stream


class DataError(ValueError):
    """A data directory that cannot be used as it is (the message says how to fix it)."""


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 1 MiB chunks (data files and checkpoint files alike)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: readers see the old
    file or the new one, never part of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass
class TokenData:
    """Memory-mapped train and validation tokens of one data directory."""

    train: np.ndarray
    val: np.ndarray
    meta: dict[str, Any]

    @classmethod
    def open(cls, data_dir: str | Path, vocab_size: int, seq_len: int) -> TokenData:
        """Map the files after checking them against ``meta.json`` and the model."""
        root = Path(data_dir)
        meta = _read_meta(root)
        if meta["vocab_size"] > vocab_size:
            raise DataError(
                f"{root} holds tokens of {meta.get('tokenizer', 'a tokenizer')} with a "
                f"{meta['vocab_size']}-token vocabulary but the model's embedding has "
                f"model.vocab_size={vocab_size}: pass --model.vocab-size {meta['vocab_size']} "
                f"(or more) or a --config preset whose vocabulary covers it"
            )
        splits = {split: _map(root, split, meta, seq_len) for split in ("train", "val")}
        return cls(splits["train"], splits["val"], meta)


def _read_meta(root: Path) -> dict[str, Any]:
    path = root / "meta.json"
    if not path.is_file():
        raise DataError(
            f"no token files in {str(root)!r} (meta.json is missing): run `python -m "
            f"recipes.llama.prepare --out {root} --tokenizer TOKENIZER FILE...` (text, jsonl "
            f"or parquet; TOKENIZER a tokenizer.json or tiktoken file whose vocabulary the "
            f"model's covers), or use the default data_dir ({DEFAULT_DATA_DIR}), prepared "
            f"from the embedded corpus"
        )
    try:
        meta = json.loads(path.read_text())
        if meta.get("format") != FORMAT or meta["dtype"] not in DTYPES:
            raise ValueError(f"format {meta.get('format')!r}, dtype {meta.get('dtype')!r}")
        if not all(int(meta["tokens"][s]) >= 0 and meta["sha256"][s] for s in ("train", "val")):
            raise ValueError("token counts and checksums of train and val are required")
        meta["vocab_size"] = int(meta["vocab_size"])
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path} is not a {FORMAT} meta file ({err}); prepare again") from None
    return meta


def _map(root: Path, split: str, meta: dict[str, Any], seq_len: int) -> np.ndarray:
    path, dtype = root / f"{split}.bin", np.dtype(DTYPES[meta["dtype"]])
    count = int(meta["tokens"][split])
    again = f"prepare the data again (python -m recipes.llama.prepare --out {root} ...)"
    if not path.is_file():
        raise DataError(f"{path} is missing; {again}")
    size = path.stat().st_size
    if size != count * dtype.itemsize:
        raise DataError(
            f"{path} has {size} bytes but meta.json lists {count} {meta['dtype']} tokens "
            f"({count * dtype.itemsize} bytes): the file is truncated or corrupt; {again}"
        )
    if size <= CHECKSUM_LIMIT_BYTES and sha256_file(path) != meta["sha256"][split]:
        raise DataError(f"{path} does not match the sha256 in meta.json (corrupt); {again}")
    if count < seq_len + 1:
        raise DataError(
            f"{path} has {count} tokens, fewer than one sequence of seq_len + 1 = {seq_len + 1}"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if int(tokens[:RANGE_CHECK_TOKENS].max()) >= meta["vocab_size"]:
        raise DataError(f"{path} holds token ids >= vocab_size {meta['vocab_size']}; {again}")
    return tokens


class Batches:
    """The global batches of one split, each a pure function of ``(seed, index)``.

    ``local(index, rank, world, micro, accum)`` returns this rank's micro-batch: the global batch
    is cut into ``world`` contiguous blocks of rows, one per rank, and each block into ``accum``
    micro-batches. Any world size sees the same global batch.
    """

    def __init__(
        self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, split: int
    ) -> None:
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.split = seed, split

    def starts(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.split, index])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def local(
        self, index: int, rank: int, world: int, micro: int = 0, accum: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape ``(batch_size / (world·accum), seq_len)``."""
        rows = self.batch_size // (world * accum)
        first = (rank * accum + micro) * rows
        windows = np.stack(
            [self.tokens[s : s + self.seq_len + 1] for s in self.starts(index)[first:][:rows]]
        )
        seqs = torch.from_numpy(windows.astype(np.int64))
        return seqs[:, :-1], seqs[:, 1:]
