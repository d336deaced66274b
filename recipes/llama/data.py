"""Token files (nanoGPT's format plus a meta file) and deterministic, rank-sliced batches.

A data directory holds ``train.bin`` and ``val.bin`` (flat little-endian ``uint16`` tokens, or
``uint32`` for vocabularies over 65,536) and ``meta.json`` (tokenizer, vocabulary size, dtype,
token counts, sha256 of each file). ``prepare`` writes them from text files; ``TokenData.open``
memory-maps them after checking that they are what ``meta.json`` says, so a missing, truncated
or foreign file fails with a message that says what to do instead of training on garbage.

Batches are a function of ``(seed, step)`` alone: the starts of step s's sequences come from
``numpy.random.default_rng([seed, split, s])``, and each rank reads only its rows of that global
batch. Resuming at step s therefore continues with exactly the batches a straight run would have
seen, at any world size, with nothing but the step to store.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recipes.llama import corpus

__all__ = [
    "DEFAULT_DATA_DIR",
    "Batches",
    "ByteTokenizer",
    "DataError",
    "TokenData",
    "prepare",
    "prepare_default",
    "sha256_file",
]

DEFAULT_DATA_DIR = "runs/data/default"
FORMAT = "raggedfsdp-tokens-v1"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
CHECKSUM_LIMIT_BYTES = 256 << 20  # larger files get size and range checks only (fast starts)
RANGE_CHECK_TOKENS = 1 << 22
TRAIN, VAL = 0, 1  # seeds the split's batch stream


class DataError(ValueError):
    """A data directory that cannot be used as it is (the message says how to fix it)."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, works offline, needs no training."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, tokens: Iterable[int]) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


TOKENIZERS = {ByteTokenizer.name: ByteTokenizer}


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 1 MiB chunks (data files and checkpoint files alike)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def prepare(
    documents: Iterable[tuple[str, str]],
    out_dir: str | Path,
    val_fraction: float = 0.1,
    tokenizer: str = "bytes",
) -> dict[str, Any]:
    """Tokenize ``(name, text)`` documents into ``out_dir``; the last ``val_fraction`` of each
    document goes to validation. ``meta.json`` is written last, so a directory without it is
    an unfinished one. Returns the meta."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} must be between 0 and 1")
    if tokenizer not in TOKENIZERS:
        raise DataError(f"unknown tokenizer {tokenizer!r}; available: {', '.join(TOKENIZERS)}")
    tok = TOKENIZERS[tokenizer]()
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    counts, sources = {"train": 0, "val": 0}, []
    tmp = {split: out / f".{split}.bin.{os.getpid()}.tmp" for split in counts}
    with tmp["train"].open("wb") as train, tmp["val"].open("wb") as val:
        for name, text in documents:
            tokens = tok.encode(text).astype(DTYPES[dtype])
            cut = len(tokens) - int(len(tokens) * val_fraction)
            train.write(tokens[:cut].tobytes())
            val.write(tokens[cut:].tobytes())
            counts["train"] += cut
            counts["val"] += len(tokens) - cut
            sources.append(name)
    for split, path in tmp.items():
        os.replace(path, out / f"{split}.bin")
    meta = {
        "format": FORMAT,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "tokens": counts,
        "sha256": {split: sha256_file(out / f"{split}.bin") for split in counts},
        "sources": sources,
    }
    _write_atomic(out / "meta.json", json.dumps(meta, indent=1).encode())
    return meta


def read_documents(paths: Iterable[str | Path]) -> Iterable[tuple[str, str]]:
    """Text files as ``(path, text)``, one at a time (memory holds one file)."""
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"input file {str(path)!r} does not exist")
        try:
            yield str(path), path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"input file {str(path)!r} is not UTF-8 text: {err}") from None


def prepare_default(out_dir: str | Path) -> dict[str, Any]:
    """The embedded corpus (``recipes.llama.corpus``) as token files."""
    return prepare([("recipes.llama.corpus", corpus.generate())], out_dir)


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
                f"{root} was tokenized with a {meta['vocab_size']}-token vocabulary but the "
                f"model has model.vocab_size={vocab_size}; raise model.vocab_size"
            )
        splits = {split: _map(root, split, meta, seq_len) for split in ("train", "val")}
        return cls(splits["train"], splits["val"], meta)


def _read_meta(root: Path) -> dict[str, Any]:
    path = root / "meta.json"
    if not path.is_file():
        raise DataError(
            f"no token files in {str(root)!r} (meta.json is missing): run "
            f"`python -m recipes.llama.prepare --out {root} FILE...`, or use the default "
            f"data_dir ({DEFAULT_DATA_DIR}), which is prepared from the embedded corpus"
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
