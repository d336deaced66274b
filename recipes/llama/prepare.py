"""Tokenize a corpus into a data directory for ``recipes.llama.train``:

    python -m recipes.llama.prepare --out runs/data/books books/*.txt          # UTF-8 bytes
    python -m recipes.llama.prepare --out runs/data/web --tokenizer tokenizer.json \\
        --workers 8 fineweb/*.parquet                                          # a BPE
    python -m recipes.llama.prepare --out runs/data/default --default          # embedded stories

then train with ``--data-dir runs/data/web``. Inputs are text files (one document each), jsonl
(one document per line, its --text-field) and parquet shards (one per row, the --text-field
column), named, as globs or as directories. --tokenizer is ``bytes`` (the default), a Hugging
Face tokenizer.json or a tiktoken BPE file (Llama-3's tokenizer.model). Each document is packed
with the tokenizer's BOS (if it has one) and followed by its EOS. Every 1/--val-fraction-th
document goes to val.bin, whole. Everything is read from local files; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from recipes.llama import corpus
from recipes.llama.data import FORMAT, DataError, sha256_file, write_atomic
from recipes.llama.documents import expand, read_documents
from recipes.llama.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["main", "prepare", "prepare_default"]

CHUNK_CHARS = 1 << 20  # text per task: large enough that a task's IPC is cheap next to its BPE
WINDOW_PER_WORKER = 4  # chunks in flight per worker: bounds memory whatever the corpus size
_worker: Tokenizer | None = None  # each worker process's tokenizer (set by _init_worker)


def _chunks(texts: Iterable[str], chars: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _pack_chunk(tok: Tokenizer, dtype: np.dtype, texts: list[str]) -> tuple[np.ndarray, ...]:
    """One chunk's documents as (all their tokens, each one's length): two arrays cross the
    process boundary instead of one per document."""
    packed = tok.pack(texts)
    lengths = np.fromiter((len(p) for p in packed), dtype=np.int64, count=len(packed))
    return np.concatenate(packed).astype(dtype, copy=False), lengths


def _init_worker(tok: Tokenizer) -> None:
    global _worker
    _worker = tok


def _pack_in_worker(dtype: np.dtype, texts: list[str]) -> tuple[np.ndarray, ...]:
    assert _worker is not None
    return _pack_chunk(_worker, dtype, texts)


@contextmanager
def _one_threaded_tokenizers() -> Iterator[None]:
    """A process forked after ``tokenizers`` used its thread pool cannot use that pool (the
    library warns and turns it off in the child); with the variable set while forking, each
    worker is one-threaded from the start and nothing is printed. The parent keeps its own."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _packed(
    tok: Tokenizer, dtype: np.dtype, texts: Iterable[str], workers: int
) -> Iterator[tuple[np.ndarray, ...]]:
    """The chunks' tokens in input order. One worker is a thread, so reading the next chunk
    overlaps encoding this one (``tokenizers`` and tiktoken release the GIL and batch-encode on
    their own threads); more are forked processes. Either way chunks are submitted in order
    and at most ``WINDOW_PER_WORKER`` per worker run ahead of the writer, so the output is the
    same bytes for any ``workers`` and memory does not grow with the corpus."""
    if workers == 1:
        executor: Executor = ThreadPoolExecutor(1)
        task: Any = functools.partial(_pack_chunk, tok, dtype)
    else:
        with _one_threaded_tokenizers():
            executor = ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("fork"),  # inherit the loaded tokenizer
                initializer=_init_worker,
                initargs=(tok,),
            )
            executor.submit(int).result()  # fork every worker now, under the variable
        task = functools.partial(_pack_in_worker, dtype)
    with executor:
        pending: deque[Future] = deque()
        for chunk in _chunks(texts, CHUNK_CHARS):
            pending.append(executor.submit(task, chunk))
            if len(pending) >= workers * WINDOW_PER_WORKER:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _check_tokenizer_matches(out: Path, fingerprint: dict[str, Any], overwrite: bool) -> None:
    """One directory holds one tokenizer's tokens: preparing into a directory made with another
    would leave checkpoints, configs and notes that name it pointing at other tokens."""
    path = out / "meta.json"
    if overwrite or not path.is_file():
        return
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return  # not a meta file: nothing to mix with (it is replaced)
    same = old.get("vocab_size") == fingerprint["vocab_size"] and (
        old.get("tokenizer_sha256") == fingerprint["tokenizer_sha256"]
        if fingerprint["tokenizer_sha256"]
        else old.get("tokenizer") == fingerprint["tokenizer"]
    )
    if not same:
        raise DataError(
            f"--out {out} holds tokens of tokenizer {old.get('tokenizer')!r} (vocabulary "
            f"{old.get('vocab_size')}, sha256 {str(old.get('tokenizer_sha256'))[:12]}) and this "
            f"is {fingerprint['tokenizer']!r} (vocabulary {fingerprint['vocab_size']}, sha256 "
            f"{str(fingerprint['tokenizer_sha256'])[:12]}); one directory holds one "
            f"tokenizer's tokens: use another --out, or --overwrite to replace them"
        )


