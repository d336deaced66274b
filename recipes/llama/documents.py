"""The documents of a corpus, read one at a time from text, jsonl and parquet files.

``expand`` turns the command line's inputs (files, globs, directories) into files in a fixed
order; ``read_documents`` yields the text of their documents in that order: a text
file is one document, a jsonl line one (its ``text_field``), a parquet row one (its
``text_field`` column). Parquet shards are read one row group at a time and jsonl one line at a
time, so memory holds a row group or a line, never a shard (FineWeb's are 2 GB). Empty and null
texts are skipped: a document of no text would train on nothing but its separators.
"""

from __future__ import annotations

import glob
import gzip
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from recipes.llama.data import DataError

__all__ = ["SUFFIXES", "expand", "read_documents"]

# What a directory contributes (anything else in it, such as a README or a checksum, is left
# out); a file named on the command line is read whatever its suffix (as text unless jsonl or
# parquet).
SUFFIXES = (".txt", ".md", ".jsonl", ".ndjson", ".parquet", ".txt.gz", ".jsonl.gz")
JSONL = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    return "jsonl" if name.endswith(JSONL) else "text"


def expand(inputs: Iterable[str]) -> list[Path]:
    """Files in command-line order; a directory's files (recursively) and a glob's matches in
    sorted order, so the same inputs give the same documents in the same order anywhere."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(SUFFIXES)
            )
            if not found:
                raise DataError(
                    f"input directory {item!r} holds no {', '.join(SUFFIXES)} files; name "
                    f"the files instead"
                )
            files += found
        elif glob.has_magic(item):
            matches = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
            if not matches:
                raise DataError(f"input pattern {item!r} matches no file; check the pattern")
            files += matches
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"input file {item!r} does not exist")
    return files


def _open_text(path: Path) -> IO[str]:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _text_file(path: Path) -> Iterator[str]:
    try:
        with _open_text(path) as f:
            yield f.read()
    except UnicodeDecodeError as err:
        raise DataError(f"input file {str(path)!r} is not UTF-8 text: {err}") from None


def _jsonl(path: Path, field: str) -> Iterator[str]:
    try:
        with _open_text(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise DataError(
                        f"{path} line {number} is not JSON ({err}); fix or remove it"
                    ) from None
                if not isinstance(record, dict) or field not in record:
                    keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(
                        f"{path} line {number} has no {field!r} field (it has: {keys}); pass "
                        f"--text-field NAME"
                    )
                text = record[field]
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise DataError(
                        f"{path} line {number}: {field!r} is a {type(text).__name__}, not text; "
                        f"pass the --text-field that holds the document"
                    )
                if text:
                    yield text
    except UnicodeDecodeError as err:
        raise DataError(f"input file {str(path)!r} is not UTF-8 text: {err}") from None


def _parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        shard = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(
            f"{path} is not a parquet file ({err}); remove it from the inputs"
        ) from None
    columns = shard.schema_arrow.names
    if field not in columns:
        raise DataError(
            f"{path} has no column {field!r} (its columns: {', '.join(columns)}); pass "
            f"--text-field NAME"
        )
    kind = shard.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(
            f"{path}: column {field!r} is {kind}, not text; pass the --text-field that holds "
            f"the document"
        )
    for group in range(shard.num_row_groups):
        for text in shard.read_row_group(group, columns=[field]).column(0).to_pylist():
            if text:
                yield text


def read_documents(files: Iterable[Path], text_field: str = "text") -> Iterator[str]:
    """The text of every document of ``files``, in order."""
    for path in files:
        kind = _kind(path)
        if kind == "parquet":
            yield from _parquet(path, text_field)
        elif kind == "jsonl":
            yield from _jsonl(path, text_field)
        else:
            yield from _text_file(path)
