"""Multi-process test harness: a pool of gloo ranks that lives for the whole test session.

Spawning ranks and importing torch in each costs seconds, a collective costs milliseconds, so the
pool starts its W processes once and then runs many small tasks on them: ``pool.run(fn, ...)``
calls the module-level ``fn`` in every rank and returns the per-rank results.

Failure handling is what makes the reuse safe. If a rank raises, the others may be blocked in a
collective that will never complete, so after a short grace period (to collect every rank's
traceback) the whole pool is killed; the same happens when ranks do not answer within the
timeout. A killed pool respawns on its next use, so one broken test cannot poison later ones.

Everything listens on 127.0.0.1 only: the parent hosts the rendezvous TCPStore on a socket it
bound itself, and gloo is pinned to the loopback interface.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from raggedfsdp.comm.launch import listening_store, loopback_interface

__all__ = ["WorkerPool"]

GLOO_TIMEOUT = timedelta(seconds=60)
STARTUP_TIMEOUT_S = 120.0
FAILURE_GRACE_S = 1.0
# How long ``run`` waits for ranks by default: a hang detector, not a speed bound. It must hold
# for the slowest task on a loaded 2-core machine with cold caches (a first torch.compile in 4
# ranks), so it sits just under pytest's 300 s per-test timeout; hangs inside a collective end
# sooner, at GLOO_TIMEOUT.
RUN_TIMEOUT_S = 240.0
CLOSE_TIMEOUT_S = 10.0
# Imported once by the forkserver, inherited by every rank it forks (a missing one is skipped).
PRELOAD = ("raggedfsdp.fsdp", "raggedfsdp.optim", "recipes.llama.train")


def _context() -> mp.context.BaseContext:
    """A forkserver context that has torch imported already, or spawn where there is none.

    Like spawn, forkserver children do not inherit the test process's state (they are forked
    from a clean server that was itself started fresh with the parent's ``sys.path``), but the
    server pays the imports once: torch, the library and the recipe (about 2.5 s of CPU each on
    this machine), so a 4-rank pool starts in well under a second instead of importing them 4
    times on 2 cores, and a pool that respawns after a failure pays nothing again.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, *PRELOAD])
    return ctx


def _send(conn: Connection, message: tuple[str, Any]) -> None:
    # Plain pickle, not the multiprocessing pickler: torch registers reducers there that move
    # tensors through shared memory, which would tie a result's lifetime to the worker.
    try:
        payload = pickle.dumps(message)
    except Exception:
        payload = pickle.dumps(("error", f"result is not picklable:\n{traceback.format_exc()}"))
    conn.send_bytes(payload)


def _worker_main(
    rank: int, world_size: int, port: int, interface: str | None, conn: Connection
) -> None:
    """Body of one rank: join the gloo group, then run tasks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=GLOO_TIMEOUT)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=GLOO_TIMEOUT
        )
    except Exception:
        _send(conn, ("error", traceback.format_exc()))
        return
    # What is alive now (torch, the library, the default group) lives as long as the rank: out
    # of the collector's sight, the full collection after every task (``_destroy_task_groups``)
    # and the automatic ones scan only what tasks made, not torch's ~300k objects (150 ms of
    # CPU per collection per rank, most of a small task's time).
    gc.freeze()
    _send(conn, ("ready", None))
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:  # the parent went away
            break
        if not payload:
            break
        try:
            fn, args, kwargs = pickle.loads(payload)
            reply: tuple[str, Any] = ("ok", fn(*args, **kwargs))
        except BaseException:
            reply = ("error", traceback.format_exc())
        _send(conn, reply)
        _destroy_task_groups()
    dist.destroy_process_group()


class _DestroyedGroup:
    """Holds a destroyed group's place in torch's group-name registry. Groups made with
    ``use_local_synchronization`` (``shard_subgroup``, ``product_group``) are named by a hash
    of their ranks and the registry's size; were the size to shrink, a new group would take a
    destroyed one's name and meet its stale rendezvous keys in the store (a hang)."""

    def shutdown(self) -> None:  # what destroying the default group calls on every entry
        pass


def _destroy_task_groups() -> None:
    """Destroy every process group but the default one once a task is done (the meshes and
    subgroups it made; every rank ran the same task, so every member destroys them).

    A gloo group keeps two worker threads and a TCP event loop that wakes every few
    milliseconds even when idle: a session's tests make hundreds of groups, and left alive they
    took most of both cores by the end of a run (532 groups, 1,600 threads per rank of the
    4-rank pool). DTensor's sharding cache (keyed by meshes, which compare by rank layout) and
    raggedfsdp's subgroup caches would hand the next task a destroyed group, so they go too.
    """
    from torch.distributed.distributed_c10d import _get_default_group, _world

    from raggedfsdp.comm.mesh import forget_groups

    default = _get_default_group()
    for group in list(_world.pg_map):
        if group is not default:
            name = _world.pg_names[group]
            dist.destroy_process_group(group)
            _world.pg_names[_DestroyedGroup()] = name
    forget_groups()
    _clear_dtensor_caches()
    gc.collect()  # groups held in reference cycles (meshes, modules) end now, not later


