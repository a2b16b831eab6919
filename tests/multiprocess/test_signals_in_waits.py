"""A rank that waits in a collective for a late peer runs its signal handlers meanwhile.

The wait runs on the rank's own thread with the GIL released, and the engine runs the
program's handlers from it every 0.1 s, on shared memory (one host) and over TCP (ranks given
other host ids). Rank 1 is 4 s late for two all-reduces: rank 0's
flight recorder must write its dump on ``SIGUSR1`` within a second, while the first all-reduce
still waits, and Ctrl-C (``SIGINT``) must end the second wait with ``KeyboardInterrupt`` at
once, the group aborted so that rank 1 raises instead of waiting for it (over TCP rank 1 may
instead complete the all-reduce, whose part from rank 0 was sent before the interrupt).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.multiprocess._launch import finish, report, start

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("native")]

WORKER = Path(__file__).with_name("_liveness_worker.py")
LATE_S = 4.0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_signals_are_handled_while_a_rank_waits_for_a_late_peer(
    tmp_path: Path, transport: str
) -> None:
    env = {
        "SHARDLINE_FLIGHT_DIR": str(tmp_path),
        "WORKER_LATE_S": str(LATE_S),
        "SHARDLINE_SECRET": "s",
    }
    # Over TCP: the ranks say they are on two hosts.
    hosts = {r: {"SHARDLINE_HOST_ID": f"host-{r}"} for r in range(2)} if transport == "tcp" else {}
    ranks = finish(start(2, "signals_in_waits", worker=WORKER, env=env, per_rank=hosts), timeout=60)
    first, second = ranks
    dumped = re.search(r"DUMPED ([\d.]+) RETURNED ([\d.]+)", first.out)
    assert dumped, report(ranks)
    # Asked for at 0.5 s; the all-reduce returned only once rank 1 came, at about 4 s.
    dump_s, returned_s = float(dumped.group(1)), float(dumped.group(2))
    assert dump_s < 1.5 and returned_s > LATE_S - 1, report(ranks)
    interrupted = re.search(r"INTERRUPTED ([\d.]+)", first.out)
    assert interrupted and float(interrupted.group(1)) < 1.5, report(ranks)
    assert first.rc == 0, report(ranks)
    if transport == "tcp" and second.rc == 0:
        # Rank 0 had sent its part before it was interrupted: rank 1's sum is whole.
        assert second.out.count("PEER_STEP_DONE") == 2, report(ranks)
        return
    assert second.rc == 1, report(ranks)
    assert second.out.count("PEER_STEP_DONE") == 1 and "interrupted" in second.out, report(ranks)
