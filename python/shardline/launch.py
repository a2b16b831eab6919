"""The launcher behind ``shardline run``: start a node's ranks, watch them, stop them together.

One launcher runs on each node. It starts ``--nproc-per-node`` Python processes with the
torchrun variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) that
``shardline.init()`` reads, so a script runs unchanged under ``shardline run``, ``torchrun``
and ``srun``. Every output line of a worker is printed with its rank in front. When one worker
fails, the launcher stops the others (SIGTERM to each worker's process group, SIGKILL after a
grace period), prints which rank failed and the end of its stderr, and restarts the group up
to ``max_restarts`` times. Ctrl-C or SIGTERM to the launcher stops every worker the same way.

[Note: no orphans] Each worker starts in a session of its own (``start_new_session=True``),
so its process group holds the worker and everything it spawns; the launcher signals whole
groups and waits until no live member is left. Only a process that leaves its group
(``setsid``, a double fork into a new session) escapes.

[Note: the launcher hosts the store] The node-0 launcher hosts the job's rendezvous store
(torch's ``TCPStore``) at ``MASTER_ADDR:MASTER_PORT`` for each attempt, and tells every
worker so as torchrun does, with ``TORCHELASTIC_USE_AGENT_STORE=True``: every rank, rank 0
included, then connects as a client. The store outlives every worker, so a rank that still
creates groups through it after rank 0 has finished keeps working. Each attempt gets a fresh
store, so no key of a failed attempt is read by the next.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import IO, Any, TextIO

from shardline import config as settings
from shardline.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_GRACE_PERIOD_S",
    "LaunchConfig",
    "free_port",
    "launch",
    "resolve_secret",
    "worker_env",
]

DEFAULT_GRACE_PERIOD_S = 5.0
"""Seconds between SIGTERM and SIGKILL when the launcher stops workers."""

_POLL_S = 0.05
_STDERR_TAIL_LINES = 30
_MAX_LINE_BYTES = 64 * 1024
_READER_JOIN_S = 5.0
_SETTLE_AFTER_KILL_S = 2.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The deadline of the store's own client: the launcher makes no store calls of its own.
_STORE_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class LaunchConfig:
    """What ``shardline run`` starts on this node; the flags of the command line.

    Attributes:
        target: Path of the script to run, or a module name when ``module`` is true.
        args: Arguments passed to the script unchanged.
        module: Run ``target`` as ``python -m target``.
        nproc_per_node: Workers on this node.
        nnodes: Nodes in the job (one launcher runs on each).
        node_rank: This node's index in ``[0, nnodes)``.
        master_addr: Host of node 0, where its launcher hosts the rendezvous store (and rank 0
            runs).
        master_port: Port of that store; ``None`` picks a free one (one node only).
        max_restarts: How many times a failed group is restarted before giving up.
        prefix_output: Put ``[rank<N>]: `` in front of every line a worker prints.
        grace_period: Seconds between SIGTERM and SIGKILL when stopping workers.

    Raises:
        InvalidArgumentError: A value is out of range, or several nodes lack a master port.
    """

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0
    prefix_output: bool = True
    grace_period: float = DEFAULT_GRACE_PERIOD_S

    def __post_init__(self) -> None:
        if not self.target:
            what = "module name" if self.module else "script path"
            raise InvalidArgumentError(f"no {what} given; usage: shardline run [flags] train.py")
        if self.nproc_per_node < 1:
            raise InvalidArgumentError(
                f"--nproc-per-node {self.nproc_per_node}: need at least 1 worker per node"
            )
        if self.nnodes < 1:
            raise InvalidArgumentError(f"--nnodes {self.nnodes}: need at least 1 node")
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidArgumentError(
                f"--node-rank {self.node_rank} is outside [0, --nnodes {self.nnodes}); "
                "number the nodes 0, 1, ..., nnodes - 1"
            )
        if self.max_restarts < 0:
            raise InvalidArgumentError(f"--max-restarts {self.max_restarts} must be 0 or more")
        if not self.grace_period >= 0:
            raise InvalidArgumentError(f"grace period {self.grace_period} s must be 0 or more")
        if not self.master_addr:
            raise InvalidArgumentError("--master-addr is empty; give rank 0's host")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise InvalidArgumentError(
                f"--master-port {self.master_port} is not a port in [1, 65535]"
            )
        if self.nnodes > 1 and self.master_port is None:
            raise InvalidArgumentError(
                f"--nnodes {self.nnodes} needs --master-port: every node must use the same "
                "port, so pick one that is free on the master node (node rank 0) and pass "
                "it to every launcher"
            )

    @property
    def world_size(self) -> int:
        """Ranks in the whole job: ``nnodes * nproc_per_node``."""
        return self.nnodes * self.nproc_per_node

    def rank_of(self, local_rank: int) -> int:
        """The global rank of this node's worker ``local_rank``."""
        return self.node_rank * self.nproc_per_node + local_rank

    def command(self) -> list[str]:
        """The command line of every worker: this Python running the script or module."""
        head = ["-m", self.target] if self.module else [self.target]
        return [sys.executable, *head, *self.args]


