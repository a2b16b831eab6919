"""The tracer's CUDA events through the driver (``_native.cuda_events_*``) against torch's.

The same events read both ways give the same milliseconds between two (the same driver call,
so the same float). Events the native module made and recorded bracket work as torch's
recorded at the same points do; in a batch, a pair the GPU is not past yet reads NaN and the
others read their times.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the GPU host)", allow_module_level=True)

from shardline import _native
from shardline.comm import flight
from shardline.comm.trace import device


def _products(n: int = 4096, times: int = 20) -> None:
    a = torch.randn(n, n, device="cuda")
    for _ in range(times):
        a = a @ a
        a /= a.norm()


def test_the_driver_reads_torchs_events_as_torch_does() -> None:
    torch.cuda.init()
    assert _native.cuda_events_available()
    assert isinstance(device.events(), device._DriverEvents)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    marks[0].record()
    for e in marks[1:]:
        _products(times=5)
        e.record()
    torch.cuda.synchronize()
    handles = [e.cuda_event for e in marks]
    pairs = [(0, 1), (1, 2), (0, 3), (3, 0)]
    by_driver = _native.cuda_events_elapsed(0, [handles[a] for a, _ in pairs],
                                            [handles[b] for _, b in pairs])  # fmt: skip
    by_torch = [marks[a].elapsed_time(marks[b]) for a, b in pairs]
    assert by_driver == pytest.approx(by_torch, rel=0, abs=1e-6)
    assert all(ms > 0.1 for ms in by_driver[:3]) and by_driver[3] < 0


def test_events_made_by_the_driver_bracket_work_as_torchs_do_and_a_pending_one_is_said() -> None:
    kind = device.events()
    start, end = kind.new(0), kind.new(0)
    ref_start, ref_end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    torch.cuda.synchronize()
    kind.record(0, start, device._current_stream(0))
    ref_start.record()
    _products(times=40)
    kind.record(0, end, device._current_stream(0))
    ref_end.record()
    # The GPU reaches ``start`` at once; ``end`` waits behind some 100 ms of products.
    deadline = time.time() + 5
    while math.isnan(kind.elapsed(0, [start], [start])[0]) and time.time() < deadline:
        time.sleep(1e-4)
    early = kind.elapsed(0, [start, start], [end, start])
    assert math.isnan(early[0]) and early[1] == 0.0
    torch.cuda.synchronize()
    ms = kind.elapsed(0, [start], [end])[0]
    assert ms == pytest.approx(ref_start.elapsed_time(ref_end), rel=0.02, abs=0.05)


def test_a_traced_ops_device_times_read_through_the_driver_match_torchs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One blocking op bracketed by the tracer's events, read by a ``DeviceTimes`` of each
    kind: placed between its queuing and the host's wait for it, and as long either way."""
    spans = {}
    for kind in (device.events(), device.TORCH):
        monkeypatch.setattr(device, "_KIND", [kind])
        monkeypatch.setattr(device, "_FREE", {})
        times = device.DeviceTimes()
        record: list[object] = [None] * 10
        record[flight.END] = time.time()  # ended on the host: written once timed on the GPU
        queued = time.time()
        t0 = device.begin(0)
        _products(times=10)
        t1 = device.begin(0)
        times.add(record, device.OpTiming(0, None, t0, t1, (), queued))
        torch.cuda.synchronize()
        done = time.time()
        times.resolve()
        written, on_gpu, kept = times.split([record])
        assert written == [record] and kept == []
        spans[kind] = on_gpu[0]
        assert spans[kind] is not None
        assert queued - 0.005 < spans[kind][0] < spans[kind][1] < done + 0.005
    (a0, a1), (b0, b1) = spans.values()
    assert (a1 - a0) == pytest.approx(b1 - b0, rel=0.05)
