"""The error an op that failed here raises: recorded, dumped, and explained where it can be.

Every failed op is finished in the flight recorder and the recorder's ops are dumped (the
error names the file and ``shardline why``). A collective that timed out asks the other ranks
where they are (``why.diagnose``), and its error says who holds the group up. Ops refused
before they ran are returned as they are: nothing ran to explain.

[Note: a rank that left normally] A rank whose script ends without an uncaught exception
(its ``atexit``), or that calls ``shardline.shutdown()`` with no error in flight, says so in
the job's store (``note_left``) before its groups close. A rank that then loses it in an op
(``PeerLostError``) reads that note and says the rank left normally, before this op (a
collective missing on it, an early return), instead of sending the user to its log for a
root cause it does not have.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

from shardline.comm import flight, why
from shardline.comm.flight import RECORDER
from shardline.errors import (
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    PeerLostError,
    ShardlineError,
)

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    from shardline.comm.group import ProcessGroup

__all__ = ["explained", "left_out", "note_left", "use_job_store"]

# The sub-group each group last left this rank out of: ``new_group`` gave the rank ``None``,
# which passed as ``group=`` means the whole world (torch.distributed's meaning). A collective
# of that group that times out on this rank says so: the others may be in the sub-group's op.
_LEFT_OUT: weakref.WeakKeyDictionary[ProcessGroup, tuple[str, list[int]]] = (
    weakref.WeakKeyDictionary()
)


def left_out(group: ProcessGroup, name: str, members: list[int]) -> None:
    """Notes that ``group.new_group(members)`` (sub-group ``name``) left this rank out."""
    _LEFT_OUT[group] = (name, members)


_LEFT = "shardline/left/{rank}"
_job_store: Store | None = None  # the job's store, from init
_ASK_S = 2.0  # how long a rank that lost a peer asks the store for its note, at most
# The engine's words for a peer that is gone, and the group rank each names (shared memory;
# TCP), then the advice that follows them, which a note replaces.
_GONE = (re.compile(r"lost rank (\d+) \(pid \d+\)"), re.compile(r"rank (\d+) \([^()]*\) closed"))
_ADVICE = (
    "the process exited or closed its communicator; check that rank's log for the root cause",
    "it probably exited or crashed — check its log",
)
_HOW = {
    "ended": "exited normally (its script ended with no uncaught exception)",
    "shutdown": "left the job normally (it called shardline.shutdown() with no error in flight)",
}


def note_left(store: Any, rank: int, how: str) -> None:
    """Says in the job's store that ``rank`` leaves normally (``how``: ended, or shutdown).

    ``how`` is ``"ended"`` (its script ended) or ``"shutdown"``; see [Note: a rank that left
    normally]. Best effort; nothing is said while an exception is in flight or after an
    uncaught one.
    """
    if sys.exc_info()[1] is not None or getattr(sys, "last_value", None) is not None:
        return
    _bounded(lambda: store.set(_LEFT.format(rank=rank), how))


def _left_note(store: Any, rank: int) -> str | None:
    """The note ``rank`` left, if any (the store's host may be the rank that left)."""
    key = _LEFT.format(rank=rank)
    found = _bounded(lambda: bytes(store.get(key)).decode() if store.check([key]) else None)
    return found if isinstance(found, str) else None


def _bounded(call: Any) -> object:
    """``call()`` on a helper thread, given ``_ASK_S`` at most.

    ``None`` if it failed or took longer: a store whose host is gone must not hold this
    rank up.
    """
    out: list[object] = []

    def run() -> None:
        with contextlib.suppress(Exception):
            out.append(call())

    helper = threading.Thread(target=run, name="shardline-left-note", daemon=True)
    helper.start()
    helper.join(_ASK_S)
    return out[0] if out and not helper.is_alive() else None


def use_job_store(store: Store | None) -> None:
    """Sets the job's store, for notes of ranks that left and ``why``.

    ``init`` calls it when it joins a job, ``shutdown`` with ``None``. How long ``why`` asks
    the other ranks follows the timeout of the group whose op timed out.
    """
    global _job_store  # noqa: PLW0603
    _job_store = store


def _said_left(group: ProcessGroup, exc: PeerLostError, record: list[object] | None) -> None:
    """Rewrites ``exc`` in place when the rank it lost left normally (its note says so)."""
    text = str(exc.args[0]) if exc.args else ""
    if record is not None:
        collective = record[flight.PEER] is None
    else:  # the recorder is off: the engine's words say which
        collective = re.search(r"point-to-point|during (send|recv)\(", text) is None
    advice = next((a for a in _ADVICE if a in text), None)
    found = next((m for p in _GONE if (m := p.search(text)) is not None), None)
    job = _job_store
    if advice is None or found is None or job is None:
        return
    lost = int(found.group(1))  # a rank of the group: the note is under its job rank
    if lost >= len(group.global_ranks):
        return
    how = _HOW.get(_left_note(job, group.global_ranks[lost]) or "")
    if how is None:
        return
    if collective:
        said = (
            f"rank {lost} {how} before it called this collective; check that every rank calls "
            f"the same collectives in the same order (a call missing on rank {lost}, or an "
            "early return there)"
        )
    else:
        said = (
            f"rank {lost} {how} before it took part in this transfer; check that it posts the "
            "matching send or recv (a call missing there, or an early return)"
        )
    with contextlib.suppress(Exception):
        exc.args = (text.replace(advice, said), *exc.args[1:])


def explained(
    group: ProcessGroup, record: list[object] | None, exc: ShardlineError
) -> ShardlineError:
    """The error to raise for ``exc``, which an op of ``group`` (its flight ``record``) raised."""
    RECORDER.finish(record, exc)
    if isinstance(exc, InvalidArgumentError | CommunicatorClosedError):
        return exc  # refused before it ran: nothing to explain
    if isinstance(exc, PeerLostError):
        _said_left(group, exc, record)
    out = exc
    collective = record is not None and record[flight.PEER] is None
    if isinstance(exc, CollectiveTimeoutError) and collective:
        store = _job_store
        if store is not None:
            assert record is not None
            sentence = why.diagnose(group, record, store, group.timeout)
            if sentence:
                out = CollectiveTimeoutError(f"{exc}\nwho holds it up: {sentence}")
        left = _LEFT_OUT.get(group)
        if left is not None:
            name, members = left
            out = CollectiveTimeoutError(
                f"{out}\nrank {group.rank} is not in sub-group {name!r} (ranks {members} of "
                f"{group.name!r}): new_group gave it None, and group=None means the whole "
                f"world; if this call was meant for {name!r}, make it on those ranks only"
            )
    op = record[flight.OP] if record is not None else "an op"
    path = RECORDER.dump(f"{type(exc).__name__} in {op}: {exc}")
    if path is not None:
        note = (f"\n(this rank's last ops: {path}; `shardline why {path.parent}` reads "
                "every rank's)")  # fmt: skip
        if out is exc:
            with contextlib.suppress(Exception):
                exc.args = (f"{exc.args[0] if exc.args else exc}{note}", *exc.args[1:])
        else:
            out = CollectiveTimeoutError(f"{out}{note}")
    return out
