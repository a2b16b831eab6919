"""One rank of the fail-fast and two-host tests: ``python _liveness_worker.py SCENARIO``.

Started with torchrun-style variables (by ``tests/multiprocess/_launch.py``, inside a network
namespace for the two-host tests, or by ``shardline run``). A rank that raises prints
``FAILED <unix time> <error class>: <message>`` and exits 1, so the test can tell when and
why each rank stopped; one that finishes prints ``OK``.
"""

from __future__ import annotations

import copy
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

import shardline as sl


def _reporting(body: Callable[[], None]) -> None:
    try:
        body()
    except sl.ShardlineError as exc:
        print(f"FAILED {time.time():.3f} {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)


def join() -> None:
    """Joins the job, checks one all-reduce, leaves."""
    sl.init()
    r, w = sl.get_rank(), sl.get_world_size()
    t = torch.full((5,), float(r + 1))
    sl.all_reduce(t)
    assert torch.equal(t, torch.full((5,), float(w * (w + 1) // 2))), t
    sl.shutdown()
    print("OK", flush=True)


def slow_peer() -> None:
    """The last rank computes for WORKER_SLOW_S seconds before each of two all-reduces: the
    others wait for it in the collective, longer than the keep-alive bound, and must not lose
    it (it is slow, not gone)."""
    sl.init()
    r, w = sl.get_rank(), sl.get_world_size()
    for step in range(2):
        if r == w - 1:
            time.sleep(float(os.environ["WORKER_SLOW_S"]))
        t = torch.full((1 << 16,), float(r + step))
        sl.all_reduce(t)
        want = float(sum(q + step for q in range(w)))
        assert torch.equal(t, torch.full_like(t, want)), (step, t[:3])
    sl.shutdown()
    print("OK", flush=True)


def all_reduce_loop() -> None:
    """All-reduces until told to stop (``WORKER_STEPS`` steps, else for ever), printing
    ``STEP i`` every 10 steps, with a check of every result, and a new group every
    ``WORKER_NEW_GROUP_EVERY`` steps if set. A rank given
    ``WORKER_JOIN_DELAY`` seconds joins that much later (the others wait in rendezvous); one
    given ``WORKER_SIGSTOP_AT`` stops itself (SIGSTOP) before that step's all-reduce."""
    time.sleep(float(os.environ.get("WORKER_JOIN_DELAY", "0")))
    sl.init()
    r, w = sl.get_rank(), sl.get_world_size()
    steps = int(os.environ.get("WORKER_STEPS", "0")) or None
    every = int(os.environ.get("WORKER_NEW_GROUP_EVERY", "0"))
    stop_at = int(os.environ.get("WORKER_SIGSTOP_AT", "-1"))
    i = 0
    while steps is None or i < steps:
        if i == stop_at:
            print(f"STOPPING {i}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        t = torch.full((4096,), float(r + i))
        sl.all_reduce(t)
        assert torch.equal(t, torch.full_like(t, float(sum(q + i for q in range(w))))), i
        if i % 10 == 0:
            print(f"STEP {i}", flush=True)
        if every and i % every == every - 1:  # a new group links afresh: listeners open
            sub = sl.new_group(list(range(w)))
            assert sub is not None
            sl.all_reduce(torch.ones(2), group=sub)
            sub.shutdown()
        time.sleep(0.02)
        i += 1
    sl.shutdown()
    print("OK", flush=True)


def strategies_vs_single() -> None:
    """DDP and ZeRO-3 across the job equal one process on the concatenated global batch."""
    sl.init()
    r, w = sl.get_rank(), sl.get_world_size()
    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(), torch.nn.Linear(32, 5)
    )

    def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(100 * step + rank)
        return torch.randn(8, 12, generator=gen), torch.randn(8, 5, generator=gen)

    single = copy.deepcopy(base)
    single_opt = torch.optim.AdamW(single.parameters(), lr=1e-2)
    for step in range(6):
        xs, ys = zip(*(batch(step, q) for q in range(w)), strict=True)
        single_opt.zero_grad()
        torch.nn.functional.mse_loss(single(torch.cat(xs)), torch.cat(ys)).backward()
        single_opt.step()
    want = single.state_dict()

    for strategy, extra in (("ddp", {}), ("zero3", {"unit_mb": 0.001})):
        plain = copy.deepcopy(base)
        model, opt = sl.distribute(
            plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), strategy=strategy, **extra
        )
        assert opt is not None
        for step in range(6):
            x, y = batch(step, r)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        got = model.state_dict()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
        print(f"MATCH {strategy}", flush=True)
    sl.shutdown()
    print("OK", flush=True)


def pipeline_kill() -> None:
    """A 2-stage 1F1B pipeline; the last rank kills itself (SIGKILL) in step 5."""
    sl.init()
    r, w = sl.get_rank(), sl.get_world_size()
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(4)]
    model = sl.pipeline(
        torch.nn.Sequential(*layers),
        microbatches=4,
        loss_fn=torch.nn.functional.mse_loss,
    )
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    for step in range(1000):
        if r == w - 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        model.step(x, target=y)
        print(f"STEP {step}", flush=True)


def signals_in_waits() -> None:
    """Rank 1 is ``WORKER_LATE_S`` late for two blocking all-reduces; rank 0, waiting in them,
    gets signals meanwhile and must handle them then, not when the wait ends: ``SIGUSR1``
    (the flight recorder's dump, while the job goes on), then ``SIGINT``, whose
    ``KeyboardInterrupt`` ends the wait and aborts the group for rank 1."""
    sl.init()
    late = float(os.environ["WORKER_LATE_S"])
    t = torch.ones(1024)
    if sl.get_rank() == 1:
        for _ in range(2):
            time.sleep(late)
            sl.all_reduce(t)
            print("PEER_STEP_DONE", flush=True)
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dump = Path(os.environ["SHARDLINE_FLIGHT_DIR"]) / "rank0.json"
    written: list[float] = []

    def ask_for_a_dump() -> None:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 2 * late
        while not dump.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        written.append(time.monotonic())

    asker = threading.Thread(target=ask_for_a_dump)
    asker.start()
    t0 = time.monotonic()
    sl.all_reduce(t)
    returned = time.monotonic()
    asker.join()
    print(f"DUMPED {written[0] - t0:.2f} RETURNED {returned - t0:.2f}", flush=True)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        sl.all_reduce(t)
    except KeyboardInterrupt:
        print(f"INTERRUPTED {time.monotonic() - t0:.2f}", flush=True)
        os._exit(0)  # the group is aborted; nothing to shut down
    print("NOT_INTERRUPTED", flush=True)


SCENARIOS = {
    "join": join,
    "slow_peer": slow_peer,
    "all_reduce_loop": all_reduce_loop,
    "strategies_vs_single": strategies_vs_single,
    "pipeline_kill": pipeline_kill,
    "signals_in_waits": signals_in_waits,
}

if __name__ == "__main__":
    _reporting(SCENARIOS[sys.argv[1]])
