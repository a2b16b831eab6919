"""When a traced op ran on its GPU: CUDA events around it.

An NCCL op returns to Python when it is queued; it runs on the GPU later. While a tracer
takes GPU times, the nccl backend runs each op between two events and attaches an
``OpTiming`` to its handle; the tracer turns the events into the op's device start and end,
on the same wall clock as every other time it writes:

- a blocking op runs on the caller's stream, between two events recorded there;
- an asynchronous op runs on a stream of its group's own (``SideStream``; untraced, it would
  run on torch's NCCL stream of the group, which torch does not show): that stream first
  waits for the caller's stream up to the op's start event, runs the op as a blocking op, and
  records the end event. The group's ops run there one after another: an op starts at the
  later of its start event and the end of the group's previous op. The caller's ``wait``
  makes its own stream wait for the op's end, as it does for torch's stream. Torch keeps no
  buffer of such an op alive (it runs "blocking"): the handle does (``TracedDeferred``), and
  a handle dropped before its wait hands its buffers to the op's timing, which the tracer
  keeps until the GPU is past the op.

NCCL's own timing (``TORCH_NCCL_ENABLE_TIMING``), which this replaced, times every op of
every group made while it is on (and none of a group made before).

Nothing here waits for the GPU on the program's thread: the tracer's thread reads each op
once the GPU is past its end event (``DeviceTimes.resolve``). One clock per GPU maps event
times onto ``time.time()``: an event recorded on an idle stream and waited for once. Events
are reused once read. They are made, recorded and read through the CUDA driver that torch
loaded, by the native module (``_DriverEvents``): an op's events in two calls on the
program's thread, and a whole batch's readings in one call with the GIL released. Without
it, torch's events serve (``TORCH``). An event the GPU has not reached reads NaN.

Cost per op: on the program's thread, two events that keep a time and, for an asynchronous
op, two without one (a stream waits on one, the handle on the other), one stream wait and
two switches of the current stream; on the tracer's thread, two event readings and the
bookkeeping, ``CHUNK`` ops at a time with a ``pause`` between. ``benches/bench_trace_ops.py``
and ``bench_trace_blocks.py`` measure it (``docs/guides/troubleshooting.md``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from shardline.comm.flight import END as _END

__all__ = [
    "CHUNK",
    "THREAD_NAME",
    "TORCH",
    "DeviceTimes",
    "Events",
    "OpTiming",
    "SideStream",
    "begin",
    "close",
    "done_reached",
    "enter",
    "events",
    "leave",
    "pause",
    "release_done",
    "use_events",
    "wait_done",
]

# Give up on an op's device time this long after it was queued (its work failed, or the
# group was torn down before it ran): the op is then written with its host times only.
GIVE_UP_S = 60.0

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
    """Releases the GIL for a moment on the tracer's thread (see ``CHUNK``)."""
    if threading.current_thread().name == THREAD_NAME:
        time.sleep(_PAUSE_S)


class OpTiming(NamedTuple):
    """What the GPU will say about one op.

    Attributes:
        device: The GPU's index.
        chain: The group whose own stream ran an asynchronous op (its ops run one after
            another there); ``None`` for a blocking op, which runs on the caller's stream.
        start: The event recorded on the caller's stream just before the op was queued.
        end: The event recorded after it: on the caller's stream (blocking) or the group's.
        keep: Where an asynchronous op's handle, dropped before its wait, leaves the op's
            buffers (kept until the GPU is past ``end``); ``()`` for a blocking op.
        queued: ``time.time()`` when it was queued.
    """

    device: int
    chain: str | None
    start: Any
    end: Any
    keep: Any
    queued: float


def wait_done(works: Sequence[tuple[int, Any]], timeout: float | None) -> None:
    """Waits for traced asynchronous ops (their handle's wait).

    ``works`` holds each op's GPU and the event recorded after it (``close``). The current
    stream waits for each op on the GPU (the host does not); with ``timeout``
    seconds, the host waits.

    Raises:
        RuntimeError: ``timeout`` passed first (the nccl backend names the op).
    """
    kind = _KIND[0] or events()
    for gpu, done in works:
        if timeout is None:
            kind.wait(gpu, _current_stream(gpu), done)
            continue
        deadline = time.monotonic() + timeout
        while not kind.query(gpu, done):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the op timed out: its GPU was not past it after {timeout} s")
            time.sleep(1e-4)


