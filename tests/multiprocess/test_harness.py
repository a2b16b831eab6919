"""The multiprocess harness itself, on gloo: runs, reports, and kills hung ranks."""

from __future__ import annotations

import time

import pytest

from tests.multiprocess._launch import finish, run, start

pytestmark = pytest.mark.multiprocess


def test_gloo_all_reduce_between_three_processes() -> None:
    ranks = run(3, "allreduce", env={"WORKER_BACKEND": "gloo"})
    assert all("OK" in r.out for r in ranks)


def test_hung_job_is_killed_and_every_rank_reported() -> None:
    # Rank 1 dies at once, so rank 0 waits for it in rendezvous until the harness kills it.
    ranks = start(2, "allreduce", env={"WORKER_BACKEND": "gloo", "SHARDLINE_TIMEOUT": "60"})
    ranks[1].proc.kill()
    begin = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[0\] still running(.|\n)*--- rank 1"):
        finish(ranks, timeout=3)
    assert time.monotonic() - begin < 10
    assert all(r.proc.poll() is not None for r in ranks)
