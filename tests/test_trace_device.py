"""The tracer's GPU times, without a GPU: the bookkeeping of ``trace.device`` with stand-in
events, the handle of a traced asynchronous op, and the nccl backend's traced path with a
stand-in group (the same path on a GPU: ``tests/gpu/test_trace_cuda.py``,
``tests/gpu/test_cuda_events.py``).
"""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any

import pytest
import torch

from shardline import _native
from shardline.comm import flight
from shardline.comm.backends._deferred import EventWaits, TracedDeferred
from shardline.comm.trace import device
from shardline.errors import InvalidArgumentError


class _Event:
    """A CUDA event's stand-in: ``at`` is its device time (seconds), ``None`` until then."""

    def __init__(self, at: float | None) -> None:
        self.at = at

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, end: _Event) -> float:
        if self.at is None or end.at is None:
            raise RuntimeError("not completed")
        return (end.at - self.at) * 1e3


class _Clock:
    def __init__(self, gpu: int, kind: device.Events) -> None:
        self.ref = _Event(0.0)
        self.wall = 1000.0 * (gpu + 1)  # device time 0 is wall time 1000 (GPU 0)


def _timed(
    chain: str | None, at: float, end: _Event, queued: float | None = None, gpu: int = 0
) -> device.OpTiming:
    """An op of group ``chain`` (``None``: blocking), queued when the caller's stream was at
    ``at``, ending at ``end``."""
    when = time.time() if queued is None else queued
    return device.OpTiming(gpu, chain, _Event(at), end, [] if chain else (), when)


def _ended() -> list[Any]:
    """A record of an op that ended on the host: its device time decides when it is written."""
    record: list[Any] = [None] * 10
    record[flight.END] = 0.0
    return record


_KEPT = "kept"


def _written(times: device.DeviceTimes, record: list[Any]) -> Any:
    """What the tracer's write does with ``record`` now: ``_KEPT``, or the span it writes."""
    _, spans, kept = times.split([record])
    return _KEPT if kept else spans[0]


def test_device_times_chain_an_async_groups_ops_and_bracket_blocking_ones() -> None:
    times = device.DeviceTimes(clock=_Clock, kind=device.TORCH)
    a, b, c, blocking = (_ended() for _ in range(4))
    e_a, e_b, e_c, e_blocking = (_Event(None) for _ in range(4))
    times.add(a, _timed("g", 1.0, e_a))  # queued when the caller's stream reached 1.0
    times.add(b, _timed("g", 1.5, e_b))  # queued before a ended: runs after it
    times.add(c, _timed("h", 2.0, e_c))  # another group: its own stream
    times.add(blocking, _timed(None, 3.0, e_blocking))  # on the caller's stream
    times.resolve()
    assert all(_written(times, r) == _KEPT for r in (a, b, c, blocking))
    e_a.at, e_c.at, e_blocking.at = 1.8, 2.25, 3.4
    times.resolve()
    assert _written(times, b) == _KEPT
    assert _written(times, a) == pytest.approx((1001.0, 1001.8))
    assert _written(times, c) == pytest.approx((1002.0, 1002.25))
    assert _written(times, blocking) == pytest.approx((1003.0, 1003.4))
    e_b.at = 1.9
    times.resolve()
    assert _written(times, b) == pytest.approx((1001.8, 1001.9))  # after a, not at its queuing
    assert _written(times, b) is None  # once


def test_a_write_takes_the_records_that_ended_here_and_on_their_gpu_once() -> None:
    """``split``: what the tracer writes now (with device spans) and what it keeps."""
    times = device.DeviceTimes(clock=_Clock, kind=device.TORCH)
    host, running, gpu_done, gpu_later = ([n, None] * 5 for n in range(4))
    for r in (host, gpu_done, gpu_later):
        r[flight.END] = 5.0  # ended here; ``running`` did not
    e_done, e_later = _Event(1.5), _Event(None)
    times.add(gpu_done, _timed("g", 1.0, e_done))
    times.add(gpu_later, _timed("h", 1.0, e_later))
    times.add(running, _timed(None, 1.0, _Event(1.2)))
    times.resolve()
    done, spans, kept = times.split([host, running, gpu_done, gpu_later])
    assert done == [host, gpu_done] and kept == [running, gpu_later]
    assert spans[0] is None and spans[1] == pytest.approx((1001.0, 1001.5))
    running[flight.END] = 6.0
    e_later.at = 2.0
    times.resolve()
    done, spans, kept = times.split(kept)
    assert done == [running, gpu_later] and kept == []
    assert spans == [pytest.approx((1001.0, 1001.2)), pytest.approx((1001.0, 1002.0))]
    assert times.split([gpu_done]) == ([gpu_done], [None], [])  # its span went with it


