"""recipes.llama under real torchrun launches on 127.0.0.1: two "nodes" (two agents meeting at
a c10d rendezvous); through ``recipes.llama.launch`` (torchrun that ends quietly), Ctrl-C
(SIGINT to the launcher's process group) ending in a checkpoint and a refused run ending in one
line."""

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

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
TIMEOUT_S = 180
QUIET_LAUNCHER = (sys.executable, "-m", "recipes.llama.launch")


def _torchrun(
    run_args: list[str],
    *,
    nnodes: int,
    node_rank: int,
    nproc: int,
    port: int,
    launcher: tuple[str, ...] = (str(TORCHRUN),),
    **popen,
) -> subprocess.Popen:
    """The recipe under ``launcher``: torchrun itself, or ``recipes.llama.launch``."""
    options = [
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=recipe-test",
        "--local-addr=127.0.0.1",
    ]
    cmd = [*launcher, *options, "-m", "recipes.llama.train", "--config", "debug", *run_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as `make run`; torchrun warns otherwise
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
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


@pytest.mark.slow  # ~10 s; the signal logic itself is tested on the pools (test_train)
def test_ctrl_c_saves_a_checkpoint_and_ends_quietly(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = ["--data-dir", data_dir, "--run-dir", str(run_dir), "--steps", "100000"]
    args += ["--eval-every", "0", "--checkpoint-every", "0"]
    proc = _torchrun(
        args,
        nnodes=1,
        node_rank=0,
        nproc=2,
        port=0,
        launcher=QUIET_LAUNCHER,
        start_new_session=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, _finish(proc)[1]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    code, out = _finish(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT", out
    meta = check_checkpoint(Path(summary["checkpoint"]))
    assert meta["step"] == summary["steps"] >= 2
    # our message, then the summary line, then nothing: no SignalException traceback
    ending = out[out.index("stopped by SIGINT") :].splitlines()
    assert "Run the same command again to resume" in ending[0]
    assert len(ending) == 2 and ending[1].startswith("loss curve: "), out
    assert "Traceback" not in out and code == 128 + signal.SIGINT, out


@pytest.mark.slow  # ~7 s: two processes start torch; main's rank-0 rule is tested on the pools
def test_a_refused_run_prints_one_line(data_dir, tmp_path):
    """Every rank refuses ``--resume`` of a missing directory; rank 0 alone says so, and the
    launcher adds no ChildFailedError report."""
    missing = tmp_path / "nowhere"
    args = ["--data-dir", data_dir, "--run-dir", str(tmp_path / "run"), "--resume", str(missing)]
    proc = _torchrun(args, nnodes=1, node_rank=0, nproc=2, port=0, launcher=QUIET_LAUNCHER)
    code, out = _finish(proc)
    assert code == 2, out
    assert out.splitlines() == [
        f"error: {missing} does not exist. Pass another checkpoint to --resume (or --resume "
        "auto for the newest in --run-dir), or start over with --resume never"
    ]
