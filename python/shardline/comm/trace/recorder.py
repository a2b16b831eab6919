"""A rank's tracer: its timeline, its settings and a heartbeat, written into one folder.

With ``SHARDLINE_TRACE=DIR`` (or ``shardline.init(trace=DIR)``) every rank writes, into
``DIR``:

- ``rank<r>.config.json`` once: who it is (host, pid), its versions, every ``SHARDLINE_*``
  setting as it resolved, and what the program noted (``note``; ``distribute`` notes its
  strategy). ``shardline doctor`` compares them across ranks.
- ``rank<r>.trace.jsonl``, appended every ``SHARDLINE_TRACE_INTERVAL`` seconds by a thread of
  its own: the events that finished since. Events are the flight recorder's records of every
  op (group, number, op, size, start, end, how it ended, the user's ``file:line`` that issued
  it; an NCCL op also its start and end on the GPU, from CUDA events: ``device``), one line
  for all of a write's ops; optimizer steps (``torch.optim``'s global step hooks: no change
  to the program) and the program's own spans (``span``), a line each. ``shardline trace
  merge`` turns the ranks' files into one Chrome/Perfetto trace.
- ``rank<r>.now.json``, rewritten at the same pace: the heartbeat. The ops running now, and
  where every thread that runs one (and the main thread) is in the program's code. The thread
  writes it even while the main thread waits inside a collective (the GIL is released there),
  so a live job's hang can be read from the folder within one interval; a rank whose
  heartbeat stops is stopped or dead. Its ``state`` is ``running``, then ``shutdown`` (the
  program called ``shardline.shutdown``) or ``exited`` (the interpreter exited without it).

NCCL ops take their GPU times on one optimizer step in ``SHARDLINE_TRACE_GPU`` (``1``: every
step; ``0``: none), all of a step's ops or none; a step's line says whether it took them
(``"gpu"``). The doctor may ask for them on every step for a while (``ask``): the thread looks
for its request at each write.

Cost: an op's record gains its caller: walked on the steps that take GPU times (on one
in ``LINES_EVERY`` without them), repeated by the ops of the steps between that repeat
theirs (``program_line.StepLines``); the thread wakes once per
interval and writes what finished since, ``CHUNK`` ops at a time, pausing between them: the
program's thread, which needs the GIL to launch its next kernel, never waits for a whole
write (on an H200 host a second's ops, about 1,000, took some 20 ms of CPU to read and
write; in one hold of the GIL, the interpreter hands it over only every 5 ms).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import platform
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from shardline import config
from shardline._version import __version__
from shardline.comm import flight, program_line
from shardline.comm.flight import RECORDER
from shardline.comm.trace.ask import Inbox
from shardline.comm.trace.device import CHUNK, THREAD_NAME, DeviceTimes, pause
from shardline.errors import ShardlineError

__all__ = ["TRACER", "Tracer"]

# Event lines of ``rank<r>.trace.jsonl``: {"k": "ops", "r": [<flight record>, ...]} for the ops
# that finished since the last write (a line per ``CHUNK`` of them: one call of the native
# encoder each, ``_ops_line``; a record timed on its GPU has its device start and end appended),
# {"k": "step", "n": n, "t0": start, "t1": end} for an optimizer step (and "gpu": whether its
# ops took GPU times, while they are sampled),
# {"k": "span", "name": name, "t0": start, "t1": end, "where": "file:line"} for a span.


# Without GPU times (``SHARDLINE_TRACE_GPU=0``), the ops' program lines are walked on one
# step in this many.
LINES_EVERY = 16


class Tracer:
    """This process's tracer (one: ``TRACER``); see the module doc."""

    def __init__(self) -> None:
        self.directory: Path | None = None
        self.rank: int | None = None
        self.interval = 1.0
        self._ops: list[list[Any]] = []  # the flight recorder's sink: records, as they start
        self._events: list[dict[str, Any]] = []  # finished steps and spans
        self._running: list[list[Any]] = []  # op records not finished at the last write
        self._notes: dict[str, Any] = {}
        self._steps = 0
        self._step_start: float | None = None
        # NCCL ops' GPU times on one optimizer step in ``gpu_every`` (0: none), and on every
        # step of ``_asked``'s ``[from, until)`` (the doctor's request); whether the step
        # running now takes them.
        self.gpu_every = 0
        self._asked: dict[str, Any] = {}
        self._gpu_step = False
        self._inbox: Inbox | None = None
        self._written = 0  # steps in the timeline file
        self._hooks: list[Any] = []
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file: Any = None
        self._exit_registered = False
        self._info: dict[str, Any] = {}  # what rank<r>.config.json holds
        self.device = DeviceTimes()  # NCCL ops' times on the GPU, read as they finish

    @property
    def active(self) -> bool:
        """Whether this process traces now."""
        return self.directory is not None

    # -- starting and stopping -----------------------------------------------------------------

    def start(
        self, directory: str | os.PathLike[str], *, rank: int, world_size: int,
        backend: str, interval: float | None = None,
    ) -> None:  # fmt: skip
        """Starts tracing this rank into ``directory`` (created if missing)."""
        if self.active:
            self.stop()
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.directory, self.rank = path, rank
        self.interval = interval if interval is not None else config.get("SHARDLINE_TRACE_INTERVAL")
        self._stop.clear()
        self._steps, self._step_start, self._written = 0, None, 0
        settings = {s.name: _setting(s.name) for s in config.SETTINGS}
        if settings.get("SHARDLINE_SECRET"):  # never on disk: only whether it is set
            settings["SHARDLINE_SECRET"] = "<set>"
        info = {
            "rank": rank,
            "world_size": world_size,
            "backend": backend,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "versions": _versions(),
            "settings": settings,
            "notes": self._notes,
        }
        self._info = info
        _write_atomic(path / f"rank{rank}.config.json", info)
        # A job's rank starts its timeline afresh (a folder traced twice holds the last run).
        # Unbuffered bytes: a line's write is one system call, made with the GIL released.
        self._file = open(path / f"rank{rank}.trace.jsonl", "wb", buffering=0)  # noqa: SIM115
        RECORDER.sink = self._ops
        self.device = DeviceTimes()
        self.gpu_every = config.get("SHARDLINE_TRACE_GPU")
        self._asked = {}
        self._inbox = Inbox(path)
        program_line.LINES.reset()
        self._sample(0)
        self._install_hooks()
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
        self._thread.start()
        if not self._exit_registered:
            atexit.register(self._at_exit)
            self._exit_registered = True

    def stop(self, state: str = "shutdown") -> None:
        """Writes what is left and the last heartbeat (saying ``state``), and stops tracing."""
        if not self.active:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        RECORDER.device_sink = None
        with self._flushing, contextlib.suppress(Exception):
            self.device.finish()  # the last ops' GPU times, before the last write
        self.flush(state=state)
        RECORDER.sink = None
        program_line.LINES.reset()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._file is not None:
            self._file.close()
        self._file, self.directory, self._thread = None, None, None

    def _at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.stop(state="exited")

    # -- what the program adds -------------------------------------------------------------------

    def note(self, key: str, value: Any) -> None:
        """Adds ``key: value`` to this rank's settings (compared across ranks by the doctor)."""
        self._notes[key] = _jsonable(value)  # (the written settings hold this dict)
        if self.active:
            assert self.directory is not None
            with contextlib.suppress(OSError):
                _write_atomic(self.directory / f"rank{self.rank}.config.json", self._info)

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Times the block as ``name`` on this rank's timeline (nothing when not tracing)."""
        if not self.active:
            yield
            return
        where = program_line.callsite(sys._getframe(2))
        t0 = time.time()
        try:
            yield
        finally:
            with self._lock:
                self._events.append(
                    {"k": "span", "name": name, "t0": t0, "t1": time.time(), "where": where}
                )

    def _install_hooks(self) -> None:
        def pre(*_: Any) -> None:
            self._step_start = time.time()

        def post(*_: Any) -> None:
            t1 = time.time()
            with self._lock:
                event = {"k": "step", "n": self._steps, "t0": self._step_start or t1, "t1": t1}
                if self.gpu_every and self.device.timed_any:  # a job whose ops run on GPUs
                    event["gpu"] = self._gpu_step
                self._events.append(event)
                self._steps += 1
                self._sample(self._steps)

        self._hooks = [register_optimizer_step_pre_hook(pre),
                       register_optimizer_step_post_hook(post)]  # fmt: skip

    def _sample(self, step: int) -> None:
        """Whether step ``step``'s NCCL ops take GPU times, and its ops' lines are walked.

        From now to the step's end. On one step in ``gpu_every``, and on every step the
        doctor asked for: a step's ops all do or none do, so a sampled step's timeline is
        whole on its GPU (what the doctor's straggler check reads). The ops' program lines
        are walked on those steps (on one in ``LINES_EVERY`` without GPU times); the steps
        between repeat them where their ops do (``program_line.StepLines``).
        """
        every, asked = self.gpu_every, self._asked
        self._gpu_step = bool(every) and (
            step % every == 0 or (bool(asked) and asked["from"] <= step < asked["until"])
        )
        RECORDER.device_sink = self.device.add if self._gpu_step else None
        program_line.LINES.step(self._gpu_step or step % (every or LINES_EVERY) == 0)

    def _answer(self) -> None:
        """Takes GPU times on every step the doctor's new request asks for, from the next on.

        On the tracer's thread; the program's reads ``_asked`` at its next step's end (one
        dict swapped whole). With GPU times off, a request is left unanswered.
        """
        request = self._inbox.poll() if self._inbox is not None else None
        if request is None or not self.gpu_every:
            return
        rid, steps = request
        first = self._steps + 1  # the step running now may have queued untimed ops
        self._asked = {"id": rid, "from": first, "until": first + steps}

    # -- writing ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # a full disk must not stop training
                self.flush()

    def flush(self, state: str = "running") -> None:
        """Appends the finished events to the timeline and rewrites the heartbeat now."""
        with self._flushing:  # the thread's and the program's flushes, one at a time
            self._flush(state)

    def _flush(self, state: str) -> None:
        if self.directory is None or self._file is None:
            return
        n = len(self._ops)  # the recorder appends from any thread: take the first n only
        fresh = self._ops[:n]
        del self._ops[:n]
        with self._lock:
            events, self._events = self._events, []
        self._answer()
        ops = self._running + fresh
        device = self.device
        device.resolve()
        # An op is written once it ended here and, when timed on a GPU, there too.
        done, spans, self._running = device.split(ops)
        file = self._file
        for i in range(0, len(done), CHUNK):
            if i:
                pause()
            _write_all(file, _ops_line(done[i : i + CHUNK], spans[i : i + CHUNK]))
        if events:
            _write_all(file, "".join(json.dumps(e) + "\n" for e in events).encode())
        written = [e["n"] + 1 for e in events if e["k"] == "step"]
        self._written = max(written, default=self._written)
        self._heartbeat(state)

    def _heartbeat(self, state: str) -> None:
        assert self.directory is not None
        frames = sys._current_frames()
        main = threading.main_thread().ident
        threads = []
        for t in threading.enumerate():
            if t.ident is None or t.ident not in frames or t.name == THREAD_NAME:
                continue
            f = program_line.program_frame(frames[t.ident])
            if f is None and t.ident != main:
                continue  # a thread of a library (the engine's, torch's): not the program's
            where = None if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"
            threads.append({"name": t.name, "main": t.ident == main, "where": where,
                            "function": None if f is None else f.f_code.co_name})  # fmt: skip
        now = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": self._info["host"],
            "time": time.time(),
            "interval": self.interval,
            "state": state,
            "steps": self._steps,
            "steps_written": self._written,
            "gpu_every": self.gpu_every,
            "running": [flight.plain(r) for r in self._running],
            "groups": dict(RECORDER.groups),
            "threads": threads,
        }
        if self._asked:
            now["asked"] = self._asked
        _write_atomic(self.directory / f"rank{self.rank}.now.json", now)


