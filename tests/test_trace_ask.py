"""The doctor's request for GPU times on every step (``shardline.comm.trace.ask``).

A job traced on GPUs times one step in ``SHARDLINE_TRACE_GPU`` there; the doctor asks a live
one for every step of a window, and each rank's tracer answers at its next write. On CPU the
tracer is told that the job's ops run on a GPU (``device.timed_any``): which steps take GPU
times is decided the same way, and written on each step's line.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shardline.comm.flight import RECORDER
from shardline.comm.trace import ask, doctor
from shardline.comm.trace.recorder import Tracer


def _steps_marked(folder: Path) -> list[bool | None]:
    text = (folder / "rank0.trace.jsonl").read_text()
    return [e.get("gpu") for e in map(json.loads, text.splitlines()) if e["k"] == "step"]


def _beat(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "rank0.now.json").read_text()))


class _Job:
    """One traced rank whose optimizer steps run on the caller's thread (``step``)."""

    def __init__(self) -> None:
        self.p = torch.nn.Parameter(torch.zeros(2))
        self.opt = torch.optim.SGD([self.p], lr=0.1)
        self.taken: list[bool] = []  # whether each step took GPU times, as it began

    def step(self, tracer: Tracer) -> None:
        self.taken.append(RECORDER.device_sink == tracer.device.add)
        self.p.grad = torch.ones(2)
        self.opt.step()


def _gpu_job(folder: Path, interval: float) -> tuple[Tracer, _Job]:
    """A tracer started into ``folder`` as on a GPU job, and the job's steps."""
    t = Tracer()
    t.start(folder, rank=0, world_size=1, backend="nccl", interval=interval)
    t.device.timed_any = True  # as once an NCCL op was taken to be timed
    return t, _Job()


def test_a_rank_times_every_step_asked_for_from_its_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDLINE_TRACE_GPU", "16")
    t, job = _gpu_job(tmp_path, 60.0)
    try:
        for _ in range(3):
            job.step(t)
        rid = ask.ask(tmp_path, 4)
        t.flush()  # the tracer's write, while step 3 runs: steps 4 to 7 are asked for
        for _ in range(10):
            job.step(t)
        t.flush()  # the same request again: not answered twice
        for _ in range(7):
            job.step(t)
        t.flush()
        beat = _beat(tmp_path)
    finally:
        t.stop()
    want = [n % 16 == 0 or 4 <= n < 8 for n in range(20)]
    assert job.taken == want
    assert _steps_marked(tmp_path) == want
    assert beat["asked"] == {"id": rid, "from": 4, "until": 8}
    assert beat["steps_written"] == 20 and beat["gpu_every"] == 16


def test_a_request_older_than_the_rank_or_with_gpu_times_off_is_not_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for every in ("16", "0"):
        folder = tmp_path / every
        folder.mkdir()
        monkeypatch.setenv("SHARDLINE_TRACE_GPU", every)
        if every == "16":
            ask.ask(folder, 5)  # a doctor's request left from an earlier job
        t, job = _gpu_job(folder, 60.0)
        try:
            if every == "0":
                ask.ask(folder, 5)
            t.flush()
            for _ in range(8):
                job.step(t)
            t.flush()
            beat = _beat(folder)
        finally:
            t.stop()
        assert job.taken == [every == "16" and n == 0 for n in range(8)]
        assert "asked" not in beat