def free_port() -> int:
    """A TCP port that was free a moment ago, for ``MASTER_PORT`` on a single node."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def resolve_secret(config: LaunchConfig, env: Mapping[str, str]) -> str | None:
    """The ``SHARDLINE_SECRET`` every worker of the job gets.

    The caller's ``SHARDLINE_SECRET`` when set. Otherwise a single node gets a fresh random
    one (``secrets.token_hex(32)``), and several nodes fail, since their launchers cannot
    agree on a random value, unless ``SHARDLINE_INSECURE=1`` opts out (``None``: no secret).

    Args:
        config: The launch.
        env: The launcher's environment.

    Returns:
        The secret, or ``None`` for an insecure multi-node job.

    Raises:
        InvalidArgumentError: Several nodes, no ``SHARDLINE_SECRET`` and no opt-out.
    """
    given: str | None = settings.raw("SHARDLINE_SECRET", env)
    if given is not None:
        return given
    if config.nnodes == 1:
        return secrets.token_hex(32)
    if settings.get("SHARDLINE_INSECURE", env):
        return None
    raise InvalidArgumentError(
        f"--nnodes {config.nnodes} needs a secret shared by every node: run\n"
        "    export SHARDLINE_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')\n"
        "once, give the same value to the launcher on every node, and launch again "
        "(or export SHARDLINE_INSECURE=1 to accept unauthenticated connections)"
    )


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_env(
    config: LaunchConfig,
    *,
    local_rank: int,
    master_port: int,
    secret: str | None,
    restart_count: int = 0,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one worker: ``base`` plus the torchrun and shardline variables.

    Sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the
    node rank), ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, ``SHARDLINE_SECRET`` (unless ``secret`` is ``None``),
    ``SHARDLINE_RESTART_COUNT`` and ``TORCHELASTIC_RESTART_COUNT`` (the attempt number),
    ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_USE_AGENT_STORE=True`` (the node-0 launcher
    hosts the store at ``MASTER_ADDR:MASTER_PORT``: see [Note: the launcher hosts the store])
    and ``PYTHONUNBUFFERED=1`` (so lines reach the launcher as they are printed). Like
    torchrun, which sets ``OMP_NUM_THREADS`` when the user did not, it sets
    ``OMP_NUM_THREADS`` to ``max(1, cores // nproc_per_node)`` unless ``base`` has one, so
    the workers of a node do not each start a thread per core.

    Args:
        config: The launch.
        local_rank: The worker's rank on this node.
        master_port: Port of the rendezvous store (hosted by the node-0 launcher).
        secret: The job's secret (see ``resolve_secret``).
        restart_count: Which attempt this is (0 for the first).
        base: Variables to start from; ``os.environ`` by default.

    Returns:
        The complete environment for ``subprocess.Popen(env=...)``.
    """
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "RANK": str(config.rank_of(local_rank)),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(config.world_size),
            "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
            "GROUP_RANK": str(config.node_rank),
            "GROUP_WORLD_SIZE": str(config.nnodes),
            "ROLE_RANK": str(config.rank_of(local_rank)),
            "ROLE_WORLD_SIZE": str(config.world_size),
            "MASTER_ADDR": config.master_addr,
            "MASTER_PORT": str(master_port),
            "SHARDLINE_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if secret is not None:
        env["SHARDLINE_SECRET"] = secret
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(max(1, _cores() // config.nproc_per_node))
    return env


def launch(config: LaunchConfig, env: Mapping[str, str] | None = None) -> int:
    """Runs the job's workers on this node until they succeed or the launcher gives up.

    Starts ``config.nproc_per_node`` workers; when one fails, stops the rest, reports the
    failure on stderr and starts them all again (on a fresh master port when the port was
    picked automatically), at most ``config.max_restarts`` times. On node 0 the launcher
    hosts the job's rendezvous store, afresh for each attempt (see [Note: the launcher hosts
    the store]). SIGINT, SIGTERM or SIGHUP
    to the launcher stops every worker and ends the run without restarting; a second signal
    skips the grace period. Signals are only caught when called from the main thread.

    On several nodes restarts are best effort: each launcher restarts only its own workers,
    with no rendezvous between launchers. The other nodes' workers lose their peers, fail
    (``PeerLostError``) and are restarted by their own launchers on the same master port;
    a worker that makes no further collective call runs on until it ends by itself.

    Args:
        config: What to run.
        env: The environment the workers inherit; ``os.environ`` by default.

    Returns:
        0 when every worker exited 0; ``128 + signal`` (130 for Ctrl-C, 143 for SIGTERM)
        when the launcher was stopped; else the failed worker's exit code (1 for a signal).

    Raises:
        InvalidArgumentError: The job cannot start (no script, no secret for several nodes,
            the master port is taken on node 0).
    """
    base = dict(os.environ if env is None else env)
    if not config.module and not os.path.isfile(config.target):
        raise InvalidArgumentError(f"script {config.target!r} does not exist (or is no file)")
    secret = resolve_secret(config, base)
    if config.nnodes > 1 and config.master_addr in ("127.0.0.1", "localhost", "::1"):
        _say(
            f"warning: --nnodes {config.nnodes} with --master-addr {config.master_addr}: "
            "workers on other hosts cannot reach a loopback address"
        )
    attempts = config.max_restarts + 1
    with _catch_stop_signals() as stop:
        for attempt in range(attempts):
            failed = None
            if stop.signum is None:
                with _rendezvous_store(config) as port:
                    envs = [
                        worker_env(
                            config,
                            local_rank=lr,
                            master_port=port,
                            secret=secret,
                            restart_count=attempt,
                            base=base,
                        )
                        for lr in range(config.nproc_per_node)
                    ]
                    failed = _Attempt(config, envs, stop).run()
            if stop.signum is not None:
                name = signal.Signals(stop.signum).name
                _say(f"stopped by {name}; every worker of this node is stopped")
                return 128 + stop.signum
            if failed is None:
                return 0
            if attempt + 1 < attempts:
                _say(
                    f"restarting all {config.nproc_per_node} workers of this node "
                    f"(restart {attempt + 1} of {config.max_restarts})"
                )
            else:
                _say(
                    f"giving up after {attempts} attempt{'s' if attempts > 1 else ''} "
                    f"(--max-restarts {config.max_restarts}); exit code {failed.exit_code}"
                )
                return failed.exit_code
    raise AssertionError("unreachable: the last attempt returns")  # pragma: no cover


# --- the rendezvous store ------------------------------------------------------------------


@contextlib.contextmanager
def _rendezvous_store(config: LaunchConfig) -> Iterator[int]:
    """The port of the job's store for one attempt; on node 0, the store itself lives here.

    Node 0 hosts it on ``--master-port`` (a free port when none was given) until the attempt
    ends; the other nodes' workers connect to node 0's on ``--master-port``.

    Raises:
        InvalidArgumentError: node 0 cannot listen on ``--master-port``.
    """
    if config.node_rank != 0:
        assert config.master_port is not None  # LaunchConfig requires it on several nodes
        yield config.master_port
        return
    store = _host_store(config)
    try:
        yield int(store.port)
    finally:
        del store  # closes it: the next attempt starts on a fresh store


def _host_store(config: LaunchConfig) -> Any:
    """A TCPStore served by this process on ``config.master_port`` (0: a free port)."""
    import torch.distributed as dist  # noqa: PLC0415  # only node 0's launcher needs torch

    port = config.master_port if config.master_port is not None else 0
    try:
        return dist.TCPStore(  # type: ignore[attr-defined]
            config.master_addr, port, None, True, _STORE_TIMEOUT, wait_for_workers=False
        )
    except (RuntimeError, OSError) as exc:
        raise InvalidArgumentError(
            f"--master-port {port}: the launcher cannot host the rendezvous store there "
            f"({exc}); pick a free port on this node, or stop the process holding it"
        ) from exc


# --- one attempt ---------------------------------------------------------------------------


@dataclass
class _Worker:
    rank: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    readers: list[threading.Thread] = field(default_factory=list)
    stderr_tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=_STDERR_TAIL_LINES))
    # Set once the launcher signalled this worker's group while the worker was still running.
    stopped_by_launcher: bool = False

    @property
    def exit_code(self) -> int:
        """The launcher's exit code when it gives up on this worker: its own, 1 for a signal."""
        rc = self.proc.returncode
        return rc if rc is not None and rc > 0 else 1