# The native encoder of a line of ops (``_native.trace_ops_line``), looked for at the first
# write; ``None`` where the package runs without its built engine.
_ENCODER: list[Any] = []


def _ops_line(records: list[list[Any]], spans: list[tuple[float, float] | None]) -> bytes:
    """``{"k": "ops", "r": [...]}`` and its newline, as UTF-8, for ``records`` and spans.

    Each record with its device span where it has one. Encoded natively in one call where
    it can; a record holding a value the native encoder does not write (a float that is not
    finite, say) takes ``json.dumps``, as all do without the engine.
    """
    if not _ENCODER:
        try:
            from shardline import _native  # noqa: PLC0415  (the package works without it)
        except ImportError:
            _ENCODER.append(None)
        else:
            _ENCODER.append(_native.trace_ops_line)
    encode = _ENCODER[0]
    if encode is not None:
        with contextlib.suppress(ValueError, TypeError):
            return bytes(encode(records, spans, flight.dtype_names()))
    part = [_op_record(r, span) for r, span in zip(records, spans, strict=True)]
    return (json.dumps({"k": "ops", "r": part}) + "\n").encode()


def _write_all(file: Any, data: bytes) -> None:
    """Writes all of ``data`` to the unbuffered ``file`` (a write may take only part)."""
    view = memoryview(data)
    while view:
        view = view[file.write(view) :]


def _op_record(record: list[Any], on_device: tuple[float, float] | None) -> list[Any]:
    out = flight.plain(record)
    if on_device is not None:
        out += on_device
    return out


def _setting(name: str) -> Any:
    """A setting's value as the program sees it; its text where it does not parse."""
    try:
        return _jsonable(config.get(name))
    except ShardlineError:
        return config.raw(name)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def _versions() -> dict[str, str]:
    return {
        "shardline": __version__,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "cuda": str(torch.version.cuda),
    }


def _write_atomic(path: Path, value: Any) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


TRACER = Tracer()
