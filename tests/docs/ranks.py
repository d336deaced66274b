"""Run a script as ``torchrun --nproc-per-node N`` would start it, without the agent.

torchrun hands each rank ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address
in its environment; a script that calls ``init_process_group()`` reads them from there. Setting
them directly starts the same ranks with one interpreter fewer (the agent's own torch import
costs seconds on a loaded machine), on 127.0.0.1 with gloo pinned to the loopback device
(``raggedfsdp.comm.launch``). As under torchrun, the rendezvous store is served by the launching
process (``TORCHELASTIC_USE_AGENT_STORE``), not by rank 0: a rank 0 that exits first would take
the store away from ranks still tearing their group down (gloo aborted one of them so, once).

A script that imports torch (or this project, which does) before running any code of its own
is forked from ``tests.docs.zygote``, which imported torch once for the session, instead of
starting an interpreter that imports it again (see there why nothing it can name differs).
"""

from __future__ import annotations

import ast
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from raggedfsdp.comm.launch import LOCALHOST, loopback_interface, serving_store

ROOT = Path(__file__).resolve().parents[2]
# Top-level packages whose import is (or brings) torch's: the zygote has paid it already.
TORCH_IMPORTERS = ("torch", "raggedfsdp", "recipes", "examples")
POLL_S = 0.02


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str  # stdout, then stderr


def script_env() -> dict[str, str]:
    """The environment scripts start in: this one, the repository importable, one thread."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_script(
    argv: list[str], *, cwd: Path = ROOT, timeout: float = 240.0
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, *argv], capture_output=True, text=True, timeout=timeout)``,
    forked from the zygote where the script allows it: a benchmark's smoke run pays its own
    work, not a second torch import (about 4 of a toy run's 8 s on this machine)."""
    proc = start_script(argv, cwd, script_env())
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return subprocess.CompletedProcess([sys.executable, *argv], proc.returncode, out, err)


def run_ranks(
    argv: list[str], nproc: int, *, cwd: Path = ROOT, timeout: float = 120.0
) -> list[RankResult]:
    """Start ``python *argv`` as ``nproc`` ranks (``nproc=0``: one plain process, no
    torchrun variables) and wait for all of them."""
    env = script_env()
    if not nproc:
        return _wait([start_script(argv, cwd, env)], timeout)
    with serving_store() as port:
        env |= {"MASTER_ADDR": LOCALHOST, "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc)}
        env |= {"LOCAL_WORLD_SIZE": str(nproc), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        if (interface := loopback_interface()) is not None:
            env.setdefault("GLOO_SOCKET_IFNAME", interface)
        ranks = [{"RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nproc)]
        return _wait([start_script(argv, cwd, env | rank) for rank in ranks], timeout)


def start_script(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen | ForkedRank:
    """Start ``python *argv`` in ``cwd`` with exactly ``env``, its output captured (collected by
    ``communicate``): forked from the zygote if ``argv[0]`` imports torch first."""
    if _imports_torch_first(Path(cwd, argv[0])):
        return _zygote().start(argv, cwd, env)
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(procs: list[subprocess.Popen | ForkedRank], timeout: float) -> list[RankResult]:
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


def _imports_torch_first(script: Path) -> bool:
    """Whether ``script`` imports one of ``TORCH_IMPORTERS`` with only imports (and its
    docstring) before: then its own code runs after torch's import, as in the zygote."""
    if script.suffix != ".py" or not script.is_file():
        return False
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if not node.level else []
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        else:
            return False
        if any(name.split(".")[0] in TORCH_IMPORTERS for name in names):
            return True
    return False


class ForkedRank:
    """A script forked from the zygote, waited for as ``subprocess.Popen`` is by ``_wait``."""

    def __init__(self, pid: int, files: dict[str, str]) -> None:
        self.pid, self.files, self.returncode = pid, files, None

    def communicate(self, timeout: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        rc = Path(self.files["rc"])
        while not rc.is_file():
            if not _alive(self.pid) and not rc.is_file():  # killed before it said its status
                self.returncode = -signal.SIGKILL
                break
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.files["argv0"], timeout)
            time.sleep(POLL_S)
        if self.returncode is None:
            self.returncode = int(rc.read_text())
        return Path(self.files["stdout"]).read_text(), Path(self.files["stderr"]).read_text()

    def kill(self) -> None:
        if _alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the zygote's children are reaped at once: no zombie answers
    except ProcessLookupError:
        return False
    return True


class _Zygote:
    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # as the ranks'
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.docs.zygote"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.dir = tempfile.mkdtemp(prefix="docs-zygote-")
        self.count = 0

    def start(self, argv: list[str], cwd: Path, env: dict[str, str]) -> ForkedRank:
        self.count += 1
        stem = os.path.join(self.dir, str(self.count))
        files = {kind: f"{stem}.{kind}" for kind in ("stdout", "stderr", "rc")}
        request = {"argv": argv, "cwd": str(cwd), "env": env, **files}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"tests.docs.zygote exited with {self.proc.wait()}")
        return ForkedRank(int(reply), {**files, "argv0": argv[0]})

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


_ZYGOTES: list[_Zygote] = []


def _zygote() -> _Zygote:
    """The session's zygote, started on first use (and again if it died)."""
    if not _ZYGOTES or _ZYGOTES[0].proc.poll() is not None:
        _ZYGOTES[:] = [_Zygote()]
        atexit.register(_ZYGOTES[0].close)
    return _ZYGOTES[0]