def test_the_doctor_asks_a_live_sampled_job_and_reads_the_steps_it_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDLINE_TRACE_GPU", "16")
    t, job = _gpu_job(tmp_path, 0.05)
    stop = threading.Event()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            while not stop.is_set():
                job.step(t)
                time.sleep(0.002)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while t._written < 20 and time.monotonic() < deadline:  # steps 0 and 16 timed
            time.sleep(0.02)
        assert t._written >= 20, "the job's steps were not written in 30 s"
        rep = doctor.diagnose(tmp_path, steps=10, wait=30)
        beat = _beat(tmp_path)
    finally:
        stop.set()
        thread.join(timeout=10)
        t.stop()
    assert not errors, errors
    assert rep.live and rep.running == [0]
    assert any(n.startswith("GPU times on every step of the last 10") for n in rep.notes), rep
    first, until = beat["asked"]["from"], beat["asked"]["until"]
    assert until - first == 10 and beat["steps_written"] > until
    marked = _steps_marked(tmp_path)
    assert all(marked[first:until]), marked[first:until]
    # Before the request: one step in 16 only.
    assert [n for n, m in enumerate(marked[:first]) if m] == list(range(0, first, 16))


def test_the_doctor_says_which_ranks_did_not_answer_in_time(tmp_path: Path) -> None:
    """Rank 1's heartbeat is fresh but it never answers (a step that takes minutes)."""
    now = time.time()
    for r in range(2):
        (tmp_path / f"rank{r}.config.json").write_text(json.dumps(
            {"rank": r, "world_size": 2, "backend": "nccl", "versions": {}, "settings": {},
             "notes": {}, "started": now - 60}
        ))  # fmt: skip
        steps = [{"k": "step", "n": n, "t0": now - 30 + n, "t1": now - 29.5 + n,
                  "gpu": n % 16 == 0} for n in range(20)]  # fmt: skip
        (tmp_path / f"rank{r}.trace.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
        (tmp_path / f"rank{r}.now.json").write_text(json.dumps(
            {"rank": r, "pid": os.getpid(), "host": "elsewhere", "time": now, "interval": 60,
             "state": "running", "running": [], "threads": [], "gpu_every": 16,
             "steps_written": 20}
        ))  # fmt: skip
    t0 = time.monotonic()
    rep = doctor.diagnose(tmp_path, steps=10, wait=0.5)
    assert 0.5 <= time.monotonic() - t0 < 10
    assert rep.live and rep.sampled and rep.running == [0, 1]
    assert any("ranks 0, 1 did not write 10 such steps within 0.5 s" in n for n in rep.notes), rep
    assert (tmp_path / ask.REQUEST).exists()
    # Not asked when told not to (``wait=0``), nor a job timed on every step.
    (tmp_path / ask.REQUEST).unlink()
    assert doctor.diagnose(tmp_path, steps=10, wait=0).notes == rep.notes[:-1]
    for r in range(2):
        path = tmp_path / f"rank{r}.trace.jsonl"
        path.write_text(path.read_text().replace('"gpu": false', '"gpu": true'))
    every = doctor.diagnose(tmp_path, steps=10, wait=30)
    assert every.live and not every.sampled and every.notes == rep.notes[:-1]
    assert not (tmp_path / ask.REQUEST).exists()


def test_a_folder_the_doctor_cannot_write_is_read_as_it_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = time.time()
    (tmp_path / "rank0.config.json").write_text(json.dumps({"rank": 0, "world_size": 1}))
    steps = [{"k": "step", "n": n, "t0": now - 9 + n / 4, "t1": now - 8.9 + n / 4,
              "gpu": n % 16 == 0} for n in range(20)]  # fmt: skip
    (tmp_path / "rank0.trace.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (tmp_path / "rank0.now.json").write_text(json.dumps(
        {"rank": 0, "pid": os.getpid(), "host": "elsewhere", "time": now, "interval": 60,
         "state": "running", "running": [], "threads": [], "gpu_every": 16}
    ))  # fmt: skip

    def refused(directory: Path, steps: int) -> str:
        raise PermissionError(13, "Permission denied", str(directory / ask.REQUEST))

    monkeypatch.setattr(ask, "ask", refused)
    t0 = time.monotonic()
    rep = doctor.diagnose(tmp_path, steps=10, wait=30)
    assert time.monotonic() - t0 < 10 and rep.live and rep.sampled
    assert any("could not ask the job" in n and "Permission denied" in n for n in rep.notes)
