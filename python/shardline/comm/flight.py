"""The flight recorder: the last ops of this process, kept in memory, written out on trouble.

Every op a ``ProcessGroup`` runs, on any backend, is one record: its group, its number, its
kind and size, when it started and ended, and how it ended. Collectives are numbered per group
(every rank of a group calls the same ones in the same order, so the numbers agree across
ranks); sends and receives are numbered per peer. The recorder keeps the newest
``SHARDLINE_FLIGHT_OPS`` records (default 1,000; 0 turns it off).

The records go to ``<SHARDLINE_FLIGHT_DIR>/rank<r>.json`` when an op fails (timeout, lost peer,
mismatch) and when the process gets ``SIGUSR1``. ``shardline why DIR`` reads every rank's file
and says in one sentence who holds the job up (``shardline.comm.why``).

Cost: a record is one list appended to a bounded deque and two clock reads, about a
microsecond per op (``benches/bench_flight.py`` measures it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from shardline import config
from shardline.comm.program_line import LINES

__all__ = [
    "RECORDER",
    "FlightRecorder",
    "default_dir",
    "dtype_names",
    "plain",
]

# A record: [group, number, op, numel, dtype, peer, start, end, state, where]; end is None
# while the op runs, state "running", "done" or the error's class name; where is the caller's
# "file:line" when a tracer listens (``sink``), else None.
GROUP, SEQ, OP, NUMEL, DTYPE, PEER, START, END, STATE, WHERE = range(10)
ANY_SOURCE = -1
"""The peer of a receive from any source."""


def default_dir() -> Path:
    """Where dumps go when ``SHARDLINE_FLIGHT_DIR`` is unset: one folder per job."""
    job = config.env_var("TORCHELASTIC_RUN_ID") or "{}-{}".format(
        config.env_var("MASTER_ADDR", default="local"),
        config.env_var("MASTER_PORT", default="0"),
    )
    return Path(tempfile.gettempdir()) / "shardline-flight" / job


class FlightRecorder:
    """This process's last ops (see the module doc); one per process: ``RECORDER``."""

    def __init__(self, capacity: int = 1000) -> None:
        # The records, oldest first.
        self.ops: deque[list[Any]] = deque(maxlen=max(capacity, 1))
        self.enabled = capacity > 0
        self.rank: int | None = None
        self.world_size: int | None = None
        self.directory: Path | None = None
        self.groups: dict[str, list[int]] = {}  # every group's members, by global rank
        # A tracer's list (``shardline.comm.trace``): every record also goes there, with its caller.
        self.sink: list[list[Any]] | None = None
        # The tracer's taker of an op's GPU timing (``shardline.comm.trace.device``).
        self.device_sink: Any = None
        self._lock = threading.RLock()  # a SIGUSR1 may arrive while this thread dumps

    @property
    def listening(self) -> bool:
        """Whether an op's record is wanted: the recorder is on, or a tracer listens."""
        return self.enabled or self.sink is not None

    def configure(
        self, *, rank: int, world_size: int, capacity: int, directory: Path | None
    ) -> None:
        """Set by ``shardline.init``: who this process is and where its dump goes."""
        self.rank, self.world_size = rank, world_size
        self.directory = directory
        self.enabled = capacity > 0
        if self.ops.maxlen != max(capacity, 1):
            self.ops = deque(self.ops, maxlen=max(capacity, 1))

    def start(
        self,
        group: str,
        seq: int,
        op: str,
        numel: int,
        dtype: object,
        peer: int | None,
        inside: int = 0,
    ) -> list[Any] | None:
        """Records an op that starts now; the record to ``finish``, or None when off.

        ``dtype`` may be a ``torch.dtype``: it is turned into text only when dumped.
        ``inside``: how many frames out from the caller are known to be shardline's (the
        caller's own included); the program's line is looked for past them (``callsite``).
        """
        sink = self.sink
        if not self.enabled and sink is None:
            return None
        record = [group, seq, op, numel, dtype, peer, time.time(), None, "running", None]
        if self.enabled:
            self.ops.append(record)
        if sink is not None:
            # The line of the op at this place of the step repeated, where this op repeats it
            # (``StepLines.where``'s own test, here: the common case without a call).
            lines = LINES
            place = lines.place
            repeat = lines.repeat
            if (
                place < len(repeat)
                and (t := repeat[place])[2] == numel
                and t[1] == op
                and t[0] == group
                and t[3] == dtype
                and t[4] == peer
            ):
                lines.place = place + 1
                record[WHERE] = t[5]
            else:
                record[WHERE] = lines.where(group, op, numel, dtype, peer, inside)
            sink.append(record)
        return record

    @staticmethod
    def finish(record: list[Any] | None, error: BaseException | None = None) -> None:
        """The op of ``record`` ended now: done, or failed with ``error``."""
        if record is not None and record[END] is None:
            record[END] = time.time()
            record[STATE] = "done" if error is None else type(error).__name__

    def timed(self, record: list[Any] | None, handle: Any) -> None:
        """Hands the tracer the GPU timing of ``record``'s op, where its handle has one.

        On every op's path: one attribute test when no tracer takes GPU times.
        """
        sink = self.device_sink
        if sink is None or record is None:
            return
        timing = getattr(handle, "timing", None)
        if timing is not None:
            sink(record, timing)

    def records(self) -> list[list[Any]]:
        """A copy of the records, oldest first (dtypes as text: ``"float32"``)."""
        # deque.copy() runs in C without releasing the GIL: safe against appends from other
        # threads, which would break an iteration (``list(deque)``) midway.
        return [plain(r) for r in self.ops.copy()]

    def snapshot(self, reason: str) -> dict[str, Any]:
        """What a dump holds: this process, the reason, and the records."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "reason": reason,
            "groups": dict(self.groups),
            "ops": self.records(),
        }

    def dump(self, reason: str) -> Path | None:
        """Writes ``rank<r>.json`` (atomically) into the dump folder; its path, or None.

        Never raises: a recorder that cannot write must not hide the error being reported.
        """
        if not self.enabled or self.rank is None:
            return None
        directory = self.directory or default_dir()
        path = directory / f"rank{self.rank}.json"
        with self._lock, contextlib.suppress(Exception):
            directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.snapshot(reason)))
            tmp.replace(path)
            return path
        return None

    def install_signal_handler(self) -> bool:
        """Dumps on ``SIGUSR1``, unless the program handles that signal itself.

        Only from the main thread (Python's rule for handlers); True if installed.
        """
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
            return False
        signal.signal(signal.SIGUSR1, lambda *_: self.dump("SIGUSR1"))
        return True


_DTYPE_NAMES: dict[object, str] = {None: ""}  # torch.float32 -> "float32", as met


def dtype_names() -> dict[object, str]:
    """The dtypes met so far, by their names in written records; a writer may add to it.

    ``torch.float32`` is "float32", ``None`` "".
    """
    return _DTYPE_NAMES


def plain(record: list[Any]) -> list[Any]:
    """A copy of ``record`` fit for JSON: its dtype as text (``"float32"``, ``""`` for none)."""
    out = list(record)
    dtype = out[DTYPE]
    if not isinstance(dtype, str):
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
        out[DTYPE] = name
    return out


RECORDER = FlightRecorder()
