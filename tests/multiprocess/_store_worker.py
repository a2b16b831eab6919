"""One rank of the store-lifetime tests: ``python _store_worker.py SCENARIO``.

Runs under ``tests/multiprocess/_launch.py`` (plain env://, rank 0 hosts the store) or under
``shardline run`` (the launcher hosts it). Prints ``OK rank <r> shutdown <seconds>`` when the
rank did all it had to, with how long its ``shutdown()`` took.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch

import shardline as sl

LAG_S = float(os.environ.get("WORKER_LAG", "3"))


def _shutdown_timed(rank: int) -> None:
    start = time.monotonic()
    sl.shutdown()
    print(f"OK rank {rank} shutdown {time.monotonic() - start:.3f}", flush=True)


def early_exit() -> None:
    """Rank 0 shuts down at once; the others lag, then build sub-groups among themselves.

    The sub-groups exchange keys through the store, so they need it after rank 0 is done.
    """
    sl.init()
    r, w = sl.get_rank(), sl.get_world_size()
    others = list(range(1, w))
    if r != 0:
        time.sleep(LAG_S)
    sub = sl.new_group(others)  # every rank calls it; rank 0 gets None and touches nothing
    if sub is not None:
        t = torch.full((4,), float(r))
        sub.all_reduce(t)
        assert t.tolist() == [float(sum(others))] * 4, t
        mesh = sl.DeviceMesh({"a": len(others)}, group=sub)  # sub-groups of the sub-group
        one = torch.ones(2)
        mesh.group("a").all_reduce(one)
        assert one.tolist() == [float(len(others))] * 2, one
        for rr in range(sub.world_size):  # each rank alone: still a round through the store
            solo = sub.new_group([rr])
            assert (solo is not None) == (rr == sub.rank)
    _shutdown_timed(r)


def dead_rank() -> None:
    """The last rank dies after init without checking out; rank 0 must still leave."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
    sl.init()
    r, w = sl.get_rank(), sl.get_world_size()
    if r == w - 1:
        print(f"DYING rank {r}", flush=True)
        os._exit(0)  # no shutdown(), no atexit: like a SIGKILL
    _shutdown_timed(r)


def skip_shutdown() -> None:
    """The last rank returns without shutdown(): it checks out at exit, so rank 0 need not wait."""
    sl.init()
    r, w = sl.get_rank(), sl.get_world_size()
    if r == w - 1:
        time.sleep(LAG_S)  # rank 0 is waiting in shutdown() by now
        print(f"LEAVING rank {r}", flush=True)
        return
    _shutdown_timed(r)


def restart_on_one_port() -> None:
    """Under ``shardline run --max-restarts 1``: attempt 0 fails after init, attempt 1 runs."""
    sl.init()
    t = torch.ones(2)
    sl.all_reduce(t)
    if os.environ["SHARDLINE_RESTART_COUNT"] == "0":
        if sl.get_rank() == 1:
            sys.exit(3)
        time.sleep(60)  # the launcher stops this rank
    assert t.tolist() == [float(sl.get_world_size())] * 2
    _shutdown_timed(sl.get_rank())


SCENARIOS = {
    "early_exit": early_exit,
    "dead_rank": dead_rank,
    "skip_shutdown": skip_shutdown,
    "restart_on_one_port": restart_on_one_port,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
