"""recipes.llama.prepare with real tokenizers and document datasets, all offline: a BPE trained
here (tokenizer.json and the same ranks as a tiktoken file), jsonl and parquet fixtures, round
trips, packing with BOS/EOS, the split by documents, byte-identical output at any --workers,
uint32 tokens, and a few training steps on the prepared data."""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from recipes.llama import corpus
from recipes.llama import prepare as prepare_module
from recipes.llama.data import TokenData
from recipes.llama.documents import expand, read_documents
from recipes.llama.prepare import main, prepare
from recipes.llama.tokenizer import LLAMA3_SPECIAL_TOKENS, load_tokenizer
from tests.recipes.tokenizer_files import BOS, EOS, write_jsonl, write_parquet
from tests.support.recipe_runs import args, run_train

STORIES = corpus.stories(200)
TRICKY = ["Grüße, 世界! 🎉", "a literal <|end_of_text|> stays text", "  spaces\n\n\ttabs  \r\n"]


def _documents(tokens: np.ndarray, eos: int, bos: int | None) -> list[np.ndarray]:
    """Packed tokens cut at each EOS, with the BOS each document starts with checked and cut."""
    ends = np.flatnonzero(tokens == eos)
    assert ends[-1] == len(tokens) - 1  # the last document ends with EOS too
    pieces = np.split(tokens, ends + 1)[:-1]
    if bos is not None:
        assert all(p[0] == bos for p in pieces)
        pieces = [p[1:] for p in pieces]
    return [p[:-1] for p in pieces]


@pytest.mark.parametrize("kind", ["tokenizer.json", "tiktoken", "bytes"])
def test_round_trip_and_packing(kind, bpe_json, tiktoken_file):
    spec = {"tokenizer.json": bpe_json, "tiktoken": tiktoken_file, "bytes": "bytes"}[kind]
    tok = load_tokenizer(spec)
    docs = [*STORIES[:20], *TRICKY]
    for doc in docs:
        assert tok.decode(tok.encode(doc)) == doc
    fp = tok.fingerprint()
    for doc, packed in zip(docs, tok.pack(docs), strict=True):
        assert packed.max() < tok.vocab_size
        body = packed[len(fp["bos_ids"]) : len(packed) - len(fp["eos_ids"])]
        assert list(packed[: len(fp["bos_ids"])]) == fp["bos_ids"]
        assert list(packed[len(packed) - len(fp["eos_ids"]) :]) == fp["eos_ids"]
        assert tok.decode(body) == doc
        if kind != "bytes":  # one EOS per document: a literal special token is text
            assert list(packed).count(fp["eos_ids"][0]) == 1


