"""Fixtures of the recipe tests: one prepared copy of the default dataset per session."""

from __future__ import annotations

import pytest

from recipes.llama.prepare import prepare_default


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("recipe-data")
    prepare_default(path)
    return str(path)


@pytest.fixture(scope="session")
def bpe_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 1000-token byte-level BPE (with BOS) trained on the embedded stories, as tokenizer.json."""
    from tests.recipes.tokenizer_files import train_bpe

    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_bpe().save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiktoken_file(tmp_path_factory: pytest.TempPathFactory, bpe_json: str) -> str:
    """The same BPE's ranks as a tiktoken BPE file (what Llama-3's tokenizer.model is)."""
    from tokenizers import Tokenizer

    from tests.recipes.tokenizer_files import write_tiktoken

    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.model"
    return str(write_tiktoken(Tokenizer.from_file(bpe_json), path))