def done_reached(works: Sequence[tuple[int, Any]]) -> bool:
    """Whether the GPU is past each op of ``works`` (as ``wait_done``'s)."""
    kind = _KIND[0] or events()
    return all(kind.query(gpu, done) for gpu, done in works)


def release_done(works: Sequence[tuple[int, Any]]) -> None:
    """The handle no longer needs ``works``' events (it waited, or was dropped): kept for reuse."""
    for gpu, done in works:
        _FREE_SYNC.setdefault(gpu, deque()).append(done)


class _Stream(NamedTuple):
    """One stream three ways: torch's key (id, device, type), torch's object, the driver's."""

    key: tuple[int, int, int]
    torch: Any
    handle: int


class Events(Protocol):
    """How events of one GPU are made, recorded and read (``_DriverEvents`` or ``TORCH``).

    An event is whatever ``new`` returns; ``elapsed`` reads many pairs at once (NaN for a
    pair the GPU is not past yet, which is how the tracer learns that it is).
    """

    def new(self, device: int) -> Any:
        """A new timing event of GPU ``device``."""
        ...

    def new_sync(self, device: int) -> Any:
        """A new event of GPU ``device`` without a time, only to order work by.

        Streams wait on such events, and the host asks about them, faster than about events
        that keep a time.
        """
        ...

    def query(self, device: int, event: Any) -> bool:
        """Whether GPU ``device`` is past ``event``."""
        ...

    def record(self, device: int, event: Any, stream: _Stream) -> None:
        """Records ``event`` on ``stream`` of GPU ``device``."""
        ...

    def wait(self, device: int, stream: _Stream, event: Any) -> None:
        """Makes ``stream`` wait on the GPU until ``event`` (recorded) is reached."""
        ...

    def fork(self, device: int, stream: _Stream, side: _Stream, start: Any, sync: Any) -> None:
        """Records ``start`` then ``sync`` on ``stream`` and makes ``side`` wait for ``sync``."""
        ...

    def record_pair(self, device: int, stream: _Stream, first: Any, second: Any) -> None:
        """Records ``first`` then ``second`` on ``stream``."""
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

    def new_sync(self, device: int) -> Any:
        return torch.cuda.Event()  # type: ignore[no-untyped-call]

    def query(self, device: int, event: Any) -> bool:
        return bool(event.query())

    def record(self, device: int, event: Any, stream: _Stream) -> None:
        torch._C._CudaEventBase.record(event, stream.torch)

    def wait(self, device: int, stream: _Stream, event: Any) -> None:
        stream.torch.wait_event(event)

    def fork(self, device: int, stream: _Stream, side: _Stream, start: Any, sync: Any) -> None:
        self.record(device, start, stream)
        self.record(device, sync, stream)
        self.wait(device, side, sync)

    def record_pair(self, device: int, stream: _Stream, first: Any, second: Any) -> None:
        self.record(device, first, stream)
        self.record(device, second, stream)

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
        self.query = native.cuda_event_query

    def new_sync(self, device: int) -> Any:
        return self._native.cuda_event_create(device, False)

    def record(self, device: int, event: Any, stream: _Stream) -> None:
        self._native.cuda_event_record(device, event, stream.handle)

    def wait(self, device: int, stream: _Stream, event: Any) -> None:
        self._native.cuda_stream_wait(device, stream.handle, event)

    def fork(self, device: int, stream: _Stream, side: _Stream, start: Any, sync: Any) -> None:
        self._native.cuda_events_fork(device, stream.handle, side.handle, start, sync)

    def record_pair(self, device: int, stream: _Stream, first: Any, second: Any) -> None:
        self._native.cuda_events_record_pair(device, stream.handle, first, second)

    def of_torch(self, event: torch.cuda.Event) -> Any:
        return event.cuda_event


TORCH: Events = _TorchEvents()
_KIND: list[Events | None] = [None]  # the kind this process records with, chosen once


def _native_module() -> Any:
    """``shardline._native`` where the driver's calls can be used; else ``None``."""
    try:
        from shardline import _native  # noqa: PLC0415  (reads through torch without it)
    except ImportError:  # the package without its built engine: torch's events serve
        return None
    return _native if _native.cuda_events_available() else None


def events() -> Events:
    """The kind of events this process records with: the driver's where it can, else torch's.

    Chosen at the first traced op (CUDA is initialised by then) and kept: an event is read
    by the kind that recorded it.
    """
    kind = _KIND[0]
    if kind is None:
        native = _native_module()
        kind = _KIND[0] = TORCH if native is None else _DriverEvents(native)
    return kind


