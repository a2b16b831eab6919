"""When a traced op ran on its GPU: CUDA events and NCCL's own timing.

An NCCL op returns to Python when it is queued; it runs on the GPU later. While a tracer
listens, the nccl backend attaches an ``OpTiming`` to each op's handle and the tracer turns
it into the op's device start and end, on the same wall clock as every other time it writes:

- a blocking op runs on the caller's stream, between two events recorded around it there;
- an asynchronous op runs on its group's NCCL stream, which first waits for the caller's
  stream and runs the group's ops one after another. One event on the caller's stream, just
  before the op is queued, and the end of the group's previous op say when it could start:
  at the later of the two. NCCL times the op itself (``TORCH_NCCL_ENABLE_TIMING``, which
  ``enable_nccl_timing`` sets for the groups made while tracing is on:
  ``Work._get_duration``); it ends that long after its start. A group made before (NCCL
  does not time its ops) gets no device times for its asynchronous ops.

Nothing here waits for the GPU on the program's thread: the tracer's thread reads each op
once the GPU is past it (``DeviceTimes.resolve``) and keeps it until then. One clock per GPU
maps event times onto ``time.time()``: an event recorded on an idle stream of that GPU and
waited for once, when the tracer's thread reads the GPU's first op. Events are reused once
read.

Events are made, recorded and read through the CUDA driver that torch loaded, by the native
module (``_DriverEvents``): the tracer's thread reads a whole batch in one call with the GIL
released, where torch's ``Event.elapsed_time`` is a call per pair with the GIL held. Without
the native module or a loaded driver, torch's events serve (``TORCH``). A blocking op's two
events are read without asking first whether the GPU is past them: a pair it is not past
reads NaN.

Cost per op: on the program's thread, one or two pooled events recorded on the current stream
(and NCCL's own timing, in torch); on the tracer's thread, one or two event readings, NCCL's
timing of an asynchronous op, and the bookkeeping here, ``CHUNK`` ops at a time with a
``pause`` between. ``benches/bench_trace_ops.py`` measures it per op where the host bounds the
loop (``docs/guides/troubleshooting.md`` gives the numbers), ``benches/bench_trace_blocks.py``
on a whole training step; both measure the way through torch's events too.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

__all__ = [
    "CHUNK",
    "THREAD_NAME",
    "TORCH",
    "DeviceTimes",
    "Events",
    "OpTiming",
    "begin",
    "enable_nccl_timing",
    "events",
    "nccl_timing_enabled",
    "pause",
    "use_events",
]

# Give up on an op's device time this long after it was queued (its work failed, or the
# group was torn down before it ran): the op is then written with its host times only.
GIVE_UP_S = 60.0


_NCCL_TIMING = [False]  # whether enable_nccl_timing ran in this process

# The tracer's thread reads and writes this many ops, then pauses for ``_PAUSE_S`` with the
# GIL released. Left to itself, the interpreter hands the GIL to a waiting thread only every
# ``sys.getswitchinterval()`` (5 ms): the program's thread, between two launches, would wait
# that long, and a step launch-bound on the host with it. A chunk is some 0.5 ms of work; a
# pause long enough for the waiting thread to wake and take the GIL (``time.sleep(0)`` often
# takes it straight back).
CHUNK = 64
_PAUSE_S = 100e-6


# The tracer's thread's name: the one thread that pauses (on the program's thread, in the
# tracer's last write, a pause would only make it wait).
THREAD_NAME = "shardline-trace"


def pause() -> None:
    """Releases the GIL for a moment, on the tracer's thread: a thread waiting takes it.

    See ``CHUNK``.
    """
    if threading.current_thread().name == THREAD_NAME:
        time.sleep(_PAUSE_S)


def enable_nccl_timing() -> None:
    """Makes NCCL groups created from now on time their ops (torch reads it at creation)."""
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"
    _NCCL_TIMING[0] = True


def nccl_timing_enabled() -> bool:
    """Whether NCCL groups created now time their ops (``enable_nccl_timing`` ran)."""
    return _NCCL_TIMING[0]


class OpTiming(NamedTuple):
    """What the GPU will say about one op.

    Attributes:
        device: The GPU's index.
        chain: The group whose NCCL stream runs an asynchronous op (its ops run one after
            another there); ``None`` for a blocking op, which runs on the caller's stream.
        start: The event recorded on the caller's stream just before the op was queued.
        end: A blocking op's event recorded after it on that stream; ``None`` for an
            asynchronous one.
        work: An asynchronous op's torch ``Work``: NCCL's timing of it; ``None`` for a
            blocking one.
        queued: ``time.time()`` when it was queued.
    """

    device: int
    chain: str | None
    start: Any
    end: Any
    work: Any
    queued: float


class Events(Protocol):
    """How events of one GPU are made, recorded and read (``_DriverEvents`` or ``TORCH``).

    An event is whatever ``new`` returns; ``elapsed`` reads many pairs at once (NaN for a
    pair the GPU is not past yet, which is how the tracer learns that it is).
    """

    def new(self, device: int) -> Any:
        """A new timing event of GPU ``device``."""
        ...

    def record(self, device: int, event: Any) -> None:
        """Records ``event`` on GPU ``device``'s current stream."""
        ...

    def of_torch(self, event: torch.cuda.Event) -> Any:
        """``event`` (a recorded torch event) as this kind's event."""
        ...

    def elapsed(self, device: int, firsts: list[Any], seconds: list[Any]) -> list[float]:
        """Milliseconds from each first event to its second; NaN where there is no time."""
        ...


