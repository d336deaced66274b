"""Fixtures of the recipe tests: one prepared copy of the default dataset per session, and
the runs that tests of several files compare with, trained once per session."""

from __future__ import annotations

import json

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


@pytest.fixture(scope="session")
def w2_reference(dist_pool, data_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """(rank 0's result, run directory) of the plain debug run at W=2 (8 steps, AdamW,
    raggedfsdp, exported weights, no checkpoint): the run that resumes, FSDP2, compiled blocks
    and TP are compared with, trained once per session instead of once per test."""
    from tests.support.recipe_runs import args, run_train

    run_dir = tmp_path_factory.mktemp("w2-reference") / "run"
    argv = args(data_dir, run_dir, "--export-weights", "--checkpoint-every", "0")
    return dist_pool(2).run(run_train, argv)[0], run_dir


@pytest.fixture(scope="session")
def tp2_optimizer_run(dist_pool, data_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """``tp2_optimizer_run(optimizer)``: (every rank's (exit status, stdout, stderr) of ``main``,
    rank 0's logged losses) for two steps of ``optimizer`` at dp 1 x tp 2 (preconditioner
    blocks of 8, no checkpoint), launched once per session: the TP test checks the launch, the
    loss-parallel test compares its sharded logits with these losses."""
    from tests.support.recipe_runs import args, run_main

    runs: dict[str, tuple[list[tuple[int, str, str]], dict[int, float]]] = {}

    def get(optimizer: str):
        if optimizer not in runs:
            run_dir = tmp_path_factory.mktemp(f"tp2-{optimizer}") / "run"
            extra = ["--tp", "2", "--optimizer", optimizer, "--steps", "2"]
            extra += ["--checkpoint-every", "0", "--preconditioner-dim", "8"]
            results = dist_pool(2).run(run_main, args(data_dir, run_dir, *extra))
            records = (
                (run_dir / "metrics.jsonl").read_text().splitlines() if run_dir.is_dir() else []
            )
            losses = {r["step"]: r["loss"] for r in map(json.loads, records)}
            runs[optimizer] = (results, losses)
        return runs[optimizer]

    return get


@pytest.fixture(scope="session")
def moe_w2_run(dist_pool, data_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """(rank 0's result, run directory) of the debug run of moe_tiny at W=2 (8 steps, AdamW,
    ep 1, checkpoints after steps 4 and 8): the straight run that MoE and EP checkpoints
    resume against."""
    from tests.support.recipe_runs import args, run_train

    run_dir = tmp_path_factory.mktemp("moe-w2") / "run"
    return dist_pool(2).run(run_train, args(data_dir, run_dir, "--config", "moe_tiny"))[0], run_dir
