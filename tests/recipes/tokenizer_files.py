"""Tokenizer and corpus files the prepare tests write themselves (nothing is downloaded): a
byte-level BPE trained with ``tokenizers`` on the embedded stories, written as tokenizer.json,
the same ranks as a tiktoken BPE file, and the stories as jsonl and parquet shards."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from recipes.llama import corpus

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def train_bpe(vocab_size: int = 1000, bos: bool = True, stories: int = 300):
    """A GPT-2-style byte-level BPE on the first ``stories`` stories; with ``bos`` its
    post-processor starts every document with BOS, as Llama-3's tokenizer.json does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.stories(stories), trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
        )
    return tok


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character of each byte, inverted (tokenizers' ByteLevel)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def write_tiktoken(tok, path: Path) -> Path:
    """The BPE's tokens as a tiktoken file (base64 bytes, rank), ranks in the BPE's merge order
    and renumbered from 0 so that Llama-3's special tokens follow them."""
    decoder = _byte_decoder()
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    vocab = sorted((i, t) for t, i in tok.get_vocab().items() if t not in specials)
    lines = [
        f"{base64.b64encode(bytes(decoder[c] for c in token)).decode()} {rank}"
        for rank, (_, token) in enumerate(vocab)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)))
    return path


def write_parquet(path: Path, texts: list[str], field: str = "text", row_group: int = 50) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(texts))), field: texts})
    pq.write_table(table, path, row_group_size=row_group)
    return path
