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

Cost on the program's thread, per op: one or two pooled events recorded on the current
stream (2.5 microseconds each on an H200 host); on the tracer's thread, two readings of
the GPU's clock per op, ``CHUNK`` ops at a time with a ``pause`` between
(``benches/bench_trace_blocks.py`` measures a whole step).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = [
    "CHUNK",
    "DeviceTimes",
    "OpTiming",
    "begin",
    "enable_nccl_timing",
    "nccl_timing_enabled",
    "pause",
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


def pause() -> None:
    """Releases the GIL for a moment: a thread waiting for it takes it (see ``CHUNK``)."""
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


# Events read by the tracer, by GPU, for the next ops (deque: appends and pops from either
# thread are atomic).
_FREE: dict[int, deque[Any]] = {}
# The current stream of each GPU as torch last gave it: (torch's key for it, the Stream).
_STREAMS: dict[int, tuple[Any, Any]] = {}


def _current_stream(index: int) -> Any:
    """``torch.cuda.current_stream(index)``, without making a new ``Stream`` for each op."""
    key = torch._C._cuda_getCurrentStream(index)
    known = _STREAMS.get(index)
    if known is not None and known[0] == key:
        return known[1]
    stream = torch.cuda.Stream(  # type: ignore[no-untyped-call]
        stream_id=key[0], device_index=key[1], device_type=key[2]
    )
    _STREAMS[index] = (key, stream)
    return stream


def begin(index: int) -> Any:
    """An event recorded now on GPU ``index``'s current stream, for the op about to be queued."""
    free = _FREE.get(index)
    event = free.pop() if free else torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch._C._CudaEventBase.record(event, _current_stream(index))
    return event


class _Clock:
    """One GPU's event times as ``time.time()``: a reference event and its wall time."""

    def __init__(self, device: int) -> None:
        with torch.cuda.device(device):
            # An idle stream: the event completes as soon as it is queued.
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            self.ref = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self.ref.record(stream)
            self.ref.synchronize()
            self.wall = time.time()

    def wall_of(self, event: Any) -> float:
        return self.wall + float(self.ref.elapsed_time(event)) / 1e3


class DeviceTimes:
    """The traced ops whose device times are not yet known, and those that are.

    ``add`` is called on the program's thread; ``resolve``, ``waiting`` and ``pop`` on the
    tracer's (under its flush lock, one at a time).
    """

    def __init__(self, clock: Callable[[int], Any] = _Clock) -> None:
        self._make_clock = clock
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
        # The ops of a chain end in the order they were queued: the newest one that ended
        # vouches for every earlier one (one question per chain, not one per op).
        ended: dict[tuple[int, str], int] = {}
        for i in range(len(pending) - 1, -1, -1):
            t = pending[i][1]
            if t.chain is not None and (t.device, t.chain) not in ended and t.work.is_completed():
                ended[(t.device, t.chain)] = i
        blocked: set[tuple[int, str]] = set()
        left: list[tuple[list[Any], OpTiming]] = []
        for i, (record, t) in enumerate(pending):
            if i and not i % CHUNK:
                pause()
            key = (t.device, t.chain) if t.chain is not None else None
            if key is None:
                past = bool(t.end.query())
            else:
                past = key not in blocked and i <= ended.get(key, -1)
            if not past:
                if now - t.queued > GIVE_UP_S:
                    self._times[id(record)] = None
                    if key is not None:
                        self._chain_end.pop(key, None)
                    continue
                if key is not None:
                    blocked.add(key)
                left.append((record, t))
                continue
            self._times[id(record)] = self._read(t, key)
            free = _FREE.setdefault(t.device, deque())
            free.append(t.start)
            if t.end is not None:
                free.append(t.end)
        self._pending = left

    def _read(self, t: OpTiming, key: tuple[int, str] | None) -> tuple[float, float] | None:
        """The device start and end of an op the GPU is past (``None`` for a failed one).

        Only ever asked for such an op: reading one the GPU is not past raises, and torch's
        error costs far more than asking first.
        """
        clock = self._clocks.get(t.device)
        if clock is None:
            clock = self._clocks[t.device] = self._make_clock(t.device)
        try:
            if t.end is not None:
                length = float(t.start.elapsed_time(t.end)) / 1e3
            else:
                length = float(t.work._get_duration()) / 1e3
        except RuntimeError:  # a failed op: NCCL has no timing of it
            return None
        start = clock.wall_of(t.start)
        if key is not None:
            start = max(start, self._chain_end.get(key, start))
            self._chain_end[key] = start + length
        return start, start + length

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