def use_events(kind: Events | None) -> None:
    """Records with ``kind`` from now on (``None``: choose again); before any op is traced.

    For measuring one kind against the other (``benches/bench_trace_blocks.py``).
    """
    _KIND[0] = kind
    _FREE.clear()
    _FREE_SYNC.clear()


# Events read by the tracer, by GPU, for the next ops (deque: appends and pops from either
# thread are atomic).
_FREE: dict[int, deque[Any]] = {}
# The same for events without a time (``Events.new_sync``).
_FREE_SYNC: dict[int, deque[Any]] = {}
# Every stream torch has made current while an op was traced, by torch's key for it (a
# handful: the program's streams and the groups' own).
_STREAMS: dict[tuple[int, int, int], _Stream] = {}


def _current_stream(index: int) -> _Stream:
    """GPU ``index``'s current stream, without a new torch ``Stream`` per op."""
    key = torch._C._cuda_getCurrentStream(index)
    known = _STREAMS.get(key)
    if known is not None:
        return known
    stream = torch.cuda.Stream(  # type: ignore[no-untyped-call]
        stream_id=key[0], device_index=key[1], device_type=key[2]
    )
    if len(_STREAMS) > 256:  # a program that makes streams without end: forget the old ones
        _STREAMS.clear()
    known = _STREAMS[key] = _Stream(key, stream, int(stream.cuda_stream))
    return known


class SideStream:
    """A group's own stream of GPU ``device``, for its asynchronous ops while they are traced.

    Made by the driver where the native module can (a stream no other code of the process
    is handed), else taken from torch's pool.
    """

    def __init__(self, device: int) -> None:
        native = _native_module()
        stream: Any
        if native is not None:
            handle = native.cuda_stream_create(device)
            stream = torch.cuda.ExternalStream(  # type: ignore[no-untyped-call]
                handle, device=torch.device("cuda", device)
            )
        else:
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.device = device
        self.stream = _Stream(
            (stream.stream_id, stream.device_index, stream.device_type),
            stream,
            int(stream.cuda_stream),
        )
        _STREAMS[self.stream.key] = self.stream


def _take(kind: Events, index: int) -> Any:
    """A kept timing event of GPU ``index``, or a new one."""
    free = _FREE.get(index)
    try:
        return free.pop() if free is not None else kind.new(index)
    except IndexError:  # none kept, or another thread queuing an op took the last one
        return kind.new(index)


def _take_sync(kind: Events, index: int) -> Any:
    """A kept event without a time of GPU ``index``, or a new one; the GPU's pool exists after."""
    free = _FREE_SYNC.get(index)
    if free is None:
        free = _FREE_SYNC.setdefault(index, deque())
    try:
        return free.pop()
    except IndexError:  # none kept, or another thread queuing an op took the last one
        return kind.new_sync(index)


def begin(index: int) -> Any:
    """An event recorded now on GPU ``index``'s current stream."""
    kind = _KIND[0] or events()
    event = _take(kind, index)
    kind.record(index, event, _current_stream(index))
    return event


def enter(side: SideStream) -> tuple[Any, tuple[int, int, int]]:
    """Records an op's start on the current stream, and makes ``side`` wait for it and current.

    Returns the start event and the key of the stream to go back to (``leave``).
    """
    index = side.device
    kind = _KIND[0] or events()
    start = _take(kind, index)
    current = _current_stream(index)
    # The group's stream waits on an event without a time, not on ``start``: in a ZeRO-3 step
    # on an H200, waiting on ``start`` (one driver call fewer) made ``enter`` 2 us slower.
    # The wait holds the event as recorded now, so it is kept for reuse at once.
    sync = _take_sync(kind, index)
    kind.fork(index, current, side.stream, start, sync)
    _FREE_SYNC[index].append(sync)
    torch._C._cuda_setStream(*side.stream.key)
    return start, current.key


def close(side: SideStream) -> tuple[Any, Any]:
    """Records an op's end on ``side``, then the event (without a time) its handle waits on.

    ``side`` is current since ``enter``. Returns both events.
    """
    index = side.device
    kind = _KIND[0] or events()
    end = _take(kind, index)
    done = _take_sync(kind, index)
    kind.record_pair(index, side.stream, end, done)
    return end, done


