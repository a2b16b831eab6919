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
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from shardline.comm.rendezvous.env import attempt_store
from shardline.comm.rendezvous.store import linger_after_failure
from shardline.errors import InvalidArgumentError
from shardline.launch.agent import run_node
from shardline.launch.config import LaunchConfig, resolve_secret, worker_env
from shardline.launch.workers import Attempt, catch_stop_signals, say

__all__ = ["launch"]

# The deadline of the store's own client (the launcher only reads failure counters).
_STORE_TIMEOUT = timedelta(minutes=5)


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
        ``shardline.comm.rendezvous.store``.
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
