"""A process that has imported torch once and forks a fresh-looking interpreter per script.

Every documented block and example imports torch, whose import (with ``torch._dynamo``, which
``torch.distributed.tensor`` and raggedfsdp pull in) costs ~2.5 s of CPU: on 2 cores that was
most of each docs test. ``python -m tests.docs.zygote`` imports those two and then, for each
JSON request on stdin (``argv``, ``cwd``, ``env``, and the ``stdout``, ``stderr`` and ``rc``
files), forks a child that runs ``argv[0]`` as ``__main__`` the way ``python argv[0]`` would:
its ``sys.argv`` and ``sys.path[0]``, the request's environment and directory, stdin from
/dev/null, the exit status of ``python`` (``SystemExit``'s code, 1 and a traceback for an
uncaught exception) written to ``rc`` once the output is flushed. The pid goes back on stdout.

Nothing a script can name differs from a fresh interpreter's: ``torch._dynamo`` is reachable
from ``import torch`` alone (torch imports it lazily on first use), and a script gets fresh
globals. ``tests.docs.ranks`` only sends scripts whose statements before their first import
of torch or of this project's packages are imports, so no code of theirs runs before torch
would have been imported anyway.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import signal
import sys
import threading
import traceback

import torch
import torch._dynamo  # the other half of the import cost

PRELOADED = (torch.__name__, torch._dynamo.__name__)


def _exit_status(err: SystemExit) -> int:
    """What ``python`` exits with for ``err``: its int code, 0 for None, else 1 (printed)."""
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)
    return 1


def _run_script(path: str) -> int:
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as err:
        return _exit_status(err)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _child(request: dict) -> None:
    """Become ``python argv[0]`` for ``request`` and exit with its status (never returns)."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the script's subprocesses are its own
        for fd, name, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            os.dup2(os.open(name, flags, 0o644), fd)
        sys.stdin = open(0, closefd=False)  # not the zygote's buffered requests  # noqa: SIM115
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        code = _run_script(sys.argv[0])
        threading._shutdown()  # as the interpreter does on the way out: join its threads,
        atexit._run_exitfuncs()  # then run the exit functions
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        tmp = request["rc"] + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(code))
        os.rename(tmp, request["rc"])  # whole, or not there
        os._exit(code)


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    # torch's objects out of the collector's sight in every child: a full collection there
    # scans only the script's own objects (torch's ~300k took 150 ms of CPU each), and does not
    # write the collector's headers on the pages the child shares with this process
    gc.freeze()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
