"""One rank of a multiprocess test: ``python _worker.py SCENARIO``, configured by env vars.

Prints ``OK ...`` lines the parent checks, or ``ERROR <Class> <elapsed> <message>`` when the
scenario expects a failure. Exit status 0 means the rank behaved as the scenario requires.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import shardline as sl

BACKEND = os.environ.get("WORKER_BACKEND") or None  # the harness's own test uses gloo


def allreduce() -> None:
    sl.init(backend=BACKEND)
    r, w = sl.get_rank(), sl.get_world_size()
    for n in (0, 1, 1000, (1 << 20) + 7):
        t = torch.full((n,), float(r + 1))
        sl.all_reduce(t)
        assert torch.equal(t, torch.full((n,), float(w * (w + 1) // 2))), (n, t[:4])
    out = torch.empty(3 * w, dtype=torch.int64)
    sl.all_gather(out, torch.arange(3) + 10 * r)
    assert out.tolist() == [k + 10 * q for q in range(w) for k in range(3)]
    sl.barrier()
    print("OK", flush=True)
    sl.shutdown()


def kill_loop() -> None:
    sl.init(backend=BACKEND)
    t = torch.ones(4 << 20)  # 16 MiB
    last = time.monotonic()
    print("LOOPING", flush=True)
    try:
        while True:
            sl.all_reduce(t, op="max")
            last = time.monotonic()
    except sl.PeerLostError as exc:
        print(f"ERROR PeerLostError {time.monotonic() - last:.3f} {exc}", flush=True)
    sl.shutdown()


def mismatch() -> None:
    sl.init(backend=BACKEND)
    start = time.monotonic()
    try:
        if sl.get_rank() == 0:
            sl.all_reduce(torch.ones(1024))
        else:
            sl.all_gather(torch.empty(1024 * sl.get_world_size()), torch.ones(1024))
    except sl.CollectiveMismatchError as exc:
        print(f"ERROR CollectiveMismatchError {time.monotonic() - start:.3f} {exc}", flush=True)
    sl.shutdown()


def expect_failure() -> None:
    """Any ShardlineError at init or in the first op is fine; hanging is not."""
    start = time.monotonic()
    try:
        sl.init(backend=BACKEND)
        sl.all_reduce(torch.ones(16))
        print("OK no error", flush=True)
    except sl.ShardlineError as exc:
        print(f"ERROR {type(exc).__name__} {time.monotonic() - start:.3f} {exc}", flush=True)
    finally:
        sl.shutdown()


def slow_start() -> None:
    """Ranks other than 0 start late, leaving rank 0's listener open to a garbage writer."""
    if os.environ["RANK"] != "0":
        time.sleep(float(os.environ.get("WORKER_DELAY", "2")))
    allreduce()


SCENARIOS = {
    "allreduce": allreduce,
    "kill_loop": kill_loop,
    "mismatch": mismatch,
    "expect_failure": expect_failure,
    "slow_start": slow_start,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