class _Attempt:
    """Starts one group of workers and watches it until success, a failure or a stop signal."""

    def __init__(
        self,
        config: LaunchConfig,
        envs: list[dict[str, str]],
        stop: _StopSignals,
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
                _say(
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

    def _start(self, local_rank: int, env: dict[str, str]) -> _Worker:
        proc = subprocess.Popen(
            self.config.command(),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: grandchildren are stopped too
        )
        worker = _Worker(self.config.rank_of(local_rank), local_rank, proc)
        prefix = f"[rank{worker.rank}]: ".encode() if self.config.prefix_output else b""
        assert proc.stdout is not None and proc.stderr is not None
        for pipe, name, tail in (
            (proc.stdout, "stdout", None),
            (proc.stderr, "stderr", worker.stderr_tail),
        ):
            thread = threading.Thread(
                target=_OUTPUT.pump,
                args=(pipe, name, prefix, tail),
                name=f"shardline-run-rank{worker.rank}-{name}",
                daemon=True,  # a pipe held by an escaped grandchild must not block exit
            )
            thread.start()
            worker.readers.append(thread)
        return worker

    def _watch(self) -> _Worker | None:
        while self.stop.signum is None:
            codes = [w.proc.poll() for w in self.workers]
            for w, rc in zip(self.workers, codes, strict=True):
                if rc is not None and rc != 0:
                    return w  # the first in rank order, if several failed since the last poll
            if all(rc == 0 for rc in codes):
                return None
            time.sleep(_POLL_S)
        return None

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

    def pump(self, pipe: IO[bytes], name: str, prefix: bytes, tail: deque[bytes] | None) -> None:
        """Reads ``pipe`` to its end, printing each line (or partial last line) with ``prefix``."""
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
            self._write(sys.stdout if name == "stdout" else sys.stderr, prefix + chunk)

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


def _say(message: str) -> None:
    _OUTPUT.write_err(f"shardline run: {message}\n")


# --- signals and process groups ------------------------------------------------------------


class _StopSignals:
    """The stop signals the launcher received: the first one's number, and how many."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0

    def handle(self, signum: int, frame: FrameType | None) -> None:
        # [Note: no locks in handlers] Only plain assignments: the handler runs in the main
        # thread between bytecodes, possibly while that thread holds any lock.
        if self.signum is None:
            self.signum = signum
        self.count += 1


@contextlib.contextmanager
def _catch_stop_signals() -> Iterator[_StopSignals]:
    stop = _StopSignals()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.signal(s, stop.handle) for s in _STOP_SIGNALS}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


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