def leave(key: tuple[int, int, int]) -> None:
    """Makes the stream of ``key`` (from ``enter``) current again."""
    torch._C._cuda_setStream(*key)


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

    ``add`` is called on the program's thread; ``resolve`` and ``split`` on the tracer's
    (under its flush lock, one at a time).
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
        # The buffers of ops given up on (the GPU may still use them): kept for good.
        self._stuck: list[Any] = []
        self._times: dict[int, tuple[float, float] | None] = {}  # by id(record)
        # CPU seconds spent reading events (``Events.elapsed``: through the driver, without
        # the GIL), for a measure of what the tracer's thread holds the GIL for.
        self.reading_s = 0.0
        self.timed_any = False  # whether any op was taken to be timed (a job with GPU ops)

    def add(self, record: list[Any], timing: OpTiming) -> None:
        """Follows ``record``'s op on its GPU (list and set appends: safe from any thread).

        Called before the op's record is finished, so a finished record is never missed.
        """
        self.timed_any = True
        self._watch.add(id(record))
        self._new.append((record, timing))

    def resolve(self, now: float | None = None) -> None:
        """Reads the device times of every op the GPU is past, in the order they were queued.

        An op of a chain waits for the chain's earlier ops; one still unread after
        ``GIVE_UP_S`` gets no device time (and its buffers stay kept: the GPU may still use
        them).
        """
        now = time.time() if now is None else now
        n = len(self._new)
        self._pending += self._new[:n]
        del self._new[:n]
        pending = self._pending
        if not pending:
            return
        kind = self._kind or events()
        # Each op's start and end against its GPU's clock, one call per GPU: NaN where the
        # GPU has not reached the event yet.
        by_device: dict[int, list[int]] = {}
        for i, (_, t) in enumerate(pending):
            by_device.setdefault(t[0], []).append(i)
        starts: list[float] = [math.nan] * len(pending)
        ends: list[float] = [math.nan] * len(pending)
        for gpu, idx in by_device.items():
            clock = self._clocks.get(gpu)
            if clock is None:
                clock = self._clocks[gpu] = self._make_clock(gpu, kind)
            seconds = [pending[i][1][2] for i in idx] + [pending[i][1][3] for i in idx]
            t0 = time.thread_time()
            ms = kind.elapsed(gpu, [clock.ref] * len(seconds), seconds)
            self.reading_s += time.thread_time() - t0
            wall, m = clock.wall, len(idx)
            for k, i in enumerate(idx):
                starts[i] = wall + ms[k] / 1e3
                ends[i] = wall + ms[m + k] / 1e3
        times, chain_end, isnan = self._times, self._chain_end, math.isnan
        pools = {gpu: _FREE.setdefault(gpu, deque()) for gpu in by_device}
        blocked: set[tuple[int, str]] = set()
        left: list[tuple[list[Any], OpTiming]] = []
        for i, op in enumerate(pending):
            if i and not i % CHUNK:
                pause()
            record, t = op
            key = None if t[1] is None else (t[0], t[1])
            end = ends[i]
            if isnan(end) or key in blocked:  # not past it (nor past a chain's later ops)
                if now - t[5] > GIVE_UP_S:
                    times[id(record)] = None
                    if key is not None:
                        chain_end.pop(key, None)
                        self._stuck.append(t[4])
                    continue
                if key is not None:
                    blocked.add(key)
                left.append(op)
                continue
            start = starts[i]
            if isnan(start):  # the start was never recorded: no time to give
                times[id(record)] = None
            else:
                if key is not None:
                    start = max(start, chain_end.get(key, start))
                    chain_end[key] = end
                times[id(record)] = (start, end)
            pool = pools[t[0]]
            pool.append(t[2])
            pool.append(t[3])
        self._pending = left

    def split(
        self, records: list[list[Any]]
    ) -> tuple[list[list[Any]], list[tuple[float, float] | None], list[list[Any]]]:
        """``records`` split: those to write now, their device spans, and those to keep.

        A record is kept while its op runs here, or while its device time is still to come; a
        written one's span is given once (``None`` after, and for an op not timed on a GPU).
        The tracer's write, in one pass: on its thread with the GIL held, per op.
        """
        watch, times = self._watch, self._times
        done: list[list[Any]] = []
        spans: list[tuple[float, float] | None] = []
        running: list[list[Any]] = []
        for r in records:
            if r[_END] is None:
                running.append(r)
                continue
            key = id(r)
            if key in watch:
                if key not in times:
                    running.append(r)
                    continue
                watch.discard(key)
                spans.append(times.pop(key))
            else:
                spans.append(None)
            done.append(r)
        return done, spans, running

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
