"""``torchrun`` that ends quietly: ``python -m recipes.llama.launch`` takes torchrun's arguments.

    python -m recipes.llama.launch --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:0 --local-addr 127.0.0.1 -m recipes.llama.train --steps 200

A terminal's Ctrl-C (or SLURM's SIGTERM) reaches torchrun as well as its workers. The workers
stop after the current step, save a checkpoint, print one line saying so and exit 0 (see
``checkpoint.GracefulStop``); torchrun, though, turns the signal it got itself into a
``SignalException`` and, once the workers are done, ends with that exception's traceback, after
their clean message. Nothing a worker does changes that. Likewise when a worker refuses to run
(exit status 2, after printing one line such as ``error: --resume PATH: PATH does not exist``),
torchrun adds a ``ChildFailedError`` traceback and report.

This runs torchrun's own ``main`` and ends those two cases without them: a signal with the
shell's status for it (128 + its number), a refusal with the worker's status 2. It also leaves
out torchrun's log lines about which worker it sends which signal (the workers that outlive a
refusing rank by a few milliseconds get one). Any other failure (a crash, a worker killed)
keeps torchrun's error log and full report, which say which rank failed and how.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from recipes.llama.config import USAGE_ERROR

__all__ = ["main"]

TORCHRUN_PROCESSES = "torch.distributed.elastic.multiprocessing.api"


def _not_a_refusal(record: logging.LogRecord) -> bool:
    """False for torchrun's "failed (exitcode: 2)" log line: the worker has said why."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (record.msg.startswith("failed (exitcode") and args[:1] == (USAGE_ERROR,))


def main(argv: list[str] | None = None) -> int:
    """torchrun with ``argv`` (default: this process's arguments); returns the exit status."""
    processes = logging.getLogger(TORCHRUN_PROCESSES)
    processes.setLevel(logging.ERROR)  # not its "sending process N closing signal" warnings
    processes.addFilter(_not_a_refusal)
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except SignalException as err:
        return 128 + int(err.sigval)  # the workers have stopped and said so
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        if failure.exitcode != USAGE_ERROR:
            raise
        return USAGE_ERROR  # the worker printed why (rank 0, once)
    return 0


if __name__ == "__main__":
    sys.exit(main())