class _TorchEvents:
    """torch's ``Event`` objects, one call each (no native module, or no loaded driver)."""

    def new(self, device: int) -> Any:
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def record(self, device: int, event: Any) -> None:
        torch._C._CudaEventBase.record(event, _current_stream(device)[0])

    def of_torch(self, event: torch.cuda.Event) -> Any:
        return event

    def elapsed(self, device: int, firsts: list[Any], seconds: list[Any]) -> list[float]:
        out = []
        for a, b in zip(firsts, seconds, strict=True):
            try:
                out.append(float(a.elapsed_time(b)))
            except RuntimeError:  # not reached, or never recorded
                out.append(math.nan)
        return out


class _DriverEvents:
    """Driver event handles (ints), through the native module: reads of many with no GIL."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self.new = native.cuda_event_create
        self.elapsed = native.cuda_events_elapsed

    def record(self, device: int, event: Any) -> None:
        self._native.cuda_event_record(device, event, _current_stream(device)[1])

    def of_torch(self, event: torch.cuda.Event) -> Any:
        return event.cuda_event


TORCH: Events = _TorchEvents()
_KIND: list[Events | None] = [None]  # the kind this process records with, chosen once


def events() -> Events:
    """The kind of events this process records with: the driver's where it can, else torch's.

    Chosen at the first traced op (CUDA is initialised by then) and kept: an event is read
    by the kind that recorded it.
    """
    kind = _KIND[0]
    if kind is None:
        try:
            from shardline import _native  # noqa: PLC0415  (reads through torch without it)
        except ImportError:  # the package without its built engine: torch's events serve
            kind = TORCH
        else:
            kind = _DriverEvents(_native) if _native.cuda_events_available() else TORCH
        _KIND[0] = kind
    return kind


def use_events(kind: Events | None) -> None:
    """Records with ``kind`` from now on (``None``: choose again); before any op is traced.

    For measuring one kind against the other (``benches/bench_trace_blocks.py``).
    """
    _KIND[0] = kind
    _FREE.clear()


# Events read by the tracer, by GPU, for the next ops (deque: appends and pops from either
# thread are atomic).
_FREE: dict[int, deque[Any]] = {}
# The current stream of each GPU as torch last gave it: torch's key for it, and the stream as
# a torch ``Stream`` and as the driver's handle.
_STREAMS: dict[int, tuple[Any, Any, int]] = {}


def _current_stream(index: int) -> tuple[Any, int]:
    """``torch.cuda.current_stream(index)`` and its handle, without a new ``Stream`` per op."""
    key = torch._C._cuda_getCurrentStream(index)
    known = _STREAMS.get(index)
    if known is not None and known[0] == key:
        return known[1], known[2]
    stream = torch.cuda.Stream(  # type: ignore[no-untyped-call]
        stream_id=key[0], device_index=key[1], device_type=key[2]
    )
    _STREAMS[index] = (key, stream, int(stream.cuda_stream))
    return stream, int(stream.cuda_stream)


def begin(index: int) -> Any:
    """An event recorded now on GPU ``index``'s current stream, for the op about to be queued."""
    kind = _KIND[0] or events()
    free = _FREE.get(index)
    try:
        event = free.pop() if free is not None else kind.new(index)
    except IndexError:  # none kept, or another thread queuing an op took the last one
        event = kind.new(index)
    kind.record(index, event)
    return event


