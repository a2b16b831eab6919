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
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from shardline import config

__all__ = [
    "RECORDER",
    "FlightRecorder",
    "callsite",
    "default_dir",
    "dtype_names",
    "plain",
    "program_frame",
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
            record[WHERE] = callsite(skip=inside)
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


_libraries: tuple[str, ...] = ()
_programs: tuple[str, ...] = ()  # shardline's own programs (the main job): the user's code


def _library_dirs() -> tuple[str, ...]:
    """The folders of shardline's and torch's files, as their code objects name them."""
    global _libraries, _programs
    if not _libraries:
        dirs, programs = {contextlib.__file__}, set()  # a span's own ``with`` frames
        for name in ("shardline", "torch"):
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None)
            for folder in (
                {str(Path(path).parent), str(Path(path).resolve().parent)} if path else ()
            ):
                dirs.add(folder + os.sep)
                if name == "shardline":
                    programs.add(os.path.join(folder, "examples") + os.sep)
        _libraries, _programs = tuple(dirs), tuple(programs)
    return _libraries


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


# Whether a file is the program's (``program_frame``), by the name its code objects give it.
_PROGRAM_FILES: dict[str, bool] = {}
# ``(code, "file:line")`` by the code object's id and instruction (``_where``): a frame's line
# number is worked out from its code's line table, which costs microseconds in a long
# function. Keyed by id, not by the code object: on Python 3.12 a code object's hash walks
# all of its instructions, each time (on an H200 host 0.3 us for a model's ``forward``, 2 us
# for a module's code, on every traced op). The entry holds its code object, so the id stays
# that code's while the entry lives.
_WHERE: dict[tuple[int, int], tuple[Any, str]] = {}
# Whether a module is shardline's (but for its example programs), torch's or ``contextlib``,
# by name (``_callsite_by_module``).
_LIBRARY_MODULES: dict[str, bool] = {}
# Python 3.12's ``sys._getframemodulename``: the module of a frame deeper in the stack,
# read without making a frame object for it.
_FRAME_MODULE = getattr(sys, "_getframemodulename", None)


def program_frame(frame: Any) -> Any:
    """The first frame out from ``frame`` in the program's own code (see ``callsite``)."""
    known = _PROGRAM_FILES
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        mine = known.get(name)
        if mine is None:
            mine = known[name] = _program_file(name)
        if mine:
            return f
        f = f.f_back
    return None


def _program_file(name: str) -> bool:
    """Whether code of file ``name`` is the program's.

    Not shardline's (but for its example programs), torch's, or frozen (``<...>``).
    """
    skip = _libraries or _library_dirs()
    return (not name.startswith(skip) or name.startswith(_programs)) and name[:1] != "<"


def callsite(frame: Any = None, skip: int = 0) -> str | None:
    """``"train.py:57"``: where the program called into shardline (or torch), from ``frame``.

    The first frame, walking out from ``frame`` (the caller's caller by default, or ``skip``
    frames further out), whose file is neither shardline's (but for its example programs)
    nor torch's (nor frozen: ``<...>``): the user's line that issued the op, even when the
    op runs inside ``loss.backward()`` or a strategy's hook. ``None`` where there is none: a
    thread that runs library code only, such as torch's autograd thread of a GPU, which runs
    a strategy's backward hooks.

    On every traced op's path. An op from a strategy's hook is some 10-40 frames deep, and
    walking them makes a frame object of each: on Python 3.12 and later, frames of library
    modules are passed by their module's name, without one. Inside a GPU training step each
    frame passed costs half a microsecond to a microsecond (on an H200 host; five to ten
    times a loop's), so frames known to be shardline's are not looked at (``skip``).
    """
    if frame is None and _FRAME_MODULE is not None:
        return _callsite_by_module(3 + skip)  # this (0), callsite (1), its caller (2)
    f = program_frame(frame if frame is not None else sys._getframe(2 + skip))
    return None if f is None else _where(f)


def _callsite_by_module(depth: int) -> str | None:
    """``callsite`` from the frame ``depth`` levels out from here, on Python 3.12+."""
    assert _FRAME_MODULE is not None
    module, known = _FRAME_MODULE, _LIBRARY_MODULES
    library = known.get
    while True:
        while library(module(depth)):  # a module met and found a library's
            depth += 1
        name = module(depth)  # None: past the outermost frame, or a frame of no module
        if name is None or name in known:
            break
        known[name] = _library_module(name)  # met for the first time: look at it again
    # The frame itself, or None past the outermost one (without raising, as _getframe would).
    frame = sys._getframe(depth - 1).f_back
    f = None if frame is None else program_frame(frame)  # by its file, as for any frame
    return None if f is None else _where(f)


def _library_module(name: str) -> bool:
    """Whether module ``name``'s frames are passed over by ``callsite``.

    Shardline's (but for its example programs), torch's, and ``contextlib``'s (a span's own
    ``with`` frames).
    """
    top = name.partition(".")[0]
    if top == "shardline":
        return not name.startswith("shardline.examples")
    return top == "torch" or name == "contextlib"


def _where(f: Any) -> str:
    """``"file:line"`` of frame ``f``."""
    code = f.f_code
    key = (id(code), f.f_lasti)
    known = _WHERE.get(key)
    if known is not None:
        return known[1]
    if len(_WHERE) > 100_000:  # a program that makes code without end: start again
        _WHERE.clear()
    where = f"{code.co_filename}:{f.f_lineno}"
    _WHERE[key] = (code, where)
    return where


RECORDER = FlightRecorder()
