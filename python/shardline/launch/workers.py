"""One attempt of ``shardline run`` on one node: start, watch and stop the node's workers.

Every output line of a worker is printed with its rank in front; the attempt lasts until one
worker fails or a stop signal comes, and then stops them all.

See ``shardline.launch`` for the launcher around it, and its [Note: no orphans] for how whole
process groups are signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from shardline.launch.config import LaunchConfig

__all__ = ["Attempt", "StopSignals", "catch_stop_signals", "say"]

_POLL_S = 0.05
_STDERR_TAIL_LINES = 30
_MAX_LINE_BYTES = 64 * 1024
_READER_JOIN_S = 5.0
_SETTLE_AFTER_KILL_S = 2.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class _Worker:
    rank: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    readers: list[threading.Thread] = field(default_factory=list)
    stderr_tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=_STDERR_TAIL_LINES))
    # Set once the launcher signalled this worker's group while the worker was still running.
    stopped_by_launcher: bool = False
    # What goes in front of each line it prints: "[rank<N>]: ", or b"" with --no-prefix. An
    # elastic standby changes it when it takes a slot (read per line by the output threads).
    prefix: bytes = b""

    def relabel(self, label: str, *, prefixed: bool = True) -> None:
        """Prints this worker's next lines as ``[label]: ``."""
        self.prefix = f"[{label}]: ".encode() if prefixed else b""

    @property
    def exit_code(self) -> int:
        """The launcher's exit code when it gives up on this worker: its own, 1 for a signal."""
        rc = self.proc.returncode
        return rc if rc is not None and rc > 0 else 1


