"""How far ahead the runtime prefetches, how many reduce-scatters it leaves in flight, and which
groups gather into a buffer of their own.

Rules the runtime (``raggedfsdp.fsdp.state``, ``param_group``) and the capacity planner's
memory model (``raggedfsdp.capacity.memory``) share, so pure Python: each works on a list of
byte sizes or counts.

Collectives this small are bound by latency, not bandwidth (NVLink: about 10 µs x 300 GB/s;
loopback gloo: about 100 µs x 2 GB/s; a few hundred KiB to a few MiB), and several in flight
hide it. So prefetching looks past the next group while the groups ahead total at most
``LATENCY_BOUND_BYTES`` (at most ``MAX_IN_FLIGHT`` of them), and the newest reduce-scatters
whose full gradient buffers total as much stay in flight while backward goes on. Groups larger
than that are prefetched one ahead and reduced as FSDP2 does, so a model of large blocks holds
what it held before; what a deeper window adds is bounded by these two numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "LATENCY_BOUND_BYTES",
    "MAX_IN_FLIGHT",
    "gathers_a_copy",
    "prefetch_ends",
    "reduces_in_flight",
]

LATENCY_BOUND_BYTES = 2 * 2**20
MAX_IN_FLIGHT = 8


def prefetch_ends(sizes: Sequence[float], hooks: int) -> list[int]:
    """For each of the first ``hooks`` places of a pass whose groups gather ``sizes`` bytes in
    order, the last place its hook prefetches up to: the next one always (if any), more while
    the prefetched ones total at most ``LATENCY_BOUND_BYTES``, at most ``MAX_IN_FLIGHT`` of
    them. The ends never decrease, so a hook starts only the places past its predecessor's."""
    ends = []
    for i in range(hooks):
        end, total = i, 0.0
        while end + 1 < len(sizes) and end - i < MAX_IN_FLIGHT:
            total += sizes[end + 1]
            if end > i and total > LATENCY_BOUND_BYTES:
                break
            end += 1
        ends.append(end)
    return ends


def reduces_in_flight(sizes: Sequence[float], at_least_one: bool) -> int:
    """How many of the newest reduce-scatters (``sizes``: their full gradient buffers' bytes,
    oldest first) stay in flight: those totalling at most ``LATENCY_BOUND_BYTES``, at most
    ``MAX_IN_FLIGHT``, and with ``at_least_one`` (a CUDA stream overlaps it) the newest
    whatever its size."""
    keep, total = 0, 0.0
    for size in reversed(sizes[-MAX_IN_FLIGHT:]):
        total += size
        if total > LATENCY_BOUND_BYTES and not (at_least_one and keep == 0):
            break
        keep += 1
    return keep


def gathers_a_copy(shard_ranks: int, casts: bool, offloaded: bool, float8: bool) -> bool:
    """Whether a group's unsharded parameters are a gathered buffer of their own. Not when one
    rank holds the whole group (``shard_ranks == 1``: W=1, HSDP shards of one, EP experts
    sharded over one rank) in the dtype it computes in: its sharded memory is then the
    unsharded parameters, with nothing to gather, allocate or free. A cast (``param_dtype``),
    CPU offload (host to device) and an FP8 payload each need a buffer of their own."""
    return shard_ranks > 1 or casts or offloaded or float8