def test_tokenizer_json_bos_and_eos_as_the_tokenizer_defines_them(bpe_json, tmp_path):
    from tokenizers import Tokenizer

    with_bos = load_tokenizer(bpe_json)
    assert with_bos.fingerprint()["bos_ids"] == [with_bos.tok.token_to_id(BOS)]
    plain = Tokenizer.from_file(bpe_json)
    plain.post_processor = None
    (tmp_path / "plain").mkdir()
    plain.save(str(tmp_path / "plain" / "tokenizer.json"))
    no_bos = load_tokenizer(str(tmp_path / "plain"))  # a directory holding tokenizer.json
    assert no_bos.fingerprint()["bos_ids"] == []
    assert no_bos.pack(["Once"])[0][-1] == no_bos.tok.token_to_id(EOS)
    # tokenizer_config.json beside the file names the EOS (as Hugging Face model repos do)
    config = {"eos_token": {"content": BOS}}
    (tmp_path / "plain" / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(str(tmp_path / "plain")).fingerprint()["eos_ids"] == [0]


def test_tiktoken_file_gets_llama3_special_tokens(tiktoken_file):
    tok = load_tokenizer(tiktoken_file)
    ranks = sum(1 for line in Path(tiktoken_file).read_text().splitlines() if line)
    assert tok.vocab_size == ranks + LLAMA3_SPECIAL_TOKENS
    specials = tok.fingerprint()["special_tokens"]
    assert specials[BOS] == ranks and specials[EOS] == ranks + 1
    assert specials["<|eot_id|>"] == ranks + 9
    assert specials["<|reserved_special_token_250|>"] == ranks + 255


def test_a_rewritten_tiktoken_file_is_read_again(tmp_path):
    """tiktoken caches BPE files by path; the file's sha256 makes it read the new one."""
    path = tmp_path / "tokenizer.model"
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    path.write_text("\n".join(lines))
    assert load_tokenizer(str(path)).vocab_size == 256 + LLAMA3_SPECIAL_TOKENS
    path.write_text("\n".join([*lines, f"{base64.b64encode(b'ab').decode()} 256"]))
    tok = load_tokenizer(str(path))
    assert tok.vocab_size == 257 + LLAMA3_SPECIAL_TOKENS and tok.encode("ab") == [256]


def test_jsonl_parquet_and_text_inputs_give_the_same_documents(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", STORIES[:120])
    write_parquet(tmp_path / "b.parquet", STORIES[120:], row_group=16)  # 5 row groups
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text(TRICKY[0])
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": TRICKY[1]}) + "\n\n" + json.dumps({"text": None}) + "\n")
    (tmp_path / "notes.rst").write_text("not an input")
    files = expand([str(tmp_path)])
    names = ["a.jsonl", "b.parquet", "d.jsonl.gz", "c.txt"]  # sorted paths, .rst left out
    assert [f.name for f in files] == names
    assert list(read_documents(files)) == [*STORIES, TRICKY[1], TRICKY[0]]  # null: skipped
    assert expand([str(tmp_path / "*.jsonl"), str(tmp_path / "sub/c.txt")]) == [
        tmp_path / "a.jsonl",
        tmp_path / "sub" / "c.txt",
    ]


def test_split_is_by_whole_documents_and_packed_with_eos(tmp_path, bpe_json):
    write_jsonl(tmp_path / "docs.jsonl", STORIES)
    out = tmp_path / "data"
    argv = ["--out", str(out), "--tokenizer", bpe_json, "--no-progress", str(tmp_path)]
    assert main(argv) == 0
    meta = json.loads((out / "meta.json").read_text())
    tok = load_tokenizer(bpe_json)
    assert meta["documents"] == {"train": 180, "val": 20} and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == tok.vocab_size and meta["eos_ids"] == [tok.eos_id]
    assert meta["special_tokens"] == {BOS: 0, EOS: 1}
    assert meta["tokenizer_sha256"] == tok.sha256
    split = {}
    for name in ("train", "val"):
        tokens = np.fromfile(out / f"{name}.bin", dtype=np.uint16)
        assert len(tokens) == meta["tokens"][name]
        split[name] = [tok.decode(d) for d in _documents(tokens, tok.eos_id, tok.bos_ids[0])]
    assert split["val"] == STORIES[9::10]  # every 10th document, whole
    assert split["train"] == [s for i, s in enumerate(STORIES) if i % 10 != 9]


def test_the_embedded_stories_with_a_bpe(tmp_path, bpe_json):
    out = tmp_path / "data"
    assert main(["--out", str(out), "--default", "--tokenizer", bpe_json, "--no-progress"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == {"train": 900, "val": 100}
    assert meta["sources"] == ["recipes.llama.corpus"] and meta["tokenizer"] == "tokenizer.json"


def test_output_is_the_same_bytes_at_any_worker_count(tmp_path, bpe_json, monkeypatch):
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", STORIES)
    write_parquet(tmp_path / "in" / "b.parquet", STORIES[:90], row_group=7)
    monkeypatch.setattr(prepare_module, "CHUNK_CHARS", 4000)  # ~80 chunks over the workers
    outputs = []
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        argv = ["--out", str(out), "--tokenizer", bpe_json, "--workers", str(workers)]
        assert main([*argv, str(tmp_path / "in")]) == 0
        outputs.append({f: (out / f).read_bytes() for f in ("train.bin", "val.bin", "meta.json")})
    assert outputs[0] == outputs[1]


def test_vocabularies_over_65536_are_written_as_uint32(tmp_path):
    # 256 bytes and every 2-byte pair: 65,792 ranks, then the 256 Llama-3 special tokens
    pairs = [bytes([b]) for b in range(256)]
    pairs += [bytes([a, b]) for a in range(256) for b in range(256)]
    path = tmp_path / "big.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(pairs)))
    tok = load_tokenizer(str(path))
    meta = prepare(STORIES[:20], tmp_path / "data", tok, val_fraction=0.5)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 65_792 + 256
    tokens = np.fromfile(tmp_path / "data" / "val.bin", dtype=np.uint32)
    docs = _documents(tokens, tok.eos_id, tok.bos_id)
    assert tokens[0] == tok.bos_id > 65_535 and [tok.decode(d) for d in docs] == STORIES[1:20:2]
    data = TokenData.open(tmp_path / "data", vocab_size=meta["vocab_size"], seq_len=16)
    assert data.train.dtype == np.uint32


def test_training_runs_on_bpe_tokens(dist_pool, tmp_path, bpe_json):
    out = tmp_path / "data"
    docs = write_jsonl(tmp_path / "d.jsonl", STORIES)
    assert main(["--out", str(out), "--tokenizer", bpe_json, "--no-progress", str(docs)]) == 0
    argv = args(str(out), tmp_path / "run", "--model.vocab-size", "1024", "--steps", "6")
    losses = dist_pool(2).run(run_train, argv, timeout=120)[0].losses
    assert list(losses) == list(range(1, 7))
    assert losses[1] == pytest.approx(np.log(1024), abs=0.5) and losses[6] < losses[1] - 0.5
