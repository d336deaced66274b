"""Fixtures of the recipe tests: one prepared copy of the default dataset per session."""

from __future__ import annotations

import pytest

from recipes.llama.data import prepare_default


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("recipe-data")
    prepare_default(path)
    return str(path)
