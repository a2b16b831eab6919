"""Traffic accounting: the bytes each op of a group moves through this rank's link.

Every ``ProcessGroup`` counts, per op kind, the calls and the bytes sent and received by this
rank, as a bandwidth-optimal algorithm moves them: for ``n`` ranks and ``B`` bytes, a ring
all_reduce sends and receives ``2 (n-1)/n B``; a reduce_scatter ``(n-1)/n`` of its input; an
all_gather the ``n-1`` other ranks' parts; an all_to_all ``(n-1)/n B``; point to point ``B``;
a broadcast ``B`` at the root and at each receiver. The counts depend only on the ops' sizes
and the group's size, never on timing, so they are equal on every run and comparable across
backends; what the wire carries on top (frame headers, a tree's extra hops) is not counted.
``benches/bench_compression.py`` checks them against the network interfaces' own counters.

``group.traffic()`` reads a group's counts. A strategy that shares a group with other users
(DDP runs on the caller's group) also counts its own ops: inside ``charged_to(counter)``, every
op issued on this thread is added to ``counter`` as well; ``model.comm_stats()`` reads it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["OpTraffic", "Traffic", "charge", "charged_to", "merge"]


@dataclass
class OpTraffic:
    """What one op kind moved through this rank: ``calls``, bytes ``sent`` and ``received``."""

    calls: int = 0
    sent: int = 0
    received: int = 0

    def as_dict(self) -> dict[str, int]:
        """``{"calls": .., "sent": .., "received": ..}``."""
        return {"calls": self.calls, "sent": self.sent, "received": self.received}


class Traffic:
    """Per-op counters of one group (thread-safe: ops may be issued from helper threads)."""

    def __init__(self) -> None:
        self._ops: dict[str, OpTraffic] = {}
        self._lock = threading.Lock()

    def add(self, op: str, sent: float, received: float) -> None:
        """Counts one call of ``op`` moving ``sent`` and ``received`` bytes."""
        with self._lock:
            try:
                row = self._ops[op]
            except KeyError:
                row = self._ops[op] = OpTraffic()
            row.calls += 1
            row.sent += int(sent)
            row.received += int(received)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{op: {"calls", "sent", "received"}}`` so far."""
        with self._lock:
            return {op: row.as_dict() for op, row in sorted(self._ops.items())}

    def reset(self) -> None:
        """Starts counting from zero."""
        with self._lock:
            self._ops.clear()


_CHARGE: contextvars.ContextVar[Traffic | None] = contextvars.ContextVar(
    "shardline_traffic_charge", default=None
)


@contextlib.contextmanager
def charged_to(counter: Traffic) -> Iterator[None]:
    """Ops issued inside (on this thread) are also counted in ``counter``."""
    token = _CHARGE.set(counter)
    try:
        yield
    finally:
        _CHARGE.reset(token)


def charge() -> Traffic | None:
    """The counter ops issued now are charged to, if any."""
    return _CHARGE.get()


def merge(*snapshots: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Sums ``Traffic.snapshot()`` dictionaries op by op (a strategy's several groups)."""
    out: dict[str, dict[str, int]] = {}
    for snap in snapshots:
        for op, row in snap.items():
            into = out.setdefault(op, {"calls": 0, "sent": 0, "received": 0})
            for k, v in row.items():
                into[k] += v
    return dict(sorted(out.items()))


# -- what each op moves through one rank's link, bandwidth-optimally ----------------------------


def all_reduce(n: int, nbytes: int) -> tuple[float, float]:
    """A ring all_reduce of ``nbytes``: ``2 (n-1)/n`` of it each way."""
    b = 2 * (n - 1) * nbytes / n
    return b, b


def reduce_scatter(n: int, input_bytes: int) -> tuple[float, float]:
    """``(n-1)/n`` of the input each way."""
    b = (n - 1) * input_bytes / n
    return b, b


def all_gather(n: int, input_bytes: int, output_bytes: int) -> tuple[float, float]:
    """This rank's part to every other rank (forwarded along a ring), the others' parts in."""
    del n
    b = output_bytes - input_bytes
    return b, b


def rooted(n: int, nbytes: int, *, root: bool, to_root: bool, parts: bool) -> tuple[float, float]:
    """Ops with a root: broadcast, reduce, scatter, gather.

    broadcast and reduce (``parts=False``): ``nbytes`` is the whole buffer, moved once between
    the root and each rank. scatter and gather (``parts=True``): ``nbytes`` is one rank's part;
    the root moves the other ``n - 1`` parts. ``to_root``: reduce and gather flow into it.
    """
    at_root = float((n - 1) * nbytes if parts else nbytes)
    mine = float(nbytes)
    if to_root:
        return (0.0, at_root) if root else (mine, 0.0)
    return (at_root, 0.0) if root else (0.0, mine)


def all_to_all(n: int, nbytes: int) -> tuple[float, float]:
    """``(n-1)/n`` of the buffer each way (the part for itself stays)."""
    b = (n - 1) * nbytes / n
    return b, b
