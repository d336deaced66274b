"""Measuring helpers shared by the benchmarks that run raggedfsdp beside PyTorch FSDP2.

* Memory on a CPU machine: ranks started with ``MALLOC_ENV`` return freed
  memory to the OS, so the resident set follows live tensor bytes; ``peak_above_now`` resets
  ``VmHWM`` and reads it after a call, ``peak_allocated`` reads the profiler's allocator events
  (the view a GPU's caching allocator has); ``trimmed_rss_kib`` is the resident set once glibc
  has returned the free pages inside its heap too (what a system held: the drop across its
  deletion).
* Communication: ``CollectiveBytes`` counts the all-gathers and reduce-scatters of one or more
  steps exactly, at the calls both runtimes make (our flat-buffer collectives; the
  ``torch.distributed`` calls FSDP2 makes), whatever the backend turns them into underneath.
* ``spawn_ranks``: one process per rank on 127.0.0.1 (gloo), rank 0's result back;
  ``start_ranks`` and ``rank_context`` for scripts that collect results their own way. Ranks
  are forked from a forkserver that imported torch, the library and the recipe once (clean
  processes like spawn's, without each rank paying those imports again).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raggedfsdp.comm.launch import join_local_group, serving_store
from raggedfsdp.fsdp import param_group as param_group_module

__all__ = [
    "MALLOC_ENV",
    "CollectiveBytes",
    "init_gloo",
    "peak_above_now",
    "peak_allocated",
    "rank_context",
    "reset_peak",
    "spawn_ranks",
    "start_ranks",
    "status_kib",
    "trimmed_rss_kib",
]

MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_TRIM_THRESHOLD_": "65536",
}


#: imported once by the ranks' forkserver, inherited by every rank it forks (missing: skipped)
PRELOAD = ["torch.distributed", "raggedfsdp.fsdp", "raggedfsdp.optim", "recipes.llama.train"]


def status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def trimmed_rss_kib() -> int:
    """``VmRSS`` after a garbage collection and glibc's ``malloc_trim(0)``.

    ``MALLOC_ENV`` puts allocations of 64 KiB and more in their own mappings, unmapped when
    freed; smaller ones (a runtime's per-parameter shards of small tensors, their optimizer
    state, its Python objects) live in the heap, whose freed pages stay resident unless they
    were at its top. Without the trim, deleting a system of many small tensors (FSDP2's
    per-parameter DTensors) drops the resident set by less than it held, while one of flat
    buffers (ours) drops by all of it: the two would not be compared alike."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    return status_kib("VmRSS")


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current resident size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_above_now(fn: Callable[[], Any]) -> float:
    """Run ``fn`` and return its peak resident memory above the level before it, in MiB."""
    reset_peak()
    before = status_kib("VmRSS")
    fn()
    return (status_kib("VmHWM") - before) / 1024


