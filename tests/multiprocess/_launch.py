"""Ranks as processes, for the tests and the benches: start them, enforce a deadline, report.

``start`` runs ``n`` ranks of one Python command line (``_worker.py <scenario>`` by default)
with torchrun's variables, forked from the test fork server (``_forkserver.py``) or, with
``fresh`` (``TEST_FRESH_RANKS=1``, the benches), as fresh interpreters; in a network namespace
each with ``netns`` (``_netns.Hosts``). ``finish`` waits for them within a deadline (and, with
``grace``, stops the others soon after one failed), ``report`` shows what each rank said.
The benches reach this module through ``benches/_harness.py``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import shardline
from shardline.launch import free_port
from tests.multiprocess._forkserver import (
    FRESH_INTERPRETERS,
    ExecProcess,
    ForkedProcess,
    RankProcess,
)

__all__ = [
    "PYTHONPATH",
    "Rank",
    "RanksFailed",
    "finish",
    "free_port",
    "kill_all",
    "orphaned_shm",
    "report",
    "run",
    "spawn",
    "start",
]

WORKER = Path(__file__).with_name("_worker.py")
# The directory holding the imported shardline (with its built engine) and the repo root.
PYTHONPATH = os.pathsep.join(
    [str(Path(shardline.__file__).resolve().parent.parent), str(Path(__file__).parents[2])]
)


class RanksFailed(AssertionError):
    """Ranks were still running at the deadline (killed since); the message reports them all."""

    def __init__(self, message: str, hung: list[int]) -> None:
        super().__init__(message)
        self.hung = hung


@dataclass
class Rank:
    """One process started here (a rank of a job, or a named process of ``_netns.Hosts``)."""

    rank: int
    proc: RankProcess
    name: str = ""
    host: str | None = None
    killed: bool = False  # by ``kill_all``

    def __post_init__(self) -> None:
        self.name = self.name or f"rank {self.rank}"

    @property
    def rc(self) -> int | None:
        """The exit status, or ``None`` while it runs."""
        return self.proc.poll()

    @property
    def out(self) -> str:
        """What it wrote to stdout so far (all of it once finished)."""
        return self.proc.read()[0]

    @property
    def err(self) -> str:
        """What it wrote to stderr so far (all of it once finished)."""
        return self.proc.read()[1]


def spawn(
    args: Sequence[str],
    env: Mapping[str, str],
    *,
    fresh: bool = FRESH_INTERPRETERS,
    output: tuple[Path | None, Path | None] | None = None,
    new_session: bool = False,
    netns: str | None = None,
    stdin: bool = False,
) -> RankProcess:
    """Starts ``python *args`` with environment ``env``: forked from the test fork server when
    ``args`` is ``[-u] script.py ...`` (and not ``fresh``, no ``stdin``, both outputs files),
    else a fresh interpreter. ``output``: stdout and stderr files (``None`` for one: this
    process's own stream; by default files of its own); ``new_session``: it leads a session
    (killed as one); ``netns``: it runs in that network namespace."""
    script = list(args[1:] if args and args[0] == "-u" else args)
    forkable = bool(script) and script[0].endswith(".py") and not stdin
    if forkable and not fresh and (output is None or None not in output):
        files = None if output is None else (Path(str(output[0])), Path(str(output[1])))
        return ForkedProcess(
            script[0], script[1:], dict(env), output=files, new_session=new_session, netns=netns
        )
    return ExecProcess(
        [sys.executable, *args],
        dict(env),
        output=output,
        new_session=new_session,
        netns=netns,
        stdin=stdin,
    )


def start(
    n: int,
    scenario: str = "",
    *,
    args: Sequence[str] | None = None,
    worker: Path = WORKER,
    env: Mapping[str, str] | None = None,
    per_rank: Mapping[int, Mapping[str, str]] | None = None,
    port: int | None = None,
    base: Mapping[str, str] | None = None,
    fresh: bool = FRESH_INTERPRETERS,
    output: Callable[[int], tuple[Path | None, Path | None]] | None = None,
    new_session: bool = False,
    netns: Callable[[int], str | None] | None = None,
) -> list[Rank]:
    """Starts ``n`` ranks of ``python worker scenario`` (or ``python *args``).

    Each rank's environment is ``base`` (by default this process's, with ``PYTHONPATH`` and
    ``SHARDLINE_TIMEOUT=30``), then torchrun's variables (``MASTER_ADDR`` 127.0.0.1, a free
    ``MASTER_PORT`` unless ``port``), then ``env``, then its own ``per_rank`` entries. The
    remaining options are ``spawn``'s, per rank: ``output(rank)``, ``netns(rank)``.
    """
    port = port or free_port()
    if base is None:
        base = {**os.environ, "PYTHONPATH": PYTHONPATH, "SHARDLINE_TIMEOUT": "30"}
    argv = list(args) if args is not None else [str(worker), scenario]
    ranks = []
    for r in range(n):
        child_env = {
            **base,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": str(n),
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(n),
            **(env or {}),
            **((per_rank or {}).get(r, {})),
        }
        proc = spawn(
            argv,
            child_env,
            fresh=fresh,
            output=output(r) if output is not None else None,
            new_session=new_session,
            netns=netns(r) if netns is not None else None,
        )
        ranks.append(Rank(r, proc))
    return ranks


def finish(ranks: list[Rank], timeout: float, *, grace: float | None = None) -> list[Rank]:
    """Waits for every rank and collects its output.

    Past ``timeout`` it kills them all and raises ``RanksFailed`` naming those still running,
    with every rank's output. With ``grace``, once a rank failed the others get ``grace``
    seconds to end, then are killed (``Rank.killed``).
    """
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        pending = [r for r in ranks if r.rc is None]
        if not pending:
            break
        now = time.monotonic()
        if grace is not None and failed_at is None and any(r.rc not in (None, 0) for r in ranks):
            failed_at = now
        if failed_at is not None and now - failed_at > (grace or 0.0):
            kill_all(ranks)
            break
        if now > deadline:
            kill_all(ranks)
            hung = [r.rank for r in pending]
            message = f"ranks {hung} still running after {timeout} s\n{report(ranks)}"
            raise RanksFailed(message, hung)
        with contextlib.suppress(subprocess.TimeoutExpired):  # still running: poll all again
            pending[0].proc.wait(timeout=min(0.05, max(0.0, deadline - now)))
    for r in ranks:
        r.proc.communicate()
    return ranks


def kill_all(ranks: list[Rank]) -> None:
    """SIGKILLs every rank still running (its session, when it leads one), then reaps every
    rank and keeps its output (so no process or pipe outlives the test, and ``report`` has
    what each rank printed)."""
    for r in ranks:
        if r.rc is None:
            r.killed = True
            r.proc.kill()
    for r in ranks:
        r.proc.communicate()


def report(ranks: list[Rank], err_limit: int | None = None) -> str:
    """Every rank's exit status, stdout and stderr (its last ``err_limit`` characters)."""
    return "\n".join(
        f"--- {r.name} (rc={r.rc}) ---\nstdout:\n{r.out}\n"
        f"stderr:\n{r.err if err_limit is None else r.err[-err_limit:]}"
        for r in ranks
    )


def run(n: int, scenario: str, timeout: float = 90, **kwargs: object) -> list[Rank]:
    """``start`` then ``finish``; asserts every rank exited 0."""
    ranks = finish(start(n, scenario, **kwargs), timeout)  # type: ignore[arg-type]
    assert all(r.rc == 0 for r in ranks), report(ranks)
    return ranks


def orphaned_shm() -> set[str]:
    """Our ``/dev/shm`` entries whose creator (``shardline-<pid>-...``) is gone: what a test
    may have left behind (a live creator, another test's or another job's beside it, still
    owns its entry)."""
    left = set()
    for path in Path("/dev/shm").glob("shardline-*"):
        pid = path.name.split("-")[1]
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
            left.add(path.name)
    return left
