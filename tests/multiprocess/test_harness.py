"""The multiprocess harness itself, on gloo: runs, reports, and kills hung ranks, and ranks
die with their fork server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multiprocess._launch import PYTHONPATH, finish, run, start

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


def test_a_rank_dies_with_its_fork_server() -> None:
    # A parent forks a child that asks to die with it and then would sleep a minute; the
    # parent exits at once. Without the request the child outlives it (an orphaned rank).
    parent = subprocess.run(
        [sys.executable, "-c", _ORPHAN], check=False, capture_output=True, text=True, timeout=30,
        cwd=Path(__file__).parents[2], env={**os.environ, "PYTHONPATH": PYTHONPATH},
    )  # fmt: skip
    assert parent.returncode == 0, parent.stderr
    child = int(parent.stdout.split()[0])
    try:
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), f"the child {child} outlived its parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


_ORPHAN = """
import os, sys, time
from tests.multiprocess._forkserver import die_with_parent
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # the test reads the parent's output to its end
    os.dup2(null, 2)
    die_with_parent()
    os.write(w, b"x")
    time.sleep(60)
    os._exit(0)
os.read(r, 1)  # the child has asked
print(pid, flush=True)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for its new parent to reap does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status
