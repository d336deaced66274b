"""Faults: a rank killed in the middle of a collective makes every other rank fail fast, with an
error that names the group and the collective, never hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raggedfsdp.comm.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


def _run(
    world: int,
    kill_rank: int,
    collective: str,
    at: int,
    optimizer: str,
    checkpoint: str = "",
    timeout: float = 20.0,
):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "tests.support.fault_worker", "--rank", str(r)),
                *("--world", str(world), "--port", str(port), "--kill-rank", str(kill_rank)),
                *("--collective", collective, "--at", str(at), "--timeout", str(timeout)),
                *("--optimizer", optimizer, "--checkpoint", checkpoint),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    start = time.monotonic()
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"a rank hung past the collective timeout ({collective} at call {at})")
        results.append((proc.returncode, out + err))
    return results, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize(
    ("collective", "at", "optimizer", "expected"),
    [
        # kills fall in step 2, after the checkpoint of step 1 (4 groups: 4 gathers forward, 2
        # re-gathers backward (the root is kept) and 4 reductions per step; Muon: 2
        # all-to-alls per step)
        ("all_gather_flat", 12, "adamw", "raggedfsdp: all-gather of fully_shard group"),
        ("reduce_scatter_flat", 6, "adamw", "raggedfsdp: reduce-scatter of fully_shard group"),
        ("all_to_all_uneven", 3, "muon", "raggedfsdp: all-to-all of matrix pieces to their owners"),
    ],
    ids=["forward-all-gather", "backward-reduce-scatter", "muon-all-to-all"],
)
def test_a_killed_rank_fails_the_others_fast_and_clearly(
    collective, at, optimizer, expected, dist_pool, tmp_path
):
    checkpoint = str(tmp_path / "step1")
    results, elapsed = _run(3, 1, collective, at, optimizer, checkpoint)
    assert results[1][0] == -9, "the victim should have died by SIGKILL"
    for rank in (0, 2):
        code, output = results[rank]
        assert code != 0, f"rank {rank} finished although a peer died ({collective})"
        assert expected in output, output[-2000:]
    assert elapsed < 20.0 + 60
    if Path(checkpoint).exists():  # the last completed checkpoint loads and training resumes
        assert all(dist_pool(2).run(_resume, checkpoint, optimizer))


def _resume(path: str, optimizer: str) -> bool:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from raggedfsdp import fully_shard
    from raggedfsdp.checkpoint import load
    from raggedfsdp.optim import Muon, split_muon_params
    from tests.support.tiny_models import batch, loss_fn, make_model

    model = make_model(seed=5)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    if optimizer == "muon":
        opt = Muon(split_muon_params(model), lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn(model, *batch(0, 2)).backward()  # create optimizer state to load into
    opt.step()
    opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    load(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loss = loss_fn(model, *batch(1, 2))
    loss.backward()
    opt.step()
    return bool(torch.isfinite(loss))
