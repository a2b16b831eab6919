"""The error an op that failed here raises: recorded, dumped, and explained where it can be.

Every failed op is finished in the flight recorder and the recorder's ops are dumped (the
error names the file and ``shardline why``). A collective that timed out asks the other ranks
where they are (``why.diagnose``), and its error says who holds the group up. Ops refused
before they ran are returned as they are: nothing ran to explain.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from shardline.comm import flight, why
from shardline.comm.flight import RECORDER
from shardline.errors import (
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    ShardlineError,
)

if TYPE_CHECKING:
    from shardline.comm.group import ProcessGroup

__all__ = ["explained"]


def explained(
    group: ProcessGroup, record: list[object] | None, exc: ShardlineError
) -> ShardlineError:
    """The error to raise for ``exc``, which an op of ``group`` (its flight ``record``) raised."""
    RECORDER.finish(record, exc)
    if isinstance(exc, InvalidArgumentError | CommunicatorClosedError):
        return exc  # refused before it ran: nothing to explain
    out = exc
    collective = record is not None and record[flight.PEER] is None
    if isinstance(exc, CollectiveTimeoutError) and collective:
        from shardline.comm import world  # noqa: PLC0415 (world imports the group module)

        job = world.job_store()
        if job is not None:
            store, timeout = job
            assert record is not None
            sentence = why.diagnose(group, record, store, timeout)
            if sentence:
                out = CollectiveTimeoutError(f"{exc}\nwho holds it up: {sentence}")
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
