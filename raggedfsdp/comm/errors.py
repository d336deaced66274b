"""``CollectiveError``: a failed collective, named.

On a job of thousands of ranks, "connection reset by peer" alone does not say where to look.
Callers wrap their collectives in ``failing_as(description)``; a backend error (a peer died,
a timeout, a broken network) is re-raised naming what was being communicated.
"""

from __future__ import annotations

from types import TracebackType

__all__ = ["CollectiveError", "failing_as"]


class CollectiveError(RuntimeError):
    """A collective failed; the message names the operation, then the backend's error."""


class failing_as:  # (lower case: a context manager, named as the function it replaced)
    """Re-raise ``RuntimeError``s (torch's ``DistBackendError`` included) as a
    ``CollectiveError`` that starts with ``description``.

    A class rather than a generator context manager: it wraps every collective of every group
    each step, and one instance can be kept and entered again (two Python calls a use, where
    ``contextlib.contextmanager`` makes five)."""

    __slots__ = ("description",)

    def __init__(self, description: str) -> None:
        self.description = description

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if err is None or isinstance(err, CollectiveError) or not isinstance(err, RuntimeError):
            return
        raise CollectiveError(f"raggedfsdp: {self.description} failed: {err}") from err
