"""The tracer's files and the doctor's reading of them, in one process (no job).

The fault-injection trials on real jobs are in ``tests/multiprocess/test_doctor.py``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline import _native
from shardline.comm import flight
from shardline.comm.flight import RECORDER
from shardline.comm.trace import device, doctor, folder, merge, recorder
from shardline.comm.trace.recorder import Tracer
from shardline.errors import InvalidArgumentError
from tests.test_trace_device import _Clock, _Event, _timed


@pytest.fixture
def tracer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tracer]:
    monkeypatch.setenv("SHARDLINE_SECRET", "do-not-write-me")
    t = Tracer()
    t.start(tmp_path, rank=0, world_size=1, backend="native", interval=60.0)
    yield t
    t.stop()


def test_ops_steps_and_spans_land_in_the_timeline_with_the_users_line(
    tracer: Tracer, tmp_path: Path
) -> None:
    line = _line_of("RECORDER.start(")
    record = RECORDER.start("world", 0, "all_reduce", 8, torch.float32, None)
    RECORDER.finish(record)
    with tracer.span("forward"):
        pass
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    running = RECORDER.start("world", 1, "broadcast", 4, torch.int64, None)
    tracer.flush()
    events = [json.loads(x) for x in (tmp_path / "rank0.trace.jsonl").read_text().splitlines()]
    (op,) = [r for e in events if e["k"] == "ops" for r in e["r"]]
    assert op[flight.OP] == "all_reduce" and op[flight.DTYPE] == "float32"
    assert op[flight.WHERE] == f"{__file__}:{line}"
    assert [e["name"] for e in events if e["k"] == "span"] == ["forward"]
    assert [e["n"] for e in events if e["k"] == "step"] == [0]
    now = json.loads((tmp_path / "rank0.now.json").read_text())
    assert now["state"] == "running" and now["steps"] == 1
    assert [(o[flight.OP], o[flight.SEQ]) for o in now["running"]] == [("broadcast", 1)]
    main = next(t for t in now["threads"] if t["main"])
    assert main["where"] == f"{__file__}:{_line_of('tracer.flush()')}"
    assert main["function"] == "test_ops_steps_and_spans_land_in_the_timeline_with_the_users_line"
    RECORDER.finish(running)
    tracer.stop()
    assert json.loads((tmp_path / "rank0.now.json").read_text())["state"] == "shutdown"
    config = json.loads((tmp_path / "rank0.config.json").read_text())
    assert config["settings"]["SHARDLINE_SECRET"] == "<set>"
    assert "do-not-write-me" not in "".join(p.read_text() for p in tmp_path.iterdir())
    doc = merge.chrome_trace(tmp_path)
    names = sorted(e["name"] for e in doc["traceEvents"] if e["ph"] == "X")
    assert names == ["all_reduce #0", "broadcast #1", "forward", "step 0"]


def test_a_long_write_goes_in_chunks_with_the_gil_released_between(
    tracer: Tracer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second's ops are read and written ``CHUNK`` at a time, with a pause between chunks
    (where the program's thread takes the GIL): every op lands once, in order."""
    paused: list[str] = []
    monkeypatch.setattr(device, "pause", lambda: paused.append("read"))
    monkeypatch.setattr("shardline.comm.trace.recorder.pause", lambda: paused.append("write"))
    tracer.device = device.DeviceTimes(clock=_Clock, kind=device.TORCH)
    RECORDER.device_sink = tracer.device.add
    n = 2 * device.CHUNK + 5
    for k in range(n):
        record = RECORDER.start("world", k, "all_reduce", 8, torch.float32, None)
        handle = type("Handle", (), {"timing": _timed("world", float(k), _Event(k + 1e-3))})
        RECORDER.timed(record, handle)
        RECORDER.finish(record)
    tracer.flush()
    lines = [json.loads(x) for x in (tmp_path / "rank0.trace.jsonl").read_text().splitlines()]
    assert [len(e["r"]) for e in lines] == [device.CHUNK, device.CHUNK, 5]
    written = [r for e in lines for r in e["r"]]
    assert [r[flight.SEQ] for r in written] == list(range(n))
    assert all(folder.device_span(r) is not None for r in written)
    assert paused == ["read", "read", "write", "write"]


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, x in enumerate(lines, 1) if text in x and "_line_of" not in x)


