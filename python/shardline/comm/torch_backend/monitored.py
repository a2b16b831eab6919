"""``monitored_barrier``: a barrier that names the ranks which did not reach it in time.

torch's ``dist.monitored_barrier`` (Gloo's ``monitoredBarrier``): every rank but 0 reports
to rank 0 and waits; rank 0 waits for every report up to ``timeout``, then releases the others
or raises naming the first rank that did not report (every such rank with
``wait_all_ranks``). The messages are Gloo's, which torch's tests and users' log scrapers
match.

Here the reports travel through the group's rendezvous store, not the engine: a rank that
never arrives then leaves no receive pending in the group's op queue, and the ranks that did
arrive learn rank 0's verdict at once (with Gloo they wait out their own deadline) and raise
with rank 0's reason.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING

from shardline.errors import MonitoredBarrierError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["monitored_barrier"]

_POLL_S = 0.002  # how often rank 0 looks for reports it still waits for
_PASSED = "passed"


def monitored_barrier(
    store: Store,
    rank: int,
    size: int,
    call: int,
    timeout: float,
    group_timeout: float,
    wait_all_ranks: bool,
) -> None:
    """One monitored barrier of a group (every rank's ``call``-th).

    Args:
        store: The group's own store (a prefix of the job's); keys live under ``call``.
        rank: This rank in the group.
        size: The group's size.
        call: How many monitored barriers this rank ran on the group before.
        timeout: Seconds rank 0 waits for the other ranks.
        group_timeout: Seconds the other ranks wait for rank 0's verdict.
        wait_all_ranks: Rank 0 names every rank that did not arrive, not only the first.

    Raises:
        MonitoredBarrierError: A rank did not arrive in time (on rank 0: which; on the others:
            that rank 0 failed the barrier, and why).
    """
    key = f"monitored_barrier/{call}"
    if rank != 0:
        store.set(f"{key}/{rank}", "1")
        verdict = _await(store, f"{key}/verdict", group_timeout)
        if verdict != _PASSED:
            why = verdict or f"no verdict from rank 0 within {group_timeout:g} s"
            raise MonitoredBarrierError(
                f"Rank {rank} successfully reached monitoredBarrier, but received errors while "
                "waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank. "
                f"Rank 0: {why}"
            )
        return
    ms = round(timeout * 1000)
    deadline = time.monotonic() + timeout
    waiting = list(range(1, size))
    passed: list[int] = []
    while waiting:
        arrived = [r for r in waiting if store.check([f"{key}/{r}"])]
        passed += arrived
        waiting = [r for r in waiting if r not in arrived]
        if not waiting:
            break
        if time.monotonic() >= deadline:
            error = _failure(waiting, passed, ms, wait_all_ranks)
            store.set(f"{key}/verdict", error)
            raise MonitoredBarrierError(error)
        time.sleep(_POLL_S)
    store.set(f"{key}/verdict", _PASSED)


def _failure(missing: list[int], passed: list[int], ms: int, wait_all_ranks: bool) -> str:
    """Gloo's message for ranks that did not arrive within ``ms``."""
    if wait_all_ranks:
        ranks = ", ".join(str(r) for r in missing)
        return f"[Rank 0]: Ranks {ranks} failed to pass monitoredBarrier in {ms} ms"
    if ms == 0:  # nothing could arrive: rank 0's own time ran out, as Gloo says it
        done = (
            f"Successfully processed ranks: {', '.join(str(r) for r in passed)}"
            if passed
            else "No ranks successfully processed in monitoredBarrier."
        )
        return f"Rank 0 timed out in monitoredBarrier after {ms} ms.\n{done}"
    return f"[Rank 0]: Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms"


def _await(store: Store, key: str, seconds: float) -> str | None:
    """``key``'s value once it is set, or ``None`` after ``seconds``."""
    try:
        store.wait([key], timedelta(seconds=seconds))
    except RuntimeError:  # torch's store raises DistStoreError (a RuntimeError) on timeout
        return None
    return store.get(key).decode()