def test_each_gpus_events_are_read_in_one_call_and_reused_once_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, int]] = []

    class Counted(device._TorchEvents):
        def elapsed(self, gpu: int, firsts: list[Any], seconds: list[Any]) -> list[float]:
            calls.append((gpu, len(firsts)))
            return super().elapsed(gpu, firsts, seconds)

    monkeypatch.setattr(device, "_FREE", {})
    times = device.DeviceTimes(clock=_Clock, kind=Counted())
    records = [_ended() for _ in range(5)]
    timings = [_timed("g", float(k), _Event(k + 0.5), gpu=k % 2) for k in range(5)]
    timings.append(_timed(None, 9.0, _Event(9.5)))  # and a blocking op, on GPU 0
    records.append(_ended())
    for r, t in zip(records, timings, strict=True):
        times.add(r, t)
    times.resolve()
    assert sorted(calls) == [(0, 8), (1, 4)]  # a start and an end per op
    assert _written(times, records[3]) == pytest.approx((2003.0, 2003.5))  # GPU 1's clock
    assert [len(device._FREE[g]) for g in (0, 1)] == [8, 4]  # each read event kept for reuse
    assert timings[0].end in device._FREE[0] and timings[1].start in device._FREE[1]


def test_device_times_give_up_on_an_op_that_never_ends_and_keep_its_buffers() -> None:
    times = device.DeviceTimes(clock=_Clock, kind=device.TORCH)
    stuck, later = _ended(), _ended()
    timing = _timed("g", 1.0, _Event(None), queued=10.0)
    timing.keep.append(("buffers",))  # its handle was dropped before its wait
    times.add(stuck, timing)
    times.resolve(now=10.0 + device.GIVE_UP_S / 2)
    assert _written(times, stuck) == _KEPT
    times.resolve(now=10.0 + device.GIVE_UP_S + 1)
    assert _written(times, stuck) is None
    assert times._stuck == [[("buffers",)]]  # the GPU may still use them: never let go
    times.add(later, _timed("g", 2.0, _Event(2.005)))  # the chain goes on from its own event
    times.resolve()
    assert _written(times, later) == pytest.approx((1002.0, 1002.005))
    times.finish(wait=0.0)  # nothing left: returns at once


def test_a_traced_handle_dropped_before_its_wait_leaves_its_buffers_to_the_tracer() -> None:
    """An op a tracer runs on its group's stream has no buffers kept by torch: the handle
    keeps them until its wait, or hands them on when dropped unwaited."""

    done: list[object] = []

    def handle(timing: device.OpTiming) -> TracedDeferred:
        works = [(0, object())]
        waits = EventWaits(lambda *_: None, lambda _: False, done.append)
        return TracedDeferred(works, timing, None, None, buffers, waits)

    buffers = (torch.ones(4),)
    waited = handle(_timed("g", 1.0, _Event(None)))
    dropped = handle(kept := _timed("g", 1.0, _Event(None)))
    waited.wait()
    assert waited.timing.keep == [] and len(done) == 1  # done with the event it waited on
    del dropped
    gc.collect()
    assert kept.keep == [buffers] and len(done) == 2
    waited.wait()  # again: nothing more
    assert len(done) == 2


def test_events_go_through_the_driver_where_one_is_loaded_and_through_torch_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    here = _native.cuda_events_available()
    for loaded, kind in ((False, device._TorchEvents), (True, device._DriverEvents)):
        monkeypatch.setattr(device, "_KIND", [None])
        monkeypatch.setattr(_native, "cuda_events_available", lambda loaded=loaded: loaded)
        assert isinstance(device.events(), kind)
        assert device.events() is device.events()  # chosen once
    if not here:  # no driver loaded in this process: each call says so
        for call in (
            lambda: _native.cuda_events_elapsed(0, [1], [2]),
            lambda: _native.cuda_stream_create(0),
            lambda: _native.cuda_stream_wait(0, 1, 2),
        ):
            with pytest.raises(InvalidArgumentError, match="no CUDA driver is loaded"):
                call()