def _rank(folder: Path, r: int, settings: dict[str, object], steps: list[float],
          gaps: float | list[float], world: int = 3) -> None:  # fmt: skip
    """A finished rank's files: ``steps`` end times, one all-reduce before each, ``gaps``
    seconds outside communication per step (one for all, or one per step)."""
    (folder / f"rank{r}.config.json").write_text(json.dumps(
        {"rank": r, "world_size": world, "backend": "native", "versions": {"torch": "2"},
         "settings": settings, "notes": {}, "started": steps[0] - 1.0}
    ))  # fmt: skip
    lines = []
    for n, t1 in enumerate(steps):
        start = t1 - 0.1 + (gaps if isinstance(gaps, float) else gaps[n])
        lines.append({"k": "op", "r": ["world", n, "all_reduce", 4, "float32", None, start,
                                       t1 - 0.001, "done", "train.py:9"]})  # fmt: skip
        lines.append({"k": "step", "n": n, "t0": t1 - 0.001, "t1": t1})
    (folder / f"rank{r}.trace.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (folder / f"rank{r}.now.json").write_text(json.dumps(
        {"rank": r, "pid": os.getpid(), "host": "elsewhere", "time": steps[-1], "interval": 1,
         "state": "shutdown", "running": [], "threads": []}
    ))  # fmt: skip


def test_a_straggler_and_a_differing_setting_are_named(tmp_path: Path) -> None:
    steps = [100.0 + 0.1 * k for k in range(25)]
    for r in range(3):
        _rank(
            tmp_path,
            r,
            {"SHARDLINE_SPIN_US": 50 if r != 1 else 0},
            steps,
            0.02 if r != 2 else 0.025,
        )
    rep = doctor.examine(tmp_path)
    assert not rep.live and rep.steps == 25
    assert rep.culprits("straggler") == {2} and rep.culprits("settings") == {1}, rep.text()
    assert "rank 1 has SHARDLINE_SPIN_US=0 where ranks 0, 2 have 50" in rep.text()


def test_one_delayed_step_is_not_a_straggler(tmp_path: Path) -> None:
    """A rank whose one step a busy host delayed by 40 ms (2 ms per step over 20, 10 % of its
    20 ms outside communication) is not slow in its steps: the check takes their lower
    quartile."""
    steps = [100.0 + 0.1 * k for k in range(25)]
    delayed = [t + (0.04 if k >= 15 else 0.0) for k, t in enumerate(steps)]
    for r in range(3):
        _rank(tmp_path, r, {}, delayed if r == 0 else steps, 0.02)
    rep = doctor.examine(tmp_path, steps=20, slower=0.07)
    assert rep.culprits("straggler") == set(), rep.text()


def test_a_slow_rank_is_named_though_a_busy_host_delays_the_others_in_half_their_steps(
    tmp_path: Path,
) -> None:
    """Rank 2 needs 15 % longer in every step; ranks 0 and 1 wait 4 ms for a core in 11 of
    their last 20 steps (more ranks than cores: a busy host only adds time). By the median of
    the steps they look as slow as rank 2; by the lower quartile only rank 2 is slow."""
    steps = [100.0 + 0.1 * k for k in range(25)]
    busy = [0.02 + (0.004 if k % 2 or k == 24 else 0.0) for k in range(25)]
    for r in range(3):
        _rank(tmp_path, r, {}, steps, busy if r != 2 else 0.023)
    rep = doctor.examine(tmp_path, steps=20, slower=0.07)
    assert rep.culprits("straggler") == {2}, rep.text()
    assert "rank 2 spends 24.0 ms per step outside communication" in rep.text(), rep.text()