def _val_rule(val_fraction: float) -> tuple[int, int]:
    """Document i goes to validation when ``floor((i+1)·f) > floor(i·f)``: every 1/f-th
    document, decided from its index alone (no total needed, any worker count), exact in
    integers."""
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction} must be between 0 and 1 (e.g. 0.01)")
    exact = Fraction(val_fraction).limit_denominator(1 << 20)
    return exact.numerator, exact.denominator


def prepare(
    texts: Iterable[str],
    out_dir: str | Path,
    tokenizer: Tokenizer | None = None,
    val_fraction: float = 0.1,
    workers: int = 1,
    sources: Iterable[str] = (),
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Tokenize documents into ``out_dir`` (``train.bin``, ``val.bin``, ``meta.json``) and
    return the meta. The tokens go to temporary files first: bad input found half-way leaves
    the directory as it was. Then ``meta.json`` is removed, the files renamed and the new
    ``meta.json`` written last, so a directory without it is an unfinished one."""
    tok = tokenizer or ByteTokenizer()
    if workers < 1:
        raise DataError(f"--workers {workers} must be at least 1")
    num, den = _val_rule(val_fraction)
    fingerprint = tok.fingerprint()
    dtype_name = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    dtype = np.dtype(dtype_name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _check_tokenizer_matches(out, fingerprint, overwrite)
    tokens, documents = {"train": 0, "val": 0}, {"train": 0, "val": 0}
    tmp = {split: out / f".{split}.bin.{os.getpid()}.tmp" for split in tokens}
    bar = _progress_bar(progress)
    try:
        with tmp["train"].open("wb") as train, tmp["val"].open("wb") as val:
            first = 0
            for ids, lengths in _packed(tok, dtype, texts, workers):
                index = np.arange(first, first + len(lengths), dtype=np.int64)
                to_val = (index + 1) * num // den > index * num // den
                mask = np.repeat(to_val, lengths)
                train.write(ids[~mask].tobytes())
                val.write(ids[mask].tobytes())
                tokens["val"] += int(lengths[to_val].sum())
                tokens["train"] += int(lengths[~to_val].sum())
                documents["val"] += int(to_val.sum())
                first += len(lengths)
                if bar is not None:
                    bar.update(len(lengths))
                    bar.set_postfix_str(f"{tokens['train'] + tokens['val']:,} tokens")
        documents["train"] = first - documents["val"]
        if not documents["val"] or not documents["train"]:
            needed = -(-den // num)
            raise DataError(
                f"{first} document{'s' if first != 1 else ''} with --val-fraction "
                f"{val_fraction} leave {'validation' if documents['train'] else 'training'} "
                f"empty (every {den / num:g}th document is validation): give at least "
                f"{needed} documents (files, jsonl lines, parquet rows) or another --val-fraction"
            )
        (out / "meta.json").unlink(missing_ok=True)
        for split, path in tmp.items():
            os.replace(path, out / f"{split}.bin")
    finally:
        if bar is not None:
            bar.close()
        for path in tmp.values():
            path.unlink(missing_ok=True)
    meta = {
        "format": FORMAT,
        **fingerprint,
        "dtype": dtype_name,
        "tokens": tokens,
        "documents": documents,
        "val_fraction": val_fraction,
        "sha256": {split: sha256_file(out / f"{split}.bin") for split in tokens},
        "sources": list(map(str, sources)),
    }
    write_atomic(out / "meta.json", json.dumps(meta, indent=1).encode())
    return meta


def prepare_default(out_dir: str | Path) -> dict[str, Any]:
    """The embedded corpus (``recipes.llama.corpus``, one story per document) as byte tokens:
    what ``train`` prepares when its ``--data-dir`` is the default and holds no tokens."""
    return prepare(corpus.stories(), out_dir, sources=["recipes.llama.corpus"])


def _progress_bar(enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(desc="tokenizing", unit=" docs", file=sys.stderr, dynamic_ncols=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.llama.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("inputs", nargs="*", help="text, jsonl, parquet files, globs, dirs")
    parser.add_argument("--out", required=True, help="data directory to write")
    parser.add_argument("--default", action="store_true", help="the embedded stories instead")
    parser.add_argument(
        "--tokenizer", default="bytes", help="bytes | tokenizer.json | tiktoken BPE file"
    )
    parser.add_argument("--eos-token", help="a tokenizer.json's end-of-document token")
    parser.add_argument("--text-field", default="text", help="jsonl field / parquet column")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="of the documents")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--overwrite", action="store_true", help="replace another tokenizer's")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.default == bool(args.inputs):
        parser.error("give input files or --default (not both)")
    try:
        tok = load_tokenizer(args.tokenizer, args.eos_token)
        if args.default:
            sources: list[Any] = ["recipes.llama.corpus"]
            texts: Iterable[str] = corpus.stories()
        else:
            sources = expand(args.inputs)
            texts = read_documents(sources, args.text_field)
        meta = prepare(
            texts,
            args.out,
            tok,
            args.val_fraction,
            args.workers,
            sources=sources,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tokens, docs = meta["tokens"], meta["documents"]
    print(
        f"{args.out}: {tokens['train']} train / {tokens['val']} val tokens ({meta['dtype']}) "
        f"from {docs['train']} / {docs['val']} documents; tokenizer {meta['tokenizer']}, "
        f"vocabulary {meta['vocab_size']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
