"""Local launches on the loopback interface: a free port, the loopback device, W gloo ranks.

Tests, benchmarks and the example all start process groups on one machine. They share these
helpers so that every launch listens on 127.0.0.1 only (never a routable address) and pins gloo
to the loopback device, whatever the machine's other interfaces are.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

__all__ = [
    "LOCALHOST",
    "free_port",
    "join_local_group",
    "listening_store",
    "loopback_interface",
    "pin_gloo_to_loopback",
    "serving_store",
    "spawn_local",
]

LOCALHOST = "127.0.0.1"


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port free on ``host`` right now (the OS picks it). Another process may take it
    before it is bound again; callers that cannot retry should bind and pass the socket."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def loopback_interface() -> str | None:
    """The loopback device's name (``lo`` on Linux, ``lo0`` on macOS), or None."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def pin_gloo_to_loopback() -> None:
    """Make gloo use the loopback device (set before ``init_process_group``)."""
    interface = loopback_interface()
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)


def listening_store(host: str = LOCALHOST, timeout: timedelta | None = None) -> tuple[Any, int]:
    """A TCPStore server on a port the OS picked and that this process bound itself, and that
    port: the ranks join it as clients, so no other process can take the port in between (the
    race of ``free_port``). Keep the store alive until the ranks are done."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    options = {} if timeout is None else {"timeout": timeout}
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        **options,
    )
    return store, port


@contextmanager
def serving_store(host: str = LOCALHOST) -> Iterator[int]:
    """``listening_store`` for the length of a block that launches the ranks: yields the port
    they join (``join_local_group``), closes the store after."""
    store, port = listening_store(host)
    try:
        yield port
    finally:
        del store


def join_local_group(rank: int, world_size: int, port: int) -> None:
    """Join the gloo group whose store ``listening_store`` serves on ``port`` (loopback)."""
    import torch.distributed as dist

    pin_gloo_to_loopback()
    store = dist.TCPStore(LOCALHOST, port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple) -> None:
    import torch.distributed as dist

    join_local_group(rank, world_size, port)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn_local(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in one gloo
    group on 127.0.0.1; raises if any rank fails. ``fn`` must be importable (module level).
    The rendezvous store lives in this process, on a socket it bound (``serving_store``)."""
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    with serving_store() as port:
        mp.spawn(_rank_main, args=(fn, world_size, port, args), nprocs=world_size)