def test_an_earlier_runs_higher_ranks_in_the_folder_are_left_out_and_said(
    tmp_path: Path,
) -> None:
    """A 4-rank run traced here, then a 3-rank run into the same folder: the first run's
    rank 3 (slower, other settings, its heartbeat long stale) is no rank of the job."""
    earlier = [50.0 + 0.1 * k for k in range(25)]
    for r in range(4):
        _rank(tmp_path, r, {"SHARDLINE_SPIN_US": 0}, earlier, 0.04 if r == 3 else 0.02, world=4)
    steps = [100.0 + 0.1 * k for k in range(25)]
    for r in range(3):
        _rank(tmp_path, r, {"SHARDLINE_SPIN_US": 50}, steps, 0.02)
    rep = doctor.examine(tmp_path)
    assert rep.ranks == 3 and rep.findings == [], rep.text()
    assert "rank3.* left out: the newest run" in rep.text() and "has 3 ranks" in rep.text()
    assert sorted({e["pid"] for e in merge.chrome_trace(tmp_path)["traceEvents"]}) == [0, 1, 2]


def test_a_settings_file_whose_start_or_world_is_not_a_number_is_read_without_them(
    tmp_path: Path,
) -> None:
    steps = [100.0 + 0.1 * k for k in range(25)]
    for r in range(3):
        _rank(tmp_path, r, {}, steps, 0.02)
    config = tmp_path / "rank1.config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "started": "today"}))
    assert doctor.examine(tmp_path).findings == []
    config.write_text(json.dumps({**json.loads(config.read_text()), "started": 1e12,
                                  "world_size": "3"}))  # fmt: skip
    rep = doctor.examine(tmp_path)
    assert rep.ranks == 3 and rep.culprits("settings") == {1}, rep.text()


def _beat(folder: Path, r: int, at: float) -> None:
    """Rank ``r``'s heartbeat of a running job on another host, taken at ``at``; written
    whole, then renamed into place, as the tracer writes it (a reader never sees half)."""
    tmp = folder / f"rank{r}.now.json.tmp"
    tmp.write_text(json.dumps(
        {"rank": r, "pid": os.getpid(), "host": "elsewhere", "time": at, "interval": 1,
         "state": "running", "running": [], "threads": []}
    ))  # fmt: skip
    tmp.replace(folder / f"rank{r}.now.json")


@pytest.mark.parametrize("beating", [True, False])
def test_a_rank_whose_host_clock_is_behind_is_alive_while_it_beats(
    tmp_path: Path, beating: bool
) -> None:
    """Rank 1's host clock is 6 s behind the doctor's: its heartbeat reads 6 s old, staler than
    a live job's may be. While it still beats it is alive (and the clock said); once it stops
    it is silent."""
    steps = [100.0 + 0.1 * k for k in range(25)]
    for r in range(3):
        _rank(tmp_path, r, {}, steps, 0.02)
        _beat(tmp_path, r, time.time() - (6.0 if r == 1 else 0.0))
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.2):
            _beat(tmp_path, 1, time.time() - 6.0)

    writer = threading.Thread(target=beat, daemon=True)
    if beating:
        writer.start()
    try:
        rep = doctor.examine(tmp_path)
    finally:
        stop.set()
    if beating:
        writer.join()
        assert rep.live and rep.findings == [], rep.text()
        assert any("rank 1's heartbeat" in n and "6 s behind" in n for n in rep.notes), rep.notes
    else:
        assert rep.culprits("silent") == {1}, rep.text()
        assert "no heartbeat for 6 s" in rep.text(), rep.text()


