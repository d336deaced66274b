"""Local launches on the loopback interface: a free port, the loopback device, W gloo ranks.

Tests, benchmarks and the example all start process groups on one machine. They share these
helpers so that every launch listens on 127.0.0.1 only (never a routable address) and pins gloo
to the loopback device, whatever the machine's other interfaces are.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["LOCALHOST", "free_port", "loopback_interface", "pin_gloo_to_loopback", "spawn_local"]

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


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple) -> None:
    import torch.distributed as dist

    pin_gloo_to_loopback()
    dist.init_process_group(
        "gloo", init_method=f"tcp://{LOCALHOST}:{port}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn_local(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in one gloo
    group on 127.0.0.1; raises if any rank fails. ``fn`` must be importable (module level)."""
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    mp.spawn(_rank_main, args=(fn, world_size, free_port(), args), nprocs=world_size)
