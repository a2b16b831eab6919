"""Whether this process joins a job that is already training: elastic says so, wrappers ask.

A process that replaces a lost rank, or joins an elastic job that has grown, gets its model
and optimizer state from the survivors' restore (``shardline.elastic.run``), not from the
start-up collectives that ``distribute`` and the wrappers run (the survivors do not run them).
The elastic layer tells this module how to know (``tell``); the wrappers ask ``is_joining()``.
Outside an elastic job nothing is told and ``is_joining()`` is ``False``.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["is_joining", "tell"]

_ask: Callable[[], bool] | None = None


def tell(ask: Callable[[], bool]) -> None:
    """Installs how to know whether this process joins a running job (the elastic layer's)."""
    global _ask  # noqa: PLW0603
    _ask = ask


def is_joining() -> bool:
    """Whether this process joined a running job and has not taken part in a restore yet."""
    return _ask is not None and _ask()
