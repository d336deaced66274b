"""recipes.llama under real torchrun launches on 127.0.0.1: two "nodes" (two agents meeting at
a c10d rendezvous) and Ctrl-C (SIGINT to the launcher's process group) ending in a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raggedfsdp.comm.launch import free_port
from recipes.llama.checkpoint import check_checkpoint
from recipes.llama.data import prepare_default

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("launch-data")
    prepare_default(path)
    return str(path)


def _torchrun(
    run_args: list[str], *, nnodes: int, node_rank: int, nproc: int, port: int, **popen
) -> subprocess.Popen:
    launcher = [
        str(TORCHRUN),
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=recipe-test",
        "--local-addr=127.0.0.1",
    ]
    cmd = [*launcher, "-m", "recipes.llama.train", "--config", "debug", *run_args]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out


def test_two_nodes_meet_at_a_c10d_rendezvous(data_dir, tmp_path):
    port = free_port()
    args = ["--data-dir", data_dir, "--run-dir", str(tmp_path / "run"), "--steps", "2"]
    agents = [_torchrun(args, nnodes=2, node_rank=rank, nproc=1, port=port) for rank in range(2)]
    for rank, (code, out) in enumerate(_finish(agent) for agent in agents):
        assert code == 0, f"node {rank}:\n{out}"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"]) == (2, 2)
    check_checkpoint(Path(summary["checkpoint"]))


@pytest.mark.slow  # ~10 s; the signal logic itself is tested on the pools (test_recipe_train)
def test_ctrl_c_under_torchrun_saves_a_checkpoint(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = ["--data-dir", data_dir, "--run-dir", str(run_dir), "--steps", "100000"]
    args += ["--eval-every", "0", "--checkpoint-every", "0"]
    proc = _torchrun(args, nnodes=1, node_rank=0, nproc=2, port=0, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, _finish(proc)[1]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, out = _finish(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT", out
    meta = check_checkpoint(Path(summary["checkpoint"]))
    assert meta["step"] == summary["steps"] >= 2
    assert "Run the same command again to resume" in out