def peak_allocated(fn: Callable[[], Any]) -> float:
    """Run ``fn`` under the profiler; the peak of live tensor bytes above the start, in MiB."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CollectiveBytes:
    """Calls and bytes of all-gathers and reduce-scatters while ``counting()`` is active.

    Bytes are the gathered (full) buffer of an all-gather and the unreduced (full) input of a
    reduce-scatter, the usual measure of a collective's size (each rank receives ``(W-1)/W``
    of it). Ours are counted at ``all_gather_flat`` / ``reduce_scatter_flat``, which gloo runs
    as in-place all-reduces and NCCL as true all-gathers and reduce-scatters: one count either
    way; calls they make underneath are not counted again. FSDP2's are counted at
    ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` (and the ``*_tensor`` names).
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self._depth = 0

    def _record(self, kind: str, tensor: torch.Tensor) -> None:
        if self._depth == 0:
            self.calls[kind] += 1
            self.bytes[kind] += _nbytes(tensor)

    def _wrap(
        self, fn: Callable[..., Any], kind: str, full_arg: tuple[int, str]
    ) -> Callable[..., Any]:
        position, keyword = full_arg

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._record(kind, args[position] if len(args) > position else kwargs[keyword])
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    @contextmanager
    def counting(self) -> Iterator[CollectiveBytes]:
        patches = [
            (param_group_module, "all_gather_flat", "all_gather", (0, "full")),
            (param_group_module, "reduce_scatter_flat", "reduce_scatter", (1, "full_in")),
            (dist, "all_gather_single", "all_gather", (0, "output_tensor")),
            (dist, "all_gather_into_tensor", "all_gather", (0, "output_tensor")),
            (dist, "reduce_scatter_single", "reduce_scatter", (1, "input")),
            (dist, "reduce_scatter_tensor", "reduce_scatter", (1, "input")),
        ]
        originals = [(owner, name, getattr(owner, name)) for owner, name, _, _ in patches]
        for owner, name, kind, full_arg in patches:
            setattr(owner, name, self._wrap(getattr(owner, name), kind, full_arg))
        try:
            yield self
        finally:
            for owner, name, fn in originals:
                setattr(owner, name, fn)


def init_gloo(rank: int, world: int, port: int, threads: int | None = None) -> None:
    """Join the benchmark's gloo group, whose store the launching process serves on ``port``
    (``serving_store``), with ``threads`` intra-op threads (default: a share of the cores)."""
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world))
    join_local_group(rank, world, port)


def rank_context() -> mp.context.BaseContext:
    """The context ranks start in: a forkserver (started with ``MALLOC_ENV``, which glibc reads
    at start-up and forked ranks inherit) that preloads ``PRELOAD``."""
    os.environ.update(MALLOC_ENV)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_ranks(worker: Callable[..., None], args: tuple, nprocs: int) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` processes of ``rank_context`` and wait."""
    rank_context()
    mp.start_processes(worker, args=args, nprocs=nprocs, start_method="forkserver")


def spawn_ranks(worker: Callable[..., None], args: argparse.Namespace, world: int) -> Any:
    """Run ``worker(rank, world, port, args, queue)`` in ``world`` processes (``start_ranks``)
    and return what rank 0 puts on the queue."""
    out = rank_context().Queue()
    with serving_store() as port:
        start_ranks(worker, (world, port, args, out), world)
    return out.get()


def train_step(
    loss: torch.Tensor, opt: torch.optim.Optimizer, barrier: bool = False
) -> tuple[float, float]:
    """Backward of ``loss``, the optimizer step, ``zero_grad``: ``alternate_rounds``' step
    result (the loss, the optimizer step's seconds). ``barrier`` starts the optimizer's clock
    after every rank's backward, so that a step with collectives waits for no peer's backward."""
    loss.backward()
    if barrier:
        dist.barrier()
    t0 = time.perf_counter()
    opt.step()
    elapsed = time.perf_counter() - t0
    opt.zero_grad()
    return loss.item(), elapsed


def alternate_rounds(
    systems: dict[str, dict[str, Any]], names: list[str], steps: int, step: Callable
) -> dict[str, dict[str, float]]:
    """``steps`` rounds of one ``step(model, opt) -> (loss, optimizer seconds)`` per system of
    ``names``, the order rotating each round so that no system always runs first (warm
    caches, the allocator's state): medians of the step time, the optimizer's part and the
    transient peak (``peak_above_now``)."""
    keys = ("step", "optim", "transient")
    rounds: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in names}
    for i in range(steps):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            model, opt = systems[name]["model"], systems[name]["opt"]
            dist.barrier()
            t0 = time.perf_counter()
            out: dict[str, tuple[float, float]] = {}
            mem = peak_above_now(lambda m=model, o=opt, r=out: r.update(r=step(m, o)))
            rounds[name]["step"].append(time.perf_counter() - t0)
            rounds[name]["optim"].append(out["r"][1])
            rounds[name]["transient"].append(mem)
        del model, opt  # no reference left here: deleting a system later must free it
    return {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rounds.items()}


class Both(torch.optim.Optimizer):
    """Two optimizers (a Muon on the matrices, AdamW on the rest) stepped as one."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)