class Attempt:
    """Starts one group of workers and watches it until success, a failure or a stop signal."""

    def __init__(
        self,
        config: LaunchConfig,
        envs: list[dict[str, str]],
        stop: StopSignals,
    ) -> None:
        self.config, self.envs, self.stop = config, envs, stop
        self.attempt = int(envs[0]["SHARDLINE_RESTART_COUNT"])
        self.workers: list[_Worker] = []

    def run(self) -> _Worker | None:
        """The first worker that failed, or ``None`` when all exited 0 or a signal came."""
        try:
            for local_rank, env in enumerate(self.envs):
                self.workers.append(self._start(local_rank, env))
            failed = self._watch()
            if self.stop.signum is not None:
                say(
                    f"received {signal.Signals(self.stop.signum).name}: stopping the workers "
                    f"(SIGKILL in {self.config.grace_period:g} s; signal again to kill now)"
                )
            self._stop_all()
            self._join_readers()
            if failed is not None:
                self._report(failed)
            return failed
        finally:
            # Reached with live workers only when something above raised.
            self._stop_all()
            self._join_readers()

    def _start(
        self, local_rank: int, env: dict[str, str], rank: int | None = None,
        label: str | None = None,
    ) -> _Worker:  # fmt: skip
        """Starts one worker, printing its lines as ``[label]: `` (``rank<rank>`` by default).

        ``rank`` defaults to ``config.rank_of(local_rank)``.
        """
        proc = subprocess.Popen(
            self.config.command(),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: grandchildren are stopped too
        )
        worker = _Worker(self.config.rank_of(local_rank) if rank is None else rank,
                         local_rank, proc)  # fmt: skip
        worker.relabel(label or f"rank{worker.rank}", prefixed=self.config.prefix_output)
        assert proc.stdout is not None and proc.stderr is not None
        for pipe, name, tail in (
            (proc.stdout, "stdout", None),
            (proc.stderr, "stderr", worker.stderr_tail),
        ):
            thread = threading.Thread(
                target=_OUTPUT.pump,
                args=(pipe, name, worker, tail),
                name=f"shardline-run-rank{worker.rank}-{name}",
                daemon=True,  # a pipe held by an escaped grandchild must not block exit
            )
            thread.start()
            worker.readers.append(thread)
        return worker

    def _watch(self) -> _Worker | None:
        forwarded = self.stop.dumps
        while self.stop.signum is None:
            if self.stop.dumps != forwarded:
                forwarded = self.stop.dumps
                self._forward_dump()
            codes = [w.proc.poll() for w in self.workers]
            for w, rc in zip(self.workers, codes, strict=True):
                if rc is not None and rc != 0:
                    return w  # the first in rank order, if several failed since the last poll
            if all(rc == 0 for rc in codes):
                return None
            time.sleep(_POLL_S)
        return None

    def _forward_dump(self) -> None:
        """Sends SIGUSR1 to every worker that handles it.

        A worker still starting up (before ``shardline.init``) would be killed by it, so it
        is skipped and named.
        """
        ready: list[_Worker] = []
        skipped: list[_Worker] = []
        for w in self.workers:
            if w.proc.poll() is None:
                (ready if _catches(w.proc.pid, signal.SIGUSR1) else skipped).append(w)
        for w in ready:
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(signal.SIGUSR1)
        note = f"; ranks {[w.rank for w in skipped]} do not handle it yet" if skipped else ""
        say(
            f"SIGUSR1 forwarded to rank(s) {[w.rank for w in ready]}: each writes its flight "
            f"record; `shardline why <dir>` reads them{note}"
        )

    def _stop_all(self) -> None:
        """SIGTERM to every worker's group, SIGKILL to what is left after the grace period."""
        live = [w for w in self.workers if _group_alive(w.proc.pid, w.proc)]
        if not live:
            return
        for w in live:
            if w.proc.poll() is None:
                w.stopped_by_launcher = True
            _signal_group(w.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_period
        signals_before = self.stop.count
        while live and time.monotonic() < deadline and self.stop.count <= max(1, signals_before):
            time.sleep(_POLL_S)
            live = [w for w in live if _group_alive(w.proc.pid, w.proc)]
        for w in live:
            _signal_group(w.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + _SETTLE_AFTER_KILL_S
        while live and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            live = [w for w in live if _group_alive(w.proc.pid, w.proc)]
        for w in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=_SETTLE_AFTER_KILL_S)

    def _join_readers(self) -> None:
        deadline = time.monotonic() + _READER_JOIN_S
        for w in self.workers:
            for thread in w.readers:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if not any(t.is_alive() for t in w.readers):
                _close_quietly([w.proc.stdout, w.proc.stderr])

    def _report(self, failed: _Worker) -> None:
        """Prints the failure summary: who failed, how, what the others did, its stderr."""
        returncode = failed.proc.returncode
        assert returncode is not None
        tail = b"".join(failed.stderr_tail).decode("utf-8", "replace").rstrip("\n")
        bar = "=" * 78
        lines = [
            bar,
            f"shardline run: rank {failed.rank} failed (attempt {self.attempt + 1} of "
            f"{self.config.max_restarts + 1}, node {self.config.node_rank})",
            f"  rank {failed.rank} (local rank {failed.local_rank}, pid {failed.proc.pid}) "
            f"{_describe_returncode(returncode)}",
        ]
        for w in self.workers:
            rc = w.proc.returncode
            if w is failed:
                continue
            if w.stopped_by_launcher:
                lines.append(f"  rank {w.rank} stopped by the launcher")
            elif rc is None:
                lines.append(f"  rank {w.rank} could not be stopped (pid {w.proc.pid})")
            elif rc == 0:
                lines.append(f"  rank {w.rank} had finished (exit code 0)")
            else:
                lines.append(f"  rank {w.rank} also failed: {_describe_returncode(rc)}")
        if tail:
            shown = tail.splitlines()
            lines.append(f"  last {len(shown)} lines of rank {failed.rank}'s stderr:")
            lines += [f"    {line}" for line in shown]
        else:
            lines.append(f"  rank {failed.rank} wrote nothing to stderr")
        lines.append(bar)
        _OUTPUT.write_err("\n".join(lines) + "\n")


# --- output --------------------------------------------------------------------------------


class _Output:
    """Copies worker pipes to the launcher's stdout and stderr, one whole line at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def pump(self, pipe: IO[bytes], name: str, worker: _Worker, tail: deque[bytes] | None) -> None:
        """Reads ``pipe`` to its end, printing each line (or partial last line) with a prefix.

        The worker's prefix as it is when the line comes: an elastic standby's changes.
        """
        while True:
            try:
                chunk = pipe.readline(_MAX_LINE_BYTES)
            except (OSError, ValueError):
                return  # closed under us; the worker is gone
            if not chunk:
                return
            if not chunk.endswith(b"\n"):
                chunk += b"\n"  # a partial last line, or one longer than _MAX_LINE_BYTES
            if tail is not None:
                tail.append(chunk)
            self._write(sys.stdout if name == "stdout" else sys.stderr, worker.prefix + chunk)

    def write_err(self, text: str) -> None:
        """Prints the launcher's own message on stderr, between worker lines."""
        self._write(sys.stderr, text.encode("utf-8", "replace"))

    def _write(self, stream: TextIO | None, data: bytes) -> None:
        # [Note: keep draining] A write error (a closed pipe after `| head`) must not stop the
        # reader, or the worker would block on a full pipe; the line is dropped instead.
        if stream is None:  # the launcher runs without stdout or stderr
            return
        with self._lock, contextlib.suppress(OSError, ValueError):
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                stream.flush()
                buffer.write(data)
                buffer.flush()
            else:
                stream.write(data.decode("utf-8", "replace"))
                stream.flush()


_OUTPUT = _Output()  # one lock for every line the launcher prints


def say(message: str) -> None:
    """Prints one line of the launcher's own on stderr, after ``shardline run: ``."""
    _OUTPUT.write_err(f"shardline run: {message}\n")


# --- signals and process groups ------------------------------------------------------------


class StopSignals:
    """The stop signals the launcher received: the first one's number, and how many.

    Also counts ``SIGUSR1``s, which the launcher forwards to its workers (each writes its
    flight record: ``shardline.comm.flight``).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self.dumps = 0

    def handle_dump(self, signum: int, frame: FrameType | None) -> None:
        """Counts a request to dump every worker's flight record (``SIGUSR1``)."""
        self.dumps += 1  # see [Note: no locks in handlers]

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """Remembers the first stop signal; the launcher's loop stops the workers."""
        # [Note: no locks in handlers] Only plain assignments: the handler runs in the main
        # thread between bytecodes, possibly while that thread holds any lock.
        if self.signum is None:
            self.signum = signum
        self.count += 1


@contextlib.contextmanager
def catch_stop_signals() -> Iterator[StopSignals]:
    """While inside, SIGINT/SIGTERM/SIGHUP are recorded (not raised) for the launcher's loop."""
    stop = StopSignals()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.signal(s, stop.handle) for s in _STOP_SIGNALS}
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, stop.handle_dump)
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: /proc; else False)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _group_alive(pgid: int, leader: subprocess.Popen[bytes]) -> bool:
    """Whether the process group ``pgid`` still has a member that is not a zombie."""
    leader.poll()  # reap the worker itself, so it does not count as a member
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Orphaned grandchildren may linger as zombies under an init that does not reap them.
    return next(_live_members(pgid), None) is not None if os.path.isdir("/proc") else True


def _live_members(pgid: int) -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            yield int(entry.name)


def _describe_returncode(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "an unknown signal"
    return f"was killed by signal {name} ({-returncode})"


def _close_quietly(pipes: Sequence[IO[bytes] | None]) -> None:
    for pipe in pipes:
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
