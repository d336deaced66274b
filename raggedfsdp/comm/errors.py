"""``CollectiveError``: a failed collective, named.

On a job of thousands of ranks, "connection reset by peer" alone does not say where to look.
Callers wrap their collectives in ``failing_as(description)``; a backend error (a peer died,
a timeout, a broken network) is re-raised naming what was being communicated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["CollectiveError", "failing_as"]


class CollectiveError(RuntimeError):
    """A collective failed; the message names the operation, then the backend's error."""


@contextmanager
def failing_as(description: str) -> Iterator[None]:
    """Re-raise ``RuntimeError``s (torch's ``DistBackendError`` included) as a
    ``CollectiveError`` that starts with ``description``."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as err:
        raise CollectiveError(f"raggedfsdp: {description} failed: {err}") from err
