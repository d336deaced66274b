"""Dry runs: the real runtimes as one rank of a large job, on one CPU.

``dry_run(build, loss, rank=r, world_size=W)`` builds, wraps (``raggedfsdp.fully_shard`` or
FSDP2's), makes the optimizer and trains steps as rank ``r`` of ``W`` on torch's fake process
group with fake tensors, and reports that rank's static memory, peaks by phase, bytes per
collective and set-up time (``StepReport``). ``measure`` is the same measurement in a real
process group, the check that the dry run's figures are the runtime's. See docs/dry_run.md.
"""

from raggedfsdp.dry_run.collectives import CollectiveCounter
from raggedfsdp.dry_run.fake_values import ZeroValues
from raggedfsdp.dry_run.report import StepReport, table
from raggedfsdp.dry_run.run import dry_run, fully_shard_of, measure, tensor_mode
from raggedfsdp.dry_run.tally import MemoryTally
from raggedfsdp.dry_run.world import check_rank, fake_world

__all__ = [
    "CollectiveCounter",
    "MemoryTally",
    "StepReport",
    "ZeroValues",
    "check_rank",
    "dry_run",
    "fake_world",
    "fully_shard_of",
    "measure",
    "table",
    "tensor_mode",
]
