"""What a launch is: ``LaunchConfig``, the job's secret and each worker's environment.

The launcher (``launcher``), the node agent of elastic jobs (``agent``) and the worker
processes (``workers``) all start from these; none of them imports another for it.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from shardline import config as settings
from shardline.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_GRACE_PERIOD_S",
    "LaunchConfig",
    "free_port",
    "resolve_secret",
    "worker_env",
]

DEFAULT_GRACE_PERIOD_S = 5.0
"""Seconds between SIGTERM and SIGKILL when the launcher stops workers."""


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
            (``shardline.launch.agent``); ``None`` for a fixed size.
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