def test_an_op_takes_a_kept_event_or_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``begin`` records a kept event where one is kept; none kept, a new one; and where
    another thread took the last kept one between a look and the take, a new one too."""
    recorded: list[str] = []

    class Kind:
        made = 0

        def new(self, gpu: int) -> str:
            Kind.made += 1
            return f"new{Kind.made}"

        def record(self, gpu: int, event: str, stream: object) -> None:
            assert stream == "current"
            recorded.append(event)

    monkeypatch.setattr(device, "_KIND", [Kind()])
    monkeypatch.setattr(device, "_current_stream", lambda gpu: "current")
    monkeypatch.setattr(device, "_FREE", {})
    assert device.begin(0) == "new1"
    device._FREE[0] = deque(["kept"])
    assert [device.begin(0), device.begin(0)] == ["kept", "new2"]

    class Raced(deque):  # looks non-empty, but the last event is gone when taken
        def __bool__(self) -> bool:
            return True

        def __len__(self) -> int:
            return 1

    device._FREE[0] = Raced()
    assert device.begin(0) == "new3"
    assert recorded == ["new1", "kept", "new2", "new3"]


# -- the nccl backend's traced path, with a stand-in group and stand-in events ------------------


class _SideStream:
    def __init__(self, gpu: int) -> None:
        self.device = gpu


@pytest.fixture
def traced_backend(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[str]]:
    """An ``NcclBackend`` on no GPU: its traced path's calls into ``trace.device``, logged."""
    from shardline.comm.backends import nccl

    calls: list[str] = []
    count = iter(range(1000))

    def event(name: str) -> str:
        calls.append(name)
        return f"{name}{next(count)}"

    monkeypatch.setattr(device, "SideStream", _SideStream)
    monkeypatch.setattr(device, "enter", lambda side: (event("enter"), "back"))
    monkeypatch.setattr(device, "leave", lambda key: calls.append(f"leave {key}"))
    monkeypatch.setattr(device, "begin", lambda gpu: event("begin"))
    monkeypatch.setattr(device, "close", lambda side: (event("close"), event("signal")))
    monkeypatch.setattr(nccl.RECORDER, "device_sink", lambda record, timing: None)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
    backend = nccl.NcclBackend.__new__(nccl.NcclBackend)
    backend._gpu, backend._side, backend.group_name, backend.rank = 0, None, "g", 0
    backend._opts = {}
    return backend, calls


def test_a_traced_async_op_runs_blocking_on_its_groups_stream_between_two_events(
    traced_backend: tuple[Any, list[str]],
) -> None:
    import torch.distributed as dist

    from shardline.comm.backends import nccl

    backend, calls = traced_backend
    opts = backend._options(dist.AllreduceOptions, True, "sum")
    assert opts.asyncOp is False  # queued as a blocking op (on the group's stream)
    buf = torch.ones(4)

    def allreduce(tensors: list[torch.Tensor], o: Any) -> None:
        calls.append("allreduce")  # asyncOp=False: torch returns no Work

    handle = backend._run("all_reduce", allreduce, ([buf], opts), True)
    assert calls == ["enter", "allreduce", "close", "signal", "leave back"]
    assert isinstance(handle, TracedDeferred)
    t = handle.timing
    assert (t.device, t.chain, t.start, t.end, t.keep) == (0, "g", "enter0", "close1", [])
    assert handle._works == ((0, "signal2"),) and any(k[0] == [buf] for k in handle._keep)

    def broken(*_: Any) -> None:
        raise RuntimeError("NCCL communicator was aborted")

    calls.clear()
    with pytest.raises(nccl.CommunicatorClosedError, match="all_reduce on rank 0"):
        backend._run("all_reduce", broken, ([buf], opts), True)
    assert calls == ["enter", "leave back"]  # the caller's stream is current again
    calls.clear()
    blocking = backend._run("all_reduce", allreduce, ([buf], opts), False)
    assert calls == ["begin", "allreduce", "begin"]  # on the caller's stream
    assert blocking.timing.chain is None and blocking.timing.keep == ()
    nccl.RECORDER.device_sink = None
    assert backend._options(dist.AllreduceOptions, True, "sum").asyncOp is True
    untraced = backend._run("all_reduce", allreduce, ([buf], opts), True)
    assert untraced.is_completed() and type(untraced) is nccl.Deferred  # ran blocking
    untraced.wait()


def test_an_op_queued_while_a_cuda_graph_is_captured_runs_as_untraced(
    traced_backend: tuple[Any, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events and a stream switch of ours would be captured into the graph and replayed
    with it: under capture the op runs on torch's own path, as it does untraced."""
    import torch.distributed as dist

    from shardline.comm.backends import nccl

    backend, calls = traced_backend
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True)
    opts = backend._options(dist.AllreduceOptions, True, "sum")
    assert opts.asyncOp is True  # torch's NCCL stream, as untraced

    class Work:
        def wait(self) -> None:
            calls.append("wait")

    handle = backend._run("all_reduce", lambda *_: Work(), ([torch.ones(2)], opts), True)
    assert type(handle) is nccl.Deferred and handle.timing is None and calls == []
    handle.wait()
    assert calls == ["wait"]
