"""Parent side of multiprocess tests: start ranks, enforce a deadline, report every rank."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import shardline
from tests.multiprocess._forkserver import FRESH_INTERPRETERS, ForkedProcess

WORKER = Path(__file__).with_name("_worker.py")
# The directory holding the imported shardline (with its built engine) and the repo root.
PYTHONPATH = os.pathsep.join(
    [str(Path(shardline.__file__).resolve().parent.parent), str(Path(__file__).parents[2])]
)


@dataclass
class Rank:
    """One child process and, once finished, its exit status and output."""

    rank: int
    proc: ForkedProcess | subprocess.Popen[str]
    rc: int | None = None
    out: str = ""
    err: str = ""


def free_port() -> int:
    """A port that was free a moment ago (for MASTER_PORT; rank 0 binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    n: int,
    scenario: str,
    *,
    env: dict[str, str] | None = None,
    per_rank: dict[int, dict[str, str]] | None = None,
    port: int | None = None,
    worker: Path = WORKER,
) -> list[Rank]:
    """Starts ``n`` ranks of ``worker scenario`` (``_worker.py`` by default) with
    torchrun-style variables, forked from the test fork server (``_forkserver.py``), or as
    fresh interpreters under ``TEST_FRESH_RANKS=1``."""
    port = port or free_port()
    ranks = []
    for r in range(n):
        child_env = {
            **os.environ,
            "PYTHONPATH": PYTHONPATH,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": str(n),
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(n),
            "SHARDLINE_TIMEOUT": "30",
            **(env or {}),
            **((per_rank or {}).get(r, {})),
        }
        proc: ForkedProcess | subprocess.Popen[str]
        if FRESH_INTERPRETERS:
            proc = subprocess.Popen(
                [sys.executable, str(worker), scenario],
                env=child_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        else:
            proc = ForkedProcess(worker, [scenario], child_env)
        ranks.append(Rank(r, proc))
    return ranks


def finish(ranks: list[Rank], timeout: float) -> list[Rank]:
    """Waits for every rank; past ``timeout`` kills them all and fails with every stderr."""
    deadline = time.monotonic() + timeout
    hung = []
    for r in ranks:
        try:
            _collect(r, timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(r.rank)
            kill_all(ranks)
    if hung:
        raise AssertionError(f"ranks {hung} still running after {timeout} s\n{report(ranks)}")
    return ranks


def kill_all(ranks: list[Rank]) -> None:
    """SIGKILLs every rank still running, then reaps every rank and keeps its output (so no
    process or pipe outlives the test, and ``report`` has what each rank printed)."""
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGKILL)
    for r in ranks:
        _collect(r)


def _collect(r: Rank, timeout: float | None = None) -> None:
    # communicate() may be called again after it timed out; once it returned, rc is set.
    if r.rc is None:
        r.out, r.err = r.proc.communicate(timeout=timeout)
        r.rc = r.proc.returncode


def report(ranks: list[Rank]) -> str:
    """Every rank's exit status, stdout and stderr."""
    return "\n".join(
        f"--- rank {r.rank} (rc={r.rc}) ---\nstdout:\n{r.out}\nstderr:\n{r.err}" for r in ranks
    )


def run(n: int, scenario: str, timeout: float = 90, **kwargs: object) -> list[Rank]:
    """``start`` then ``finish``; asserts every rank exited 0."""
    ranks = finish(start(n, scenario, **kwargs), timeout)  # type: ignore[arg-type]
    assert all(r.rc == 0 for r in ranks), report(ranks)
    return ranks
