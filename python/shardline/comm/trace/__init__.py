"""Tracing a job and finding what holds it up: ``shardline doctor`` and ``shardline trace``.

``SHARDLINE_TRACE=DIR`` (or ``shardline.init(trace=DIR)``) makes every rank write its timeline,
settings and a heartbeat into ``DIR`` (``recorder``). ``shardline trace merge DIR`` turns the
timelines into one Chrome/Perfetto trace (``merge``); ``shardline doctor DIR`` reads the
folder of a live or finished job and names a hung collective's culprit, a straggler and
settings that differ between ranks (``doctor``); a live job whose NCCL ops are timed on the
GPU on some steps only is first asked for GPU times on every step for a while (``ask``).

    with shardline.trace.span("forward"):   # the program's own spans on the timeline
        out = model(x)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from shardline.comm.trace.recorder import TRACER, Tracer

__all__ = ["TRACER", "Tracer", "flush", "note", "span"]


@contextmanager
def span(name: str) -> Iterator[None]:
    """Times the block as ``name`` on this rank's timeline; nothing when not tracing."""
    with TRACER.span(name):
        yield


def note(key: str, value: object) -> None:
    """Records ``key: value`` among this rank's settings; the doctor compares them across ranks."""
    TRACER.note(key, value)


def flush() -> None:
    """Writes this rank's timeline and heartbeat now, not at the next interval."""
    TRACER.flush()