def _long_timeline(tmp_path: Path, ops: int, every: int) -> str:
    """3 ranks of ``ops`` all-reduces, a step every ``every``; rank 1 calls a broadcast as
    op 5 and as op ``ops - 5``. Returns the last rank's timeline."""
    for r in range(3):
        _rank(tmp_path, r, {}, [100.0], 0.02)
        lines = []
        for k in range(ops):
            odd = r == 1 and k in (5, ops - 5)
            op = ["world", k, "broadcast" if odd else "all_reduce", 4, "float32", None,
                  1000.0 + k, 1000.5 + k, "done", "train.py:9"]  # fmt: skip
            lines.append({"k": "ops", "r": [op]})
            if k % every == every - 1:
                lines.append({"k": "step", "n": k // every, "t0": 1000.6 + k, "t1": 1000.7 + k})
        text = "".join(json.dumps(x) + "\n" for x in lines)
        (tmp_path / f"rank{r}.trace.jsonl").write_text(text)
    return text


def test_a_long_timeline_is_read_from_its_recent_history(tmp_path: Path) -> None:
    """The doctor reads the end of each rank's timeline (``history`` bytes): a mismatch and
    the step count there are found; one early in a long job is left, and the report says so.
    """
    ops, every = 2000, 50
    assert len(_long_timeline(tmp_path, ops, every)) > 200_000
    rep = doctor.examine(tmp_path, history=20_000)
    assert rep.steps == ops // every, rep.text()
    assert [f.text.split(" where")[0] for f in rep.findings if f.kind == "mismatch"] == [
        f"rank 1 called broadcast as #{ops - 5} (issued at train.py:9)"
    ], rep.text()
    assert "ranks 0, 1, 2: only the last 0.0190735 MiB read, older ops not checked" in rep.text()
    whole = doctor.examine(tmp_path, history=None)
    assert whole.culprits("mismatch") == {1} and len(whole.findings) == 2, whole.text()
    assert whole.notes == [], whole.text()


def test_ranks_that_agree_give_no_finding(tmp_path: Path) -> None:
    steps = [100.0 + 0.1 * k for k in range(25)]
    for r in range(3):
        _rank(tmp_path, r, {"SHARDLINE_SPIN_US": 50}, steps, 0.02 + 0.0005 * r)  # < 7 % apart
    rep = doctor.examine(tmp_path)
    assert rep.findings == [], rep.text()
    assert rep.text().endswith("no hang, no straggler, no mismatch; settings agree")


def test_a_folder_without_traces_and_a_corrupt_file_are_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a folder"):
        doctor.examine(tmp_path / "missing")
    with pytest.raises(InvalidArgumentError, match="holds no rank's trace"):
        doctor.examine(tmp_path)
    # A timeline line that is not the tracer's (not the last, which may be being written)
    (tmp_path / "rank0.trace.jsonl").write_text('{"k": "ops"}\n{"k": "step"}\n')
    with pytest.raises(InvalidArgumentError, match=r"rank0\.trace\.jsonl is not a shardline"):
        doctor.examine(tmp_path)


def test_an_op_timed_on_its_gpu_is_written_once_the_gpu_is_past_it(
    tracer: Tracer, tmp_path: Path
) -> None:
    tracer.device = device.DeviceTimes(clock=_Clock, kind=device.TORCH)
    RECORDER.device_sink = tracer.device.add
    record = RECORDER.start("world", 0, "all_reduce", 8, torch.float32, None)
    end = _Event(None)
    RECORDER.timed(record, type("Handle", (), {"timing": _timed("world", 5.0, end)}))
    RECORDER.finish(record)  # queued and returned on the host; the GPU is not there yet
    tracer.flush()
    assert not (tmp_path / "rank0.trace.jsonl").read_text()
    now = json.loads((tmp_path / "rank0.now.json").read_text())
    assert [o[flight.OP] for o in now["running"]] == ["all_reduce"]  # shown, ended on the host
    end.at = 5.02
    tracer.flush()
    (line,) = [json.loads(x) for x in (tmp_path / "rank0.trace.jsonl").read_text().splitlines()]
    (written,) = line["r"]
    assert written[folder.DEVICE_START :] == pytest.approx([1005.0, 1005.02])
    ops = folder.load(tmp_path)[0].ops
    assert folder.device_span(ops[0]) == pytest.approx((1005.0, 1005.02))
    # (in microseconds from the host's earliest time, here far from the stand-in GPU times:
    # float resolution of a fraction of a microsecond)
    gpu = [e for e in merge.chrome_trace(tmp_path)["traceEvents"] if e.get("cat") == "gpu"]
    assert [(e["tid"], e["name"], e["dur"]) for e in gpu] == [
        ("gpu comm world", "all_reduce #0", pytest.approx(20000.0, abs=1.0))
    ]


def test_the_straggler_check_reads_gpu_ops_at_their_device_times(tmp_path: Path) -> None:
    """On GPUs the host queues a collective long before it runs: the host times of every rank
    look alike, and only the device times show which rank's compute is slower."""
    steps = [100.0 + 0.1 * k for k in range(25)]
    for r in range(3):
        _rank(tmp_path, r, {}, steps, 0.02)  # the same host times on every rank
        gaps = 0.02 if r != 1 else 0.03  # rank 1 computes 10 ms longer per step on its GPU
        lines = []
        for line in (tmp_path / f"rank{r}.trace.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event["k"] == "op":
                t1 = event["r"][flight.END] + 0.001
                event["d"] = [t1 - 0.1 + gaps, t1 - 0.001]
            lines.append(json.dumps(event) + "\n")
        (tmp_path / f"rank{r}.trace.jsonl").write_text("".join(lines))
    rep = doctor.examine(tmp_path)
    assert rep.culprits("straggler") == {1}, rep.text()


def test_the_straggler_check_reads_only_the_steps_timed_on_the_gpu(tmp_path: Path) -> None:
    """With GPU times on one step in 3, an op of the other steps has host times only (when it
    was queued): the check reads the sampled steps alone. Here the host times name rank 0,
    the GPU times rank 1: rank 1 is the straggler."""
    steps = [100.0 + 0.1 * k for k in range(25)]
    for r in range(3):
        _rank(tmp_path, r, {}, steps, 0.03 if r == 0 else 0.02)  # host times: rank 0 slow
        gaps = 0.02 if r != 1 else 0.03  # rank 1 computes 10 ms longer per step on its GPU
        lines = []
        for line in (tmp_path / f"rank{r}.trace.jsonl").read_text().splitlines():
            event = json.loads(line)
            timed = event["r"][1] % 3 == 0 if event["k"] == "op" else event["n"] % 3 == 0
            if event["k"] == "op" and timed:
                t1 = event["r"][flight.END] + 0.001
                event["d"] = [t1 - 0.1 + gaps, t1 - 0.001]
            if event["k"] == "step":
                event["gpu"] = timed
            lines.append(json.dumps(event) + "\n")
        (tmp_path / f"rank{r}.trace.jsonl").write_text("".join(lines))
    rep = doctor.examine(tmp_path, steps=20)
    assert rep.culprits("straggler") == {1}, rep.text()
    assert "the last 8 steps timed on the GPU" in rep.text(), rep.text()


@pytest.mark.parametrize("every", [1, 3])
def test_gpu_times_are_taken_on_one_step_in_n(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    monkeypatch.setenv("SHARDLINE_TRACE_GPU", str(every))
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    t = Tracer()
    for gpu_ops in (False, True):
        t.start(tmp_path / str(gpu_ops), rank=0, world_size=1, backend="nccl", interval=60.0)
        t.device.timed_any = gpu_ops  # as once an NCCL op was taken to be timed
        sinks = []
        try:
            for _ in range(7):
                sinks.append(RECORDER.device_sink == t.device.add)  # for the step about to run
                p.grad = torch.ones(2)
                opt.step()
        finally:
            t.stop()
        want = [n % every == 0 for n in range(7)]
        assert sinks == want
        text = (tmp_path / str(gpu_ops) / "rank0.trace.jsonl").read_text()
        steps = [e for e in map(json.loads, text.splitlines()) if e["k"] == "step"]
        # Marked only in a job with GPU ops: a CPU job's straggler check reads every step.
        assert [e.get("gpu") for e in steps] == (want if gpu_ops else [None] * 7)


def test_gpu_times_are_taken_unless_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = Tracer()
    t.start(tmp_path / "on", rank=0, world_size=1, backend="nccl", interval=60.0)
    try:
        assert RECORDER.device_sink == t.device.add
    finally:
        t.stop()
    assert RECORDER.device_sink is None
    monkeypatch.setenv("SHARDLINE_TRACE_GPU", "0")
    t.start(tmp_path / "off", rank=0, world_size=1, backend="nccl", interval=60.0)
    try:
        assert RECORDER.device_sink is None and RECORDER.sink is not None
    finally:
        t.stop()


def test_gather_and_scatter_record_each_ranks_own_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rooted gather or scatter is recorded with the size every rank passes (its own part),
    not the root's whole buffer: the doctor compares the sizes across ranks, and named every
    correct gather and scatter a mismatch."""
    import threading

    from shardline.comm import ProcessGroup
    from tests._ranks import run_ranks

    rank_of: dict[int, int] = {}
    seen: list[tuple[int, str, int]] = []
    real = RECORDER.start

    def start(group: str, seq: int, op: str, numel: int, *rest: object) -> object:
        seen.append((rank_of[threading.get_ident()], op, numel))
        return real(group, seq, op, numel, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(RECORDER, "start", start)
    monkeypatch.setattr(RECORDER, "sink", [])  # listening, as under a tracer

    def body(g: ProcessGroup) -> None:
        rank_of[threading.get_ident()] = g.rank
        x = torch.full((4,), float(g.rank))
        g.gather(x, [torch.empty(4) for _ in range(3)] if g.rank == 1 else None, dst=1)
        g.scatter(x, torch.ones(12) if g.rank == 2 else None, src=2)

    run_ranks(3, body)
    rooted = sorted(s for s in seen if s[1] in ("gather", "scatter"))
    assert rooted == [(r, op, 4) for r in range(3) for op in ("gather", "scatter")], rooted


def test_a_settings_or_heartbeat_file_cut_short_is_read_as_missing(tmp_path: Path) -> None:
    """A crash can leave a rank's ``now.json`` or ``config.json`` empty or half written: the
    doctor and the merge still read the folder, and say which file they passed over (they
    refused the whole folder, or raised AttributeError on a JSON list)."""
    steps = [100.0 + 0.1 * k for k in range(8)]
    for r in range(3):
        _rank(tmp_path, r, {}, steps, 0.02)
    (tmp_path / "rank1.now.json").write_text('{"rank": 1, "ti')
    (tmp_path / "rank2.config.json").write_text("[]")
    rep = doctor.examine(tmp_path)
    assert rep.ranks == 3 and len(rep.notes) == 2, rep.text()
    assert "rank1.now.json (" in rep.text() and "rank2.config.json (a JSON list" in rep.text()
    assert rep.culprits("straggler") == set(), rep.text()
    names = {e["name"] for e in merge.chrome_trace(tmp_path)["traceEvents"] if e["ph"] == "X"}
    assert "all_reduce #0" in names


def test_a_job_killed_as_a_whole_still_says_where_each_rank_was(tmp_path: Path) -> None:
    """Killed together (a time limit, SIGKILL), every rank's process is gone: the hang is
    still named, with where the rank outside the collective was at its last heartbeat (it
    said only that the process was gone)."""
    import socket
    import subprocess

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid, host, beat = int(dead.stdout), socket.gethostname(), 1000.0
    waiting = ["world", 3, "all_reduce", 4, "float32", None, beat - 10, None, "running", "t.py:9"]
    for r, running, where in ((0, [waiting], "t.py:9"), (1, [], "hang.py:3")):
        (tmp_path / f"rank{r}.config.json").write_text(json.dumps(
            {"rank": r, "world_size": 2, "backend": "native", "settings": {}, "notes": {}}
        ))  # fmt: skip
        (tmp_path / f"rank{r}.now.json").write_text(json.dumps(
            {"rank": r, "pid": pid, "host": host, "time": beat, "interval": 1,
             "state": "running", "running": running,
             "threads": [{"name": "MainThread", "main": True, "where": where,
                          "function": "load_batch" if r else "step"}]}
        ))  # fmt: skip
        (tmp_path / f"rank{r}.trace.jsonl").write_text("")
    rep = doctor.examine(tmp_path, now=beat + 600)
    assert rep.culprits("hang") == {1}, rep.text()
    assert "at its last heartbeat it ran hang.py:3 (in load_batch)" in rep.text(), rep.text()


def test_trace_merge_into_a_missing_folder_is_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardline.cli import main

    _rank(tmp_path, 0, {}, [100.0, 100.1], 0.02)
    out = tmp_path / "no-such-folder" / "trace.json"
    assert main(["trace", "merge", str(tmp_path), "-o", str(out)]) == 2
    assert f"cannot write the trace: [Errno 2] No such file or directory: '{out}'" in (
        capsys.readouterr().err
    )


def test_the_doctor_command_reads_the_recent_history_and_all_of_it_with_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardline.cli import main

    _long_timeline(tmp_path, 2000, 50)
    monkeypatch.setattr(doctor, "HISTORY_BYTES", 20_000)
    assert main(["doctor", str(tmp_path)]) == 1
    recent = capsys.readouterr().out
    assert recent.count("- mismatch:") == 1 and "older ops not checked" in recent, recent
    assert main(["doctor", "--all", str(tmp_path)]) == 1
    everything = capsys.readouterr().out
    assert everything.count("- mismatch:") == 2 and "not checked" not in everything, everything


_TEXT = st.text(max_size=12)  # quotes, backslashes, control and non-ASCII characters too
_RECORD = st.tuples(
    _TEXT,  # group
    st.integers(0, 2**40),  # number
    _TEXT,  # op
    st.integers(0, 2**62),  # numel
    st.sampled_from([None, "float32", torch.float32, torch.bfloat16, torch.int64, torch.bool]),
    st.none() | st.integers(0, 1 << 20),  # peer
    st.floats(0, 2e9, allow_nan=False),  # start
    st.none() | st.floats(0, 2e9, allow_nan=False),  # end
    st.sampled_from(["running", "done", "PeerLostError"]),
    st.none() | _TEXT,  # where
)
_SPAN = st.none() | st.tuples(st.floats(-1e12, 1e12), st.floats(-1e12, 1e12))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_RECORD, _SPAN), max_size=8))
def test_the_native_line_of_ops_reads_back_as_json_dumps_line(ops: list[tuple]) -> None:
    """The tracer's native encoder writes what ``json.dumps`` writes, value for value."""
    records = [list(r) for r, _ in ops]
    spans = [s for _, s in ops]
    line = _native.trace_ops_line(records, spans, flight.dtype_names())
    want = {"k": "ops", "r": [flight.plain(r) + list(s or ())
                              for r, s in zip(records, spans, strict=True)]}  # fmt: skip
    assert line.endswith(b"}\n") and line.count(b"\n") == 1  # one line of the timeline
    assert json.loads(line) == json.loads(json.dumps(want))


def test_a_line_the_native_encoder_does_not_write_is_written_by_json(tmp_path: Path) -> None:
    """A value the native encoder refuses (a float that is not finite) takes ``json.dumps``,
    as the tracer wrote before."""
    record = ["world", 0, "all_reduce", 4, torch.float32, None, 1.0, float("inf"), "done", None]
    with pytest.raises(ValueError, match="not finite"):
        _native.trace_ops_line([record], [None], flight.dtype_names())
    line = recorder._ops_line([record], [None])
    assert line == (json.dumps({"k": "ops", "r": [flight.plain(record)]}) + "\n").encode()
