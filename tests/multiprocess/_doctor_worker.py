"""One rank of the doctor's fault-injection tests: ``python _doctor_worker.py SCENARIO``.

Every rank traces into ``SHARDLINE_TRACE``. The parent test drives the trials through files
in ``DOCTOR_DIR``: a rank waits for ``go<t>`` before trial ``t`` and rank 0 writes
``ready<t>`` when the trial's fault is in place; the culprit of each trial is the ``t``-th
entry of ``DOCTOR_CULPRITS``.

- ``hang``: per trial, the culprit stays out of an all-reduce (sleeping in ``hold``, or
  stopped by ``SIGSTOP`` when ``DOCTOR_STOP`` is set; the parent continues it) while the
  others wait in it, until the parent writes ``release<t>``.
- ``wrong_op``: per trial, on a fresh group, the culprit calls a broadcast where the others
  call an all-reduce (the engine raises a mismatch on every rank).
- ``slow``: per trial, ``DOCTOR_STEPS`` optimizer steps in which the culprit computes 15 %
  longer (or, with ``DOCTOR_THROTTLE``, runs a thread that keeps its interpreter busy); each
  rank also notes ``trial<t>.lr``, which differs on the trial's second culprit
  (``DOCTOR_ODD``).
- ``torch``: a few steps of plain ``torch.distributed`` on shardline's backend, each with
  the healthy ranks' compute of ``slow`` (with none, a step is about 1 ms outside
  communication, and 4 ranks on 2 cores put one of them 0.6 ms behind in every step: a
  straggler by the doctor's rule, and not a healthy job).
- ``kill``: a few steps, then the culprit kills itself (``SIGKILL``) before an all-reduce;
  the survivors get ``PeerLostError`` and exit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import shardline as sl

DIR = Path(os.environ.get("DOCTOR_DIR", "."))
CULPRITS = [int(c) for c in os.environ.get("DOCTOR_CULPRITS", "").split(",") if c]
STEP_S = 0.02  # a step's compute (a sleep: steady on a loaded machine)


def wait_for(name: str, timeout: float = 120.0) -> None:
    """Polls for the parent's file ``name`` (no collective meanwhile)."""
    deadline = time.monotonic() + timeout
    while not (DIR / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never wrote {name}")
        time.sleep(0.01)


def hold(trial: int) -> None:
    """The culprit's fault: busy outside shardline until the parent releases it."""
    while not (DIR / f"release{trial}").exists():
        time.sleep(0.01)


def step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    compute: float,
    reduce: Callable[[torch.Tensor], object] = sl.all_reduce,
) -> None:
    """One training step: ``compute`` seconds of work, then each gradient all-reduced."""
    time.sleep(compute)
    opt.zero_grad()
    model(torch.ones(1, 4)).sum().backward()
    for p in model.parameters():
        assert p.grad is not None
        reduce(p.grad)
    opt.step()


def hang() -> None:
    sl.init()
    r = sl.get_rank()
    t = torch.ones(8)
    for trial, culprit in enumerate(CULPRITS):
        wait_for(f"go{trial}")
        sl.all_reduce(t)  # every rank at the same place
        if r == culprit:
            if r == 0:
                (DIR / f"ready{trial}").touch()
            if os.environ.get("DOCTOR_STOP"):
                os.kill(os.getpid(), signal.SIGSTOP)
                wait_for(f"release{trial}")
            else:
                hold(trial)
        elif r == (1 if culprit == 0 else 0):
            (DIR / f"ready{trial}").touch()
        sl.all_reduce(t)
    print("OK", flush=True)
    sl.shutdown()


def wrong_op() -> None:
    sl.init()
    r = sl.get_rank()
    for trial, culprit in enumerate(CULPRITS):
        g = sl.new_group(list(range(sl.get_world_size())))
        t = torch.ones(8)
        try:
            if r == culprit:
                g.broadcast(t, src=0)
            else:
                g.all_reduce(t)
        except sl.CollectiveMismatchError:
            pass
        else:
            raise AssertionError(f"trial {trial}: the mismatch was not detected")
        sl.barrier()
    sl.trace.flush()
    print("OK", flush=True)
    sl.shutdown()


class Hog:
    """A thread of the program that keeps the interpreter busy: the rank's own work then
    waits for the GIL each time it takes it back (a throttled rank).

    Each such wait lasts up to the interpreter's switch interval, here 1 ms instead of 5: the
    rank then spends 43-48 % longer per step outside communication (with 5 ms, its steps took
    about 100 ms against the others' 22), far past the doctor's 10 %, and the test's 480 steps
    take 18 s instead of 48.
    """

    def __init__(self) -> None:
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(0.001)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while not self._done.is_set():
            sum(range(1000))

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        sys.setswitchinterval(self._interval)


def slow() -> None:
    sl.init()
    r = sl.get_rank()
    steps = int(os.environ.get("DOCTOR_STEPS", "24"))
    odd = [int(c) for c in os.environ["DOCTOR_ODD"].split(",")]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    throttle = bool(os.environ.get("DOCTOR_THROTTLE"))
    for trial, culprit in enumerate(CULPRITS):
        wait_for(f"go{trial}")
        sl.trace.note(f"trial{trial}.lr", 0.2 if r == odd[trial] else 0.1)
        hog = Hog() if throttle and r == culprit else None
        for _ in range(steps):
            slower = r == culprit and not throttle
            step(model, opt, STEP_S * (1.15 if slower else 1.0))
        if hog is not None:
            hog.stop()
        sl.trace.flush()
        sl.barrier()
        if r == 0:
            (DIR / f"ready{trial}").touch()
    print("OK", flush=True)
    sl.shutdown()


def kill() -> None:
    sl.init()
    r = sl.get_rank()
    (culprit,) = CULPRITS
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        step(model, opt, 0.0)
    sl.trace.flush()
    sl.barrier()
    if r == culprit:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        sl.all_reduce(torch.ones(8))
    except sl.PeerLostError:
        print("OK lost", flush=True)
        return
    raise AssertionError("the all-reduce with a dead rank returned")


def torch_backend() -> None:
    """Plain ``torch.distributed`` on shardline's backend, traced all the same."""
    dist.init_process_group("shardline")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(6):
        step(model, opt, STEP_S, dist.all_reduce)
    dist.barrier()
    dist.destroy_process_group()
    print("OK", flush=True)


if __name__ == "__main__":
    scenarios = {"hang": hang, "wrong_op": wrong_op, "slow": slow, "kill": kill,
                 "torch": torch_backend}  # fmt: skip
    scenarios[sys.argv[1]]()
