"""recipes.llama data: the embedded corpus, prepare, token-file checks and rank-sliced batches."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from recipes.llama import corpus
from recipes.llama.data import TRAIN, Batches, DataError, TokenData
from recipes.llama.prepare import main as prepare_main
from recipes.llama.prepare import prepare
from recipes.llama.tokenizer import ByteTokenizer

# The default dataset's bytes: changing the generator changes the data, on purpose only.
CORPUS_SHA256 = "467aba5af51d2eabc92966d5b5270f3711fea340f63d762f84207624915bc066"


def test_embedded_corpus_is_deterministic_and_small():
    text = corpus.generate()
    data = text.encode()
    assert hashlib.sha256(data).hexdigest() == CORPUS_SHA256
    assert 500_000 < len(data) < 1_000_000
    assert text.count("\n\n") == corpus.DEFAULT_STORIES - 1
    assert text == "\n\n".join(corpus.stories()) + "\n"  # the stories are its documents


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    text = "Grüße, 世界! plain"
    ids = tok.encode(text)
    assert max(ids) < tok.vocab_size and tok.decode(ids) == text


def _prepared(tmp_path, text: str = "abcdefghi" * 10):
    out = tmp_path / "data"
    meta = prepare([text, text.upper()] * 4, out, val_fraction=0.25, sources=["a.txt"])
    return out, meta


def test_prepare_writes_nanogpt_files_and_meta(tmp_path):
    out, meta = _prepared(tmp_path)
    # 8 documents of 90 bytes + the blank line that ends each; every 4th one is validation
    assert meta["tokens"] == {"train": 552, "val": 184}
    assert meta["documents"] == {"train": 6, "val": 2}
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert bytes(train[:94].astype(np.uint8)) == b"abcdefghi" * 10 + b"\n\nAB"
    assert json.loads((out / "meta.json").read_text()) == meta
    data = TokenData.open(out, vocab_size=256, seq_len=16)
    assert len(data.train) == 552 and len(data.val) == 184


def test_prepare_command_line(tmp_path, capsys):
    for i in range(10):
        (tmp_path / f"book{i}.txt").write_text("Call me Ishmael. " * (i + 1))
    out = tmp_path / "tokens"
    assert prepare_main(["--out", str(out), "--no-progress", str(tmp_path / "book*.txt")]) == 0
    assert capsys.readouterr().out == (
        f"{out}: 783 train / 172 val tokens (uint16) from 9 / 1 documents; tokenizer bytes, "
        "vocabulary 256\n"
    )
    assert prepare_main(["--out", str(out), str(tmp_path / "nope.txt")]) == 2
    assert "nope.txt' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda d: (d / "meta.json").unlink(), "meta.json is missing"),
        (lambda d: (d / "meta.json").write_text("{not json"), "is not a raggedfsdp-tokens-v1"),
        (lambda d: (d / "val.bin").unlink(), "val.bin is missing"),
        (
            lambda d: (d / "train.bin").write_bytes((d / "train.bin").read_bytes()[:-6]),
            "truncated or corrupt",
        ),
        (
            lambda d: (d / "train.bin").write_bytes(b"\xff" * 1104),
            "does not match the sha256",
        ),
    ],
    ids=["no-meta", "bad-meta", "no-val", "truncated", "garbage"],
)
def test_missing_or_corrupt_data_is_refused(tmp_path, damage, match):
    out, _ = _prepared(tmp_path)
    damage(out)
    with pytest.raises(DataError, match=match):
        TokenData.open(out, vocab_size=256, seq_len=16)


def test_data_that_does_not_fit_the_model_is_refused(tmp_path):
    out, _ = _prepared(tmp_path)
    with pytest.raises(DataError, match=r"model.vocab_size=100: pass --model\.vocab-size 256"):
        TokenData.open(out, vocab_size=100, seq_len=16)
    with pytest.raises(DataError, match="fewer than one sequence"):
        TokenData.open(out, vocab_size=256, seq_len=600)


def test_batches_depend_on_the_step_only_and_ranks_split_the_global_batch():
    tokens = np.arange(10_000, dtype=np.uint16)
    batches = Batches(tokens, seq_len=8, batch_size=12, seed=1, split=TRAIN)
    x1, y1 = batches.local(5, rank=0, world=1, micro=0, accum=1)
    assert torch.equal(y1[:, :-1], x1[:, 1:]) and x1.shape == (12, 8)
    for world, accum in ((2, 3), (3, 2), (4, 1), (6, 2)):
        parts = [
            batches.local(5, rank, world, micro, accum)[0]
            for rank in range(world)
            for micro in range(accum)
        ]
        assert torch.equal(torch.cat(parts), x1), (world, accum)  # same rows at any W
    assert not torch.equal(batches.local(6, 0, 1)[0], x1)
    again = Batches(tokens, seq_len=8, batch_size=12, seed=1, split=TRAIN)
    assert torch.equal(again.local(5, 0, 1)[0], x1)