class _Clock:
    """One GPU's event times as ``time.time()``.

    ``ref`` is a reference event (of the kind given), ``wall`` its wall time.
    """

    def __init__(self, device: int, kind: Events) -> None:
        with torch.cuda.device(device):
            # An idle stream: the event completes as soon as it is queued.
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            self._event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self._event.record(stream)
            self._event.synchronize()
            self.wall = time.time()
        self.ref = kind.of_torch(self._event)


class DeviceTimes:
    """The traced ops whose device times are not yet known, and those that are.

    ``add`` is called on the program's thread; ``resolve``, ``waiting`` and ``pop`` on the
    tracer's (under its flush lock, one at a time).
    """

    def __init__(
        self,
        clock: Callable[[int, Events], Any] = _Clock,
        kind: Events | None = None,
    ) -> None:
        """Follows no op yet.

        ``clock(device, kind)`` gives a GPU's clock (``ref`` and ``wall``); ``kind`` says how
        events are read (default: the process's, ``events()``).
        """
        self._make_clock = clock
        self._kind = kind
        self._clocks: dict[int, Any] = {}
        self._pending: list[tuple[list[Any], OpTiming]] = []
        self._new: list[tuple[list[Any], OpTiming]] = []  # appended by the program's thread
        self._watch: set[int] = set()  # id(record) of every op added and not yet popped
        self._chain_end: dict[tuple[int, str], float] = {}
        self._times: dict[int, tuple[float, float] | None] = {}  # by id(record)

    def add(self, record: list[Any], timing: OpTiming) -> None:
        """Follows ``record``'s op on its GPU (list and set appends: safe from any thread).

        Called before the op's record is finished, so a finished record is never missed.
        """
        self._watch.add(id(record))
        self._new.append((record, timing))

    def waiting(self, record: list[Any]) -> bool:
        """Whether ``record``'s device time is still to come (keep it, do not write it yet)."""
        key = id(record)
        return key in self._watch and key not in self._times

    def resolve(self, now: float | None = None) -> None:
        """Reads the device times of every op the GPU is past, in the order they were queued.

        An op of a chain waits for the chain's earlier ops; one still unread after
        ``GIVE_UP_S`` gets no device time.
        """
        now = time.time() if now is None else now
        n = len(self._new)
        self._pending += self._new[:n]
        del self._new[:n]
        pending = self._pending
        if not pending:
            return
        kind = self._kind or events()
        # The ops of a chain end in the order they were queued: the newest one that ended
        # vouches for every earlier one (one question per chain, not one per op).
        ended: dict[tuple[int, str], int] = {}
        for i in range(len(pending) - 1, -1, -1):
            gpu, chain, _, _, work, _ = pending[i][1]
            if chain is not None and (gpu, chain) not in ended and work.is_completed():
                ended[(gpu, chain)] = i
        # A blocking op has ended once its end event has: its length, read for each GPU in
        # one call, is NaN until then (no separate question whether it ended).
        ends: dict[int, list[int]] = {}
        for i, (_, t) in enumerate(pending):
            if t[1] is None:
                ends.setdefault(t[0], []).append(i)
        lengths: dict[int, float] = {}
        isnan = math.isnan
        for gpu, idx in ends.items():
            ms = kind.elapsed(gpu, [pending[i][1][2] for i in idx], [pending[i][1][3] for i in idx])
            lengths.update((i, m / 1e3) for i, m in zip(idx, ms, strict=True) if not isnan(m))
        blocked: set[tuple[int, str]] = set()
        left: list[tuple[list[Any], OpTiming]] = []
        past: list[tuple[list[Any], OpTiming, tuple[int, str] | None, float]] = []
        nan = math.nan
        for i, op in enumerate(pending):
            t = op[1]
            if t[1] is None:
                key = None
                over = i in lengths
            else:
                key = (t[0], t[1])
                over = key not in blocked and i <= ended.get(key, -1)
            if over:
                past.append((op[0], t, key, lengths.get(i, nan)))
                continue
            if now - t[5] > GIVE_UP_S:
                self._times[id(op[0])] = None
                if key is not None:
                    self._chain_end.pop(key, None)
                continue
            if key is not None:
                blocked.add(key)
            left.append(op)
        self._pending = left
        if past:
            self._read(kind, past)

    def _read(
        self,
        kind: Events,
        past: list[tuple[list[Any], OpTiming, tuple[int, str] | None, float]],
    ) -> None:
        """Notes the device start and end of ops the GPU is past (``None`` for a failed one).

        ``past`` holds each op's record, timing, chain and length where it is known (a
        blocking op's). Only ever asked for ops the GPU is past: reading one it is not past
        gives no time. Each GPU's start events are read against its clock in one call; an
        asynchronous op's length is NCCL's timing of it. The loop runs once per traced op on
        the tracer's thread, with the GIL held: kept to plain tuple and dict operations.
        """
        starts: list[float] = [math.nan] * len(past)
        by_device: dict[int, list[int]] = {}
        for k, op in enumerate(past):
            by_device.setdefault(op[1][0], []).append(k)
        for gpu, idx in by_device.items():
            clock = self._clocks.get(gpu)
            if clock is None:
                clock = self._clocks[gpu] = self._make_clock(gpu, kind)
            ms = kind.elapsed(gpu, [clock.ref] * len(idx), [past[k][1][2] for k in idx])
            wall = clock.wall
            for k, m in zip(idx, ms, strict=True):
                starts[k] = wall + m / 1e3
        times, chain_end, isnan = self._times, self._chain_end, math.isnan
        free = {gpu: _FREE.setdefault(gpu, deque()) for gpu in by_device}
        for k, (record, (gpu, _, first, last, work, _), key, blocking_length) in enumerate(past):
            if k and not k % CHUNK:
                pause()
            length = blocking_length
            if last is None:
                try:
                    length = float(work._get_duration()) / 1e3
                except RuntimeError:  # a failed op: NCCL has no timing of it
                    length = math.nan
            start = starts[k]
            if isnan(length) or isnan(start):
                times[id(record)] = None
            else:
                if key is not None:
                    start = max(start, chain_end.get(key, start))
                    chain_end[key] = start + length
                times[id(record)] = (start, start + length)
            pool = free[gpu]
            pool.append(first)
            if last is not None:
                pool.append(last)

    def pop(self, record: list[Any]) -> tuple[float, float] | None:
        """``record``'s device start and end (wall clock), once; ``None`` when it has none."""
        self._watch.discard(id(record))
        return self._times.pop(id(record), None)

    def finish(self, wait: float = 2.0) -> None:
        """Reads the times of the ops still running on a GPU, waiting up to ``wait`` seconds.

        For the tracer's last write: never longer, so an op that will not end (a dead peer's)
        cannot hold up the exit; it is written with its host times only.
        """
        deadline = time.time() + wait
        self.resolve()
        while self._pending and time.time() < deadline:
            time.sleep(0.005)
            self.resolve()
