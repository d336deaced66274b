"""Run a script as ``torchrun --nproc-per-node N`` would start it, without the agent.

torchrun hands each rank ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address
in its environment; a script that calls ``init_process_group()`` reads them from there. Setting
them directly starts the same ranks with one interpreter fewer (the agent's own torch import
costs seconds on a loaded machine), on 127.0.0.1 with gloo pinned to the loopback device
(``raggedfsdp.comm.launch``). As under torchrun, the rendezvous store is served by the launching
process (``TORCHELASTIC_USE_AGENT_STORE``), not by rank 0: a rank 0 that exits first would take
the store away from ranks still tearing their group down (gloo aborted one of them so, once).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from raggedfsdp.comm.launch import LOCALHOST, loopback_interface, serving_store

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str  # stdout, then stderr


def run_ranks(
    argv: list[str], nproc: int, *, cwd: Path = ROOT, timeout: float = 120.0
) -> list[RankResult]:
    """Start ``python *argv`` as ``nproc`` ranks (``nproc=0``: one plain process, no
    torchrun variables) and wait for all of them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if not nproc:
        return _wait([_start(argv, cwd, env)], timeout)
    with serving_store() as port:
        env |= {"MASTER_ADDR": LOCALHOST, "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc)}
        env |= {"LOCAL_WORLD_SIZE": str(nproc), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        if (interface := loopback_interface()) is not None:
            env.setdefault("GLOO_SOCKET_IFNAME", interface)
        ranks = [{"RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nproc)]
        return _wait([_start(argv, cwd, env | rank) for rank in ranks], timeout)


def _start(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[RankResult]:
    results = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            results.append(RankResult(rank, proc.returncode, out + err))
    finally:
        for proc in procs:
            proc.kill()
    return results


def failures(results: list[RankResult]) -> str:
    """Every failing rank's exit status and the end of its output ('' when all succeeded)."""
    return "\n".join(
        f"rank {r.rank} exited {r.returncode}:\n{r.output[-3000:]}"
        for r in results
        if r.returncode != 0
    )