def _clear_dtensor_caches() -> None:
    """Empty DTensor's caches keyed by meshes once a task's groups are destroyed.

    Besides handing a later task a destroyed group, they keep the task's meshes alive, and a
    mesh keeps its groups: destroying a gloo group only unregisters it, its threads and event
    loop end when the last reference does. The redistribute planners, transform plans and
    mesh topologies of every TP, EP x TP and FSDP2 x PP run held 1-4 groups per rank this way
    (about 200 idle groups per rank of the 4-rank pool by the end of a session).
    """
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


class WorkerPool:
    """``world_size`` gloo ranks in separate processes, started lazily and reused across runs."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size: must be >= 1, got {world_size}")
        self.world_size = world_size
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._store: dist.TCPStore | None = None

    @property
    def alive(self) -> bool:
        """Whether workers are started (False before the first run and after a kill or close)."""
        return bool(self._procs)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = RUN_TIMEOUT_S, **kwargs: Any
    ) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` in every rank; return the results in rank order.

        ``fn`` must be picklable (a module-level function). Raises AssertionError with every
        failing rank's traceback if any rank raises, TimeoutError naming the silent ranks if some
        do not answer within ``timeout`` seconds; either way the pool is killed and respawns on
        the next call. ``timeout`` belongs to the harness, so ``fn`` cannot take a keyword of
        that name.
        """
        __tracebackhide__ = True  # pytest: show the rank tracebacks, not this frame
        payload = pickle.dumps((fn, args, kwargs))  # fail here, not in the ranks
        if not self.alive:
            self._start()
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a dead worker is reported by _collect
                conn.send_bytes(payload)
        replies = self._collect(time.monotonic() + timeout)
        errors = {rank: text for rank, (kind, text) in replies.items() if kind == "error"}
        missing = [rank for rank in range(self.world_size) if rank not in replies]
        if not errors and not missing:
            return [replies[rank][1] for rank in range(self.world_size)]
        self._kill()
        name = getattr(fn, "__qualname__", repr(fn))
        header = f"WorkerPool({self.world_size}).run({name}) failed"
        silent = f"ranks {missing} did not answer within {timeout:g} s; the pool was killed"
        if not errors:
            raise TimeoutError(f"{header}: {silent}")
        parts = [header] + [f"--- rank {rank} ---\n{text}" for rank, text in sorted(errors.items())]
        if missing:
            parts.append(f"(other ranks: {silent})")
        raise AssertionError("\n".join(parts))

    def close(self) -> None:
        """Stop the workers cleanly (killing any that do not exit); a later run respawns them."""
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a worker that already died
                conn.send_bytes(b"")
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _collect(self, deadline: float) -> dict[int, tuple[str, Any]]:
        """Gather replies until all ranks answered or the deadline passed.

        The first error moves the deadline to at most ``FAILURE_GRACE_S`` away: ranks still
        running are then probably blocked on the failed one.
        """
        replies: dict[int, tuple[str, Any]] = {}
        pending = dict(zip(self._conns, range(self.world_size), strict=True))
        while pending and (remaining := deadline - time.monotonic()) > 0:
            for conn in wait(list(pending), timeout=remaining):
                rank = pending.pop(conn)
                try:
                    replies[rank] = pickle.loads(conn.recv_bytes())
                except EOFError:
                    self._procs[rank].join(1.0)
                    code = self._procs[rank].exitcode
                    replies[rank] = ("error", f"rank {rank} died (exit code {code})")
                except Exception:
                    replies[rank] = ("error", f"reply not unpicklable:\n{traceback.format_exc()}")
                if replies[rank][0] == "error":
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return replies

    def _start(self) -> None:
        # The parent binds the store's socket itself (loopback only, no pick-then-bind race).
        self._store, port = listening_store(timeout=GLOO_TIMEOUT)
        ctx = _context()
        interface = loopback_interface()
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, interface, child_end),
                name=f"gloo-rank-{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()  # so the parent sees EOF when the worker dies
            self._procs.append(proc)
            self._conns.append(parent_end)
        replies = self._collect(time.monotonic() + STARTUP_TIMEOUT_S)
        failed = {rank: text for rank, (kind, text) in replies.items() if kind != "ready"}
        missing = [rank for rank in range(self.world_size) if rank not in replies]
        if not failed and not missing:
            return
        self._kill()
        parts = [f"WorkerPool({self.world_size}) failed to start"]
        parts += [f"--- rank {rank} ---\n{text}" for rank, text in sorted(failed.items())]
        if missing:
            parts.append(f"ranks {missing} were not ready within {STARTUP_TIMEOUT_S:g} s")
        raise RuntimeError("\n".join(parts))

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None
