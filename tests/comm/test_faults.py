"""Faults: a rank killed in the middle of a collective makes every other rank fail fast, with an
error that names the group and the collective, never hang; the last checkpoint resumes with the
values it saved."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from raggedfsdp.comm.launch import serving_store
from tests.docs.ranks import script_env, start_script

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "fault_worker.py"
# The collective timeout: a survivor that waited for it would fail ``TIMEOUT`` s after the kill
# with gloo's "Timed out" error. Long, so that no load on the machine can pass for detection.
TIMEOUT = 60.0
# What gloo reports when a peer's connection drops: the death itself was detected.
PEER_LOST = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|EOF")


def _run(world: int, kill_rank: int, collective: str, at: int, optimizer: str, checkpoint: str):
    with serving_store() as port:
        procs = [
            start_script(
                [
                    *(str(WORKER), "--rank", str(r)),
                    *("--world", str(world), "--port", str(port), "--kill-rank", str(kill_rank)),
                    *("--collective", collective, "--at", str(at), "--timeout", str(TIMEOUT)),
                    *("--optimizer", optimizer, "--checkpoint", checkpoint),
                ],
                ROOT,
                script_env(),
            )
            for r in range(world)
        ]
        results = []
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=TIMEOUT + 60)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                pytest.fail(f"a rank hung past the collective timeout ({collective} at call {at})")
            results.append((proc.returncode, out + err))
    return results


def _stamp(output: str, event: str) -> float:
    found = re.findall(rf"fault_worker: {event} at ([0-9.]+)", output)
    assert len(found) == 1, f"expected one '{event} at' line:\n{output[-2000:]}"
    return float(found[0])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("collective", "at", "optimizer", "expected"),
    [
        # kills fall in step 2, after the checkpoint of step 1 (4 groups: 4 gathers forward, 2
        # re-gathers backward (the root is kept) and 4 reductions per step; Muon: 2
        # all-to-alls per step)
        ("all_gather_flat", 12, "adamw", "raggedfsdp: all-gather of fully_shard group"),
        # a small group's reduce-scatter stays in flight while backward goes on: the survivors
        # may meet the loss first in the next group's prefetched all-gather
        (
            "reduce_scatter_flat",
            6,
            "adamw",
            "raggedfsdp: (reduce-scatter|all-gather) of fully_shard group",
        ),
        ("all_to_all_uneven", 3, "muon", "raggedfsdp: all-to-all of matrix pieces to their owners"),
    ],
    ids=["forward-all-gather", "backward-reduce-scatter", "muon-all-to-all"],
)
def test_a_killed_rank_fails_the_others_fast_and_clearly(
    collective, at, optimizer, expected, dist_pool, tmp_path
):
    checkpoint = str(tmp_path / "step1")
    results = _run(3, 1, collective, at, optimizer, checkpoint)
    code, output = results[1]
    assert code == -9, f"the victim should have died by SIGKILL:\n{output[-2000:]}"
    killed = _stamp(output, "killed")
    for rank in (0, 2):
        code, output = results[rank]
        assert code != 0, f"rank {rank} finished although a peer died ({collective})"
        errors = [line for line in output.splitlines() if re.search(expected, line)]
        assert errors, output[-2000:]
        # detected from the lost connection, not by waiting out the timeout: gloo says which
        assert PEER_LOST.search(errors[-1]), errors[-1]
        assert "timed out" not in errors[-1].lower(), errors[-1]
        assert _stamp(output, "failed") - killed < TIMEOUT / 2, "detected no sooner than a timeout"
    # The kills fall after the checkpoint of step 1, so it is always there, and it resumes at
    # another world size with exactly the values it saved
    assert Path(checkpoint).is_dir() and Path(checkpoint + ".full.pt").is_file()
    for mismatched in dist_pool(2).run(_resume, checkpoint, optimizer):
        assert mismatched == [], mismatched


def _resume(path: str, optimizer: str) -> list[str]:
    """Load the checkpoint into a differently initialised model and optimizer; the names of
    the values that differ from the saved full state (none expected), after checking that
    training goes on from there."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from raggedfsdp import fully_shard
    from raggedfsdp.checkpoint import load
    from raggedfsdp.optim import Muon, split_muon_params
    from tests.support.fault_worker import full_state
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
    # values, not tensors: the state dict shares the optimizer's ``step`` tensors, which the
    # next step increments in place
    got = _leaves(full_state(model, opt))
    loss = loss_fn(model, *batch(1, 2))
    loss.backward()
    opt.step()
    assert torch.isfinite(loss), loss
    if torch.distributed.get_rank() != 0:  # full_state: rank 0 holds the gathered tensors
        return []
    want = _leaves(torch.load(path + ".full.pt"))
    assert got.keys() == want.keys() and len(want) > 0, (got.keys(), want.keys())
    return [key for key, value in want.items() if got[key] != value]


def _leaves(state: dict) -> dict[str, object]:
    """Every leaf of a nested state dict by its path, tensors as Python lists (compared
    exactly, NaN aside)."""
    import torch
    from torch.utils._pytree import keystr, tree_flatten_with_path

    leaves, _ = tree_flatten_with_path(state)
    return {
        keystr(path): value.tolist() if isinstance(value, torch.Tensor) else value
        for path, value in leaves
    }
