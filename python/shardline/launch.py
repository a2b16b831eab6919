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
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from shardline import config as settings
from shardline._workers import Attempt, catch_stop_signals, say
from shardline.comm.backends._store import linger_after_failure
from shardline.comm.rendezvous import attempt_store
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

# The deadline of the store's own client (the launcher only reads failure counters).
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
        max_restarts: How many times a failed group is restarted before giving up; in an
            elastic job, how many workers this node replaces.
        min_nodes: ``--nnodes MIN:MAX``'s MIN (``nnodes`` is then MAX): the job is elastic
            (``shardline.elastic.agent``); ``None`` for a fixed size.
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
    min_nodes: int | None = None
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
        if self.min_nodes is not None:
            if not 1 <= self.min_nodes <= self.nnodes:
                raise InvalidArgumentError(
                    f"--nnodes {self.min_nodes}:{self.nnodes}: need 1 <= MIN <= MAX"
                )
            if self.master_port is None:
                raise InvalidArgumentError(
                    f"--nnodes {self.min_nodes}:{self.nnodes} (elastic) needs --master-port: "
                    "every node's launcher meets the others at --master-addr:--master-port"
                )
        elif self.nnodes > 1 and self.master_port is None:
            raise InvalidArgumentError(
                f"--nnodes {self.nnodes} needs --master-port: every node must use the same "
                "port, so pick one that is free on the master node (node rank 0) and pass "
                "it to every launcher"
            )

    @property
    def elastic(self) -> bool:
        """Whether the job is elastic (``--nnodes MIN:MAX``)."""
        return self.min_nodes is not None

    @property
    def nnodes_flag(self) -> str:
        """``--nnodes`` as given: ``"MIN:MAX"`` for an elastic job, else ``"N"``."""
        return f"{self.min_nodes}:{self.nnodes}" if self.elastic else str(self.nnodes)

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
    if config.nnodes == 1 and not config.elastic:
        return secrets.token_hex(32)
    if settings.get("SHARDLINE_INSECURE", env):
        return None
    raise InvalidArgumentError(
        f"--nnodes {config.nnodes_flag} needs a secret shared by every node: run\n"
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
        say(
            f"warning: --nnodes {config.nnodes_flag} with --master-addr {config.master_addr}: "
            "workers on other hosts cannot reach a loopback address"
        )
    if config.elastic:
        from shardline.elastic.agent import run_node  # noqa: PLC0415

        with catch_stop_signals() as stop:
            return run_node(config, base, secret, stop)
    attempts = config.max_restarts + 1
    with catch_stop_signals() as stop:
        for attempt in range(attempts):
            failed = None
            if stop.signum is None:
                with _rendezvous_store(config) as hosted:
                    envs = [
                        worker_env(
                            config,
                            local_rank=lr,
                            master_port=hosted.port,
                            secret=secret,
                            restart_count=attempt,
                            base=base,
                        )
                        for lr in range(config.nproc_per_node)
                    ]
                    failed = Attempt(config, envs, stop).run()
                    if failed is not None:
                        hosted.linger_after_failure(config, envs[0])
            if stop.signum is not None:
                name = signal.Signals(stop.signum).name
                say(f"stopped by {name}; every worker of this node is stopped")
                return 128 + stop.signum
            if failed is None:
                return 0
            if attempt + 1 < attempts:
                say(
                    f"restarting all {config.nproc_per_node} workers of this node "
                    f"(restart {attempt + 1} of {config.max_restarts})"
                )
            else:
                say(
                    f"giving up after {attempts} attempt{'s' if attempts > 1 else ''} "
                    f"(--max-restarts {config.max_restarts}); exit code {failed.exit_code}"
                )
                return failed.exit_code
    raise AssertionError("unreachable: the last attempt returns")  # pragma: no cover


# --- the rendezvous store ------------------------------------------------------------------


@dataclass
class _AttemptStore:
    """The job's store for one attempt: its port, and the store itself on node 0."""

    port: int
    store: Any = None

    def linger_after_failure(self, config: LaunchConfig, env: Mapping[str, str]) -> None:
        """On node 0 of several, keeps the store up until the others read why a rank failed.

        5 s at most; see [Note: a rank that fails while joining] in
        ``shardline.comm.backends._store``.
        """
        if self.store is not None and config.nnodes > 1:
            linger_after_failure(attempt_store(self.store, env), config.world_size)


@contextlib.contextmanager
def _rendezvous_store(config: LaunchConfig) -> Iterator[_AttemptStore]:
    """The job's store for one attempt; on node 0, the store itself lives here.

    Node 0 hosts it on ``--master-port`` (a free port when none was given) until the attempt
    ends; the other nodes' workers connect to node 0's on ``--master-port``.

    Raises:
        InvalidArgumentError: node 0 cannot listen on ``--master-port``.
    """
    if config.node_rank != 0:
        assert config.master_port is not None  # LaunchConfig requires it on several nodes
        yield _AttemptStore(config.master_port)
        return
    store = _host_store(config)
    hosted = _AttemptStore(int(store.port), store)
    try:
        yield hosted
    finally:
        hosted.store = None
        del store  # closes it (no reference is left): the next attempt starts on a fresh one


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
