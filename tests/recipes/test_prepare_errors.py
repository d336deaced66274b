"""Bad input to recipes.llama.prepare (and data a preset cannot train on) ends with one line
naming the input and the fix: a tokenizer file that does not load, a jsonl line without the
text field, a parquet shard without the column, too few documents to split, a vocabulary larger
than the preset's embedding, two tokenizers' tokens in one directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.llama.prepare import main
from tests.recipes.tokenizer_files import write_jsonl, write_parquet
from tests.support.recipe_runs import args, run_main

STORIES = ["One story.", "Another one.", "A third."] * 10


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main([*argv, "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err.removeprefix("error: ").rstrip("\n")


def test_a_tokenizer_that_does_not_load(tmp_path, capsys):
    docs = str(write_jsonl(tmp_path / "d.jsonl", STORIES))
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text('{"version": "1.0", "model": 3}')
    line = _refused(capsys, ["--out", str(tmp_path / "o"), "--tokenizer", str(bad_json), docs])
    assert line.startswith(f"--tokenizer {bad_json} does not load as a tokenizer.json (")
    assert line.endswith(
        "give a Hugging Face tokenizer.json (or its directory), a tiktoken BPE "
        "file (base64 token and rank per line, e.g. Llama-3's tokenizer.model) "
        "or bytes"
    )
    bad_bpe = tmp_path / "tokenizer.model"
    bad_bpe.write_text("not-base64 and-not-a-rank too\n")
    line = _refused(capsys, ["--out", str(tmp_path / "o"), "--tokenizer", str(bad_bpe), docs])
    assert line.startswith(f"--tokenizer {bad_bpe} does not load as a tiktoken BPE file (")
    binary = tmp_path / "spm.model"
    binary.write_bytes(b"\n\x0e\x00\x01protobuf")
    line = _refused(capsys, ["--out", str(tmp_path / "o"), "--tokenizer", str(binary), docs])
    assert "is not text (a SentencePiece model?): convert it to a tokenizer.json" in line
    missing = tmp_path / "nope.json"
    line = _refused(capsys, ["--out", str(tmp_path / "o"), "--tokenizer", str(missing), docs])
    assert line.startswith(f"--tokenizer {missing}: no such file; give a Hugging Face")


def test_an_eos_token_the_tokenizer_lacks(tmp_path, capsys, bpe_json):
    docs = str(write_jsonl(tmp_path / "d.jsonl", STORIES))
    argv = ["--out", str(tmp_path / "o"), "--tokenizer", bpe_json, "--eos-token", "</s>", docs]
    assert _refused(capsys, argv) == (
        f"--eos-token '</s>' is not a token of {bpe_json} (its special tokens: "
        "<|begin_of_text|>, <|end_of_text|>); pass one of them"
    )


def test_a_jsonl_line_without_the_text_field(tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", STORIES)
    lines = path.read_text().splitlines()
    lines[6] = json.dumps({"id": 6, "body": "elsewhere"})
    path.write_text("\n".join(lines) + "\n")
    assert _refused(capsys, ["--out", str(tmp_path / "o"), str(path)]) == (
        f"{path} line 7 has no 'text' field (it has: id, body); pass --text-field NAME"
    )
    lines[6] = "{broken"
    path.write_text("\n".join(lines) + "\n")
    line = _refused(capsys, ["--out", str(tmp_path / "o"), str(path)])
    assert line.startswith(f"{path} line 7 is not JSON (") and line.endswith("fix or remove it")


def test_a_parquet_shard_without_the_column(tmp_path, capsys):
    path = write_parquet(tmp_path / "d.parquet", STORIES, field="content")
    assert _refused(capsys, ["--out", str(tmp_path / "o"), str(path)]) == (
        f"{path} has no column 'text' (its columns: id, content); pass --text-field NAME"
    )
    argv = ["--out", str(tmp_path / "o"), "--text-field", "id", str(path)]
    assert _refused(capsys, argv) == (
        f"{path}: column 'id' is int64, not text; pass the --text-field that holds the document"
    )
    assert main(["--out", str(tmp_path / "o"), "--text-field", "content", str(path)]) == 0


def test_missing_inputs_and_too_few_documents(tmp_path, capsys):
    assert _refused(capsys, ["--out", str(tmp_path / "o"), str(tmp_path / "*.jsonl")]) == (
        f"input pattern {str(tmp_path / '*.jsonl')!r} matches no file; check the pattern"
    )
    book = tmp_path / "book.txt"
    book.write_text("Call me Ishmael. " * 100)
    assert _refused(capsys, ["--out", str(tmp_path / "o"), str(book)]) == (
        "1 document with --val-fraction 0.1 leave validation empty (every 10th document is "
        "validation): give at least 10 documents (files, jsonl lines, parquet rows) or another "
        "--val-fraction"
    )
    assert not (tmp_path / "o" / "meta.json").exists()


def test_two_tokenizers_in_one_directory(tmp_path, capsys, bpe_json):
    docs = str(write_jsonl(tmp_path / "d.jsonl", STORIES))
    out = tmp_path / "data"
    assert main(["--out", str(out), "--no-progress", docs]) == 0
    capsys.readouterr()
    before = (out / "train.bin").read_bytes()
    line = _refused(capsys, ["--out", str(out), "--tokenizer", bpe_json, docs])
    assert line.startswith(
        f"--out {out} holds tokens of tokenizer 'bytes' (vocabulary 256, sha256 None) and this "
        "is 'tokenizer.json' (vocabulary 900, sha256 "
    )
    assert line.endswith(
        "one directory holds one tokenizer's tokens: use another --out, or --overwrite to "
        "replace them"
    )
    assert (out / "train.bin").read_bytes() == before and (out / "meta.json").is_file()
    assert main(["--out", str(out), "--tokenizer", bpe_json, "--overwrite", docs]) == 0
    assert json.loads((out / "meta.json").read_text())["tokenizer"] == "tokenizer.json"


def test_a_vocabulary_larger_than_the_presets_embedding(dist_pool, tmp_path, bpe_json):
    docs = str(write_jsonl(tmp_path / "d.jsonl", [f"Story {i}. " * 20 for i in range(40)]))
    out = tmp_path / "data"
    assert main(["--out", str(out), "--tokenizer", bpe_json, "--no-progress", docs]) == 0
    results = dist_pool(1).run(run_main, args(str(out), Path(tmp_path / "run")), timeout=60)
    code, stdout, stderr = results[0]
    assert (code, stdout) == (2, "")
    assert stderr == (
        f"error: {out} holds tokens of tokenizer.json with a 900-token vocabulary but the "
        "model's embedding has model.vocab_size=256: pass --model.vocab-size 900 (or more) or "
        "a --config preset whose vocabulary covers it\n"
    )
