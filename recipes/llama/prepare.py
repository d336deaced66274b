"""Tokenize local text files into a data directory for ``recipes.llama.train``:

    python -m recipes.llama.prepare --out runs/data/mybooks books/*.txt
    python -m recipes.llama.prepare --out runs/data/default --default   # the embedded corpus

then train with ``--data-dir runs/data/mybooks``. Offline: the default tokenizer is UTF-8
bytes. The last ``--val-fraction`` of each file becomes validation data.
"""

from __future__ import annotations

import argparse
import sys

from recipes.llama.data import TOKENIZERS, DataError, prepare, prepare_default, read_documents


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.llama.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("files", nargs="*", help="UTF-8 text files")
    parser.add_argument("--out", required=True, help="data directory to write")
    parser.add_argument("--default", action="store_true", help="the embedded corpus instead")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--tokenizer", choices=sorted(TOKENIZERS), default="bytes")
    args = parser.parse_args(argv)
    if args.default == bool(args.files):
        parser.error("give text files or --default (not both)")
    try:
        if args.default:
            meta = prepare_default(args.out)
        else:
            documents = read_documents(args.files)
            meta = prepare(documents, args.out, args.val_fraction, args.tokenizer)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tokens = meta["tokens"]
    print(f"{args.out}: {tokens['train']} train / {tokens['val']} val tokens ({meta['dtype']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
