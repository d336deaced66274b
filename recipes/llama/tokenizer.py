"""The tokenizers ``recipes.llama.prepare`` can use: UTF-8 bytes (the default, nothing to load),
a Hugging Face ``tokenizer.json`` (through ``tokenizers``) or a tiktoken BPE file such as
Llama-3's ``tokenizer.model`` (through ``tiktoken``, with Meta's split pattern and special
tokens). All three read local files only.

Each one packs a document the way its authors pretrain with it: ``pack`` returns, per document,
the tokenizer's own start-of-document tokens (a Hugging Face post-processor's BOS; Llama-3's
``<|begin_of_text|>``), the text's tokens, and one end-of-document separator, so documents
concatenated in ``train.bin`` are separated by EOS. ``fingerprint`` is what ``meta.json``
records, so that a directory never mixes the tokens of two tokenizers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from recipes.llama.data import DataError, sha256_file

__all__ = [
    "LLAMA3_PATTERN",
    "ByteTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "llama3_special_tokens",
    "load_tokenizer",
]

# Meta's Llama-3 tokenizer (llama/tokenizer.py): the pre-tokenizer's split pattern, and 256
# special tokens after the mergeable ranks.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIAL_TOKENS = 256
# End-of-document tokens of common tokenizer.json files, tried in order when the tokenizer has
# no tokenizer_config.json beside it (Llama-3, GPT-2/Qwen, Llama-2/Mistral, Gemma).
KNOWN_EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
HELP = (
    "give a Hugging Face tokenizer.json (or its directory), a tiktoken BPE file "
    "(base64 token and rank per line, e.g. Llama-3's tokenizer.model) or bytes"
)


class Tokenizer(Protocol):
    """What ``prepare`` needs of a tokenizer; ``pack`` is the only method on the hot path."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def pack(self, texts: list[str]) -> list[np.ndarray]: ...

    def fingerprint(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, works offline, needs no file. With no id left for
    an EOS token, a blank line (two newline bytes) ends each document."""

    name = "bytes"
    vocab_size = 256
    separator = b"\n\n"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(t) for t in ids).decode("utf-8", errors="replace")

    def pack(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8") + self.separator, np.uint8) for t in texts]

    def fingerprint(self) -> dict[str, Any]:
        return {
            "tokenizer": self.name,
            "tokenizer_sha256": None,
            "vocab_size": self.vocab_size,
            "bos_ids": [],
            "eos_ids": list(self.separator),
            "special_tokens": {},
        }


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``. Its post-processor decides what starts (and may end) a
    document; EOS comes from ``--eos-token``, a ``tokenizer_config.json`` beside the file, or
    the first of ``KNOWN_EOS`` it defines. Truncation and padding a file may carry are turned
    off (they would cut documents), and special-token text inside a document is encoded as
    text, so a document cannot forge an EOS."""

    def __init__(self, path: Path, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.path, self.sha256 = path, sha256_file(path)
        try:
            self.tok = RustTokenizer.from_file(str(path))
        except Exception as err:  # the library raises plain Exception on a bad file
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(
                f"--tokenizer {path} does not load as a tokenizer.json ({first}); {HELP}"
            ) from None
        self.tok.no_truncation()
        self.tok.no_padding()
        self.tok.encode_special_tokens = True
        self.name = path.name
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1
        self.special_tokens = {
            t.content: i for i, t in self.tok.get_added_tokens_decoder().items() if t.special
        }
        self.eos_id = self._eos_id(eos_token)
        template = self.tok.encode("").ids  # what the post-processor adds to every document
        self.bos_ids = template[:-1] if template[-1:] == [self.eos_id] else template
        self._encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)

    def _eos_id(self, eos_token: str | None) -> int:
        if eos_token is None:
            eos_token = _config_eos(self.path.with_name("tokenizer_config.json"))
        candidates = [eos_token] if eos_token is not None else KNOWN_EOS
        for token in candidates:
            if (found := self.tok.token_to_id(token)) is not None:
                return found
        specials = ", ".join(sorted(self.special_tokens)[:8]) or "none"
        if eos_token is not None:
            raise DataError(
                f"--eos-token {eos_token!r} is not a token of {self.path} (its special tokens: "
                f"{specials}); pass one of them"
            )
        raise DataError(
            f"{self.path} names no end-of-document token (no tokenizer_config.json beside it "
            f"and none of {', '.join(KNOWN_EOS)}; its special tokens: {specials}): pass "
            f"--eos-token TOKEN"
        )

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def pack(self, texts: list[str]) -> list[np.ndarray]:
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        packed = []
        for encoding in self._encode(texts, add_special_tokens=True):
            ids = encoding.ids
            if not ids or ids[-1] != self.eos_id:
                ids.append(self.eos_id)
            packed.append(np.array(ids, dtype=dtype))
        return packed

    def fingerprint(self) -> dict[str, Any]:
        return {
            "tokenizer": self.name,
            "tokenizer_sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "bos_ids": list(self.bos_ids),
            "eos_ids": [self.eos_id],
            "special_tokens": self.special_tokens,
        }


def _config_eos(path: Path) -> str | None:
    """``eos_token`` of a Hugging Face ``tokenizer_config.json`` (a string or an AddedToken)."""
    if not path.is_file():
        return None
    try:
        eos = json.loads(path.read_text()).get("eos_token")
    except (ValueError, AttributeError):
        raise DataError(f"{path} is not JSON; fix it, or pass --eos-token TOKEN") from None
    return eos.get("content") if isinstance(eos, dict) else eos


def llama3_special_tokens(n_ranks: int) -> dict[str, int]:
    """Meta's Llama-3 special tokens, numbered after the ``n_ranks`` mergeable ranks."""
    names = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    names += [f"<|reserved_special_token_{i}|>" for i in range(5, LLAMA3_SPECIAL_TOKENS - 5)]
    return {name: n_ranks + i for i, name in enumerate(names)}


class TiktokenTokenizer:
    """A tiktoken BPE file read as Llama-3's tokenizer: Meta's split pattern, its 256 special
    tokens after the ranks, and ``<|begin_of_text|>`` ... ``<|end_of_text|>`` around each
    document (as Meta's ``encode(bos=True, eos=True)``). Text is encoded as ordinary text:
    special-token strings inside a document are not special."""

    def __init__(self, path: Path) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.path, self.sha256 = path, sha256_file(path)
        try:
            # expected_hash: tiktoken caches files by path; a changed file must not be served
            # from that cache
            ranks = load_tiktoken_bpe(str(path), expected_hash=self.sha256)
        except (ValueError, UnicodeDecodeError) as err:
            first = str(err).splitlines()[0][:120]
            raise DataError(
                f"--tokenizer {path} does not load as a tiktoken BPE file ({first}); {HELP}"
            ) from None
        if not ranks:
            raise DataError(f"--tokenizer {path} holds no BPE ranks; {HELP}")
        self.special_tokens = llama3_special_tokens(len(ranks))
        self.enc = tiktoken.Encoding(
            name=path.name,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.name, self.vocab_size = path.name, self.enc.n_vocab
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.first_special = len(ranks)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode([int(i) for i in ids if i < self.first_special])

    def pack(self, texts: list[str]) -> list[np.ndarray]:
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        return [
            np.array([self.bos_id, *ids, self.eos_id], dtype=dtype)
            for ids in self.enc.encode_ordinary_batch(texts)
        ]

    def fingerprint(self) -> dict[str, Any]:
        return {
            "tokenizer": self.name,
            "tokenizer_sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "bos_ids": [self.bos_id],
            "eos_ids": [self.eos_id],
            "special_tokens": self.special_tokens,
        }


def load_tokenizer(spec: str = "bytes", eos_token: str | None = None) -> Tokenizer:
    """``bytes``, a ``tokenizer.json`` (or a directory holding one), or a tiktoken BPE file:
    a ``.json`` file is read as Hugging Face's, anything else as tiktoken's."""
    if spec == ByteTokenizer.name:
        if eos_token is not None:
            raise DataError("--eos-token needs --tokenizer PATH (bytes end documents by \\n\\n)")
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"--tokenizer {spec}: no such file; {HELP}")
    if path.suffix == ".json":
        return HFTokenizer(path, eos_token)
    if eos_token is not None:
        raise DataError("--eos-token applies to a tokenizer.json (tiktoken files end with EOS)")
    if _looks_binary(path):
        raise DataError(
            f"--tokenizer {path} is not text (a SentencePiece model?): convert it to a "
            f"tokenizer.json; {HELP}"
        )
    return TiktokenTokenizer(path)


def _looks_binary(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" in f.read(4096)
