"""What a dry run measured for one rank: ``StepReport``, and a side-by-side table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = ["StepReport", "table"]

MIB = 1 << 20


@dataclass(frozen=True)
class StepReport:
    """One rank's memory (bytes) and traffic (bytes per training step), and set-up time.

    Memory is live tensor bytes (``MemoryTally``). ``static`` is what stays between steps,
    measured after the optimizer step: ``params`` (this rank's shards), ``grads`` (its
    sharded gradients), ``optimizer`` (state) and the rest (buffers, the runtimes' own).
    ``peak_*`` is the most live during that phase of the measured step: static plus gathered
    parameters, copies, reduce-scatter buffers and activations of the micro-batch.
    Traffic: each collective's whole buffer (``CollectiveCounter``); ``largest_all_gather``
    is the biggest single gathered buffer, the one a rank must fit.
    """

    runtime: str
    rank: int
    world_size: int
    tensors: str
    params: int
    grads: int
    optimizer: int
    static: int
    peak_forward: int
    peak_backward: int
    peak_step: int
    all_gather: int
    reduce_scatter: int
    all_reduce: int
    all_to_all: int
    largest_all_gather: int
    setup_s: float

    @property
    def peak(self) -> int:
        return max(self.peak_forward, self.peak_backward, self.peak_step)

    def as_dict(self) -> dict[str, object]:
        return asdict(self) | {"peak": self.peak}


ROWS = (
    ("params (MiB)", "params"),
    ("grads (MiB)", "grads"),
    ("optimizer state (MiB)", "optimizer"),
    ("static (MiB)", "static"),
    ("peak forward (MiB)", "peak_forward"),
    ("peak backward (MiB)", "peak_backward"),
    ("peak step (MiB)", "peak_step"),
    ("peak (MiB)", "peak"),
    ("largest all-gather buffer (MiB)", "largest_all_gather"),
    ("all-gather / step (MiB)", "all_gather"),
    ("reduce-scatter / step (MiB)", "reduce_scatter"),
    ("all-reduce / step (MiB)", "all_reduce"),
    ("all-to-all / step (MiB)", "all_to_all"),
    ("set-up (s)", "setup_s"),
)


def table(reports: Sequence[StepReport]) -> str:
    """The reports side by side, one column each, with a ratio column for two."""
    head = ["", *(r.runtime for r in reports)]
    if len(reports) == 2:
        head.append(f"{reports[0].runtime} / {reports[1].runtime}")
    lines = []
    for label, key in ROWS:
        values = [r.as_dict()[key] for r in reports]
        cells = [f"{v:.2f}" if key == "setup_s" else f"{v / MIB:,.1f}" for v in values]
        if len(reports) == 2:
            cells.append(f"{values[0] / values[1]:.3f}" if values[1] else "-")
        lines.append([label, *cells])
    widths = [max(len(row[i]) for row in [head, *lines]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{widths[0]}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*row) for row in [head, *lines])
