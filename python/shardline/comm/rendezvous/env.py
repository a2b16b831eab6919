"""Rendezvous: who am I, who is the master, and how ranks find each other.

Reads torchrun's env:// variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) or SLURM's (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID``), opens torch's ``TCPStore``, and resolves the job's host identity, shared
secret and timeout.

[Note: who hosts the store] The store must outlive every rank that still uses it (sub-groups
exchange keys through it long after ``init``). A launcher that hosts it for its workers says
so as torchrun does, with ``TORCHELASTIC_USE_AGENT_STORE=True`` next to the ``MASTER_ADDR``
and ``MASTER_PORT`` of its store: ``shardline run``'s node-0 launcher and torchrun's agent do.
Then every rank, rank 0 included, connects as a client. Without such a launcher (plain env://,
srun) rank 0 hosts the store, and ``shardline.shutdown()`` is collective so that rank 0 leaves
last (see ``shardline.comm.world``).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import re
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from shardline import config
from shardline.comm.rendezvous.store import StoreClient, store_errors
from shardline.errors import ShardlineError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

_log = logging.getLogger("shardline")

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RendezvousInfo",
    "attempt_store",
    "create_store",
    "first_slurm_host",
    "host_identity",
    "job_secret",
    "launcher_hosts_store",
    "machine_identity",
    "read_env",
    "timeout_seconds",
]

DEFAULT_TIMEOUT_S: float = config.setting("SHARDLINE_TIMEOUT").parsed_default
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class RendezvousInfo:
    """Where this process sits in the job, as the launcher described it.

    Attributes:
        master_addr: Host of the rendezvous store (rank 0's, or its launcher's).
        master_port: Port of the rendezvous store.
        rank: Global rank.
        world_size: Number of ranks in the job.
        local_rank: Rank among the processes of this host.
        local_world_size: Number of processes on this host.
        source: ``"env"`` (torchrun, ``shardline run``) or ``"slurm"``.
    """

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str


def _int_var(env: Mapping[str, str] | None, name: str) -> int | None:
    raw = config.env_var(name, env)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ShardlineError(
            f"{name}={raw!r} is not an integer; set it to a whole number"
        ) from None


def first_slurm_host(nodelist: str) -> str:
    """Returns the first host of a SLURM node list.

    Args:
        nodelist: ``SLURM_JOB_NODELIST``, e.g. ``"gpu[007-010,012],cpu01"``.

    Returns:
        The first host name, e.g. ``"gpu007"``.
    """
    nodelist = nodelist.strip()
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist)
    if not match or not (match.group(1) or match.group(2)):
        raise ShardlineError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def read_env(env: Mapping[str, str] | None = None) -> RendezvousInfo:
    """Reads the rendezvous variables of torchrun or SLURM, checking they agree.

    torchrun-style variables win over SLURM's. With none of them set (``python train.py``)
    the process is the whole job: rank 0 of 1. Missing or inconsistent values fail fast.

    Args:
        env: Variables to read; ``os.environ`` by default.

    Returns:
        This process's place in the job.

    Raises:
        ShardlineError: a variable is missing, malformed or contradicts another.
    """
    rank, world = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
    local_rank, local_world = _int_var(env, "LOCAL_RANK"), _int_var(env, "LOCAL_WORLD_SIZE")
    source = "env"
    if rank is None and world is None and config.env_var("SLURM_PROCID", env) is not None:
        source = "slurm"
        rank, world = _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_NTASKS")
        if local_rank is None:
            local_rank = _int_var(env, "SLURM_LOCALID")
        if local_world is None:
            local_world = _slurm_tasks_on_this_node(env)
    given = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": local_rank,
             "LOCAL_WORLD_SIZE": local_world}  # fmt: skip
    if all(v is None for v in given.values()):
        # No launcher at all (`python train.py`): one process, as torch and Accelerate users
        # expect when they debug a script.
        _log.info("no RANK or WORLD_SIZE set (no launcher): running as one process")
        rank, world = 0, 1
    if rank is None or world is None:
        have = ", ".join(n for n, v in given.items() if v is not None)
        raise ShardlineError(
            f"cannot find this process's rank: {have} set, but not both RANK and WORLD_SIZE; "
            "set RANK and WORLD_SIZE (and MASTER_ADDR, MASTER_PORT), or launch with "
            "`shardline run`, torchrun or srun (with none of them set, a script runs as one "
            "process)"
        )
    if world < 1:
        raise ShardlineError(f"WORLD_SIZE={world} must be at least 1")
    if not 0 <= rank < world:
        raise ShardlineError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    if local_rank is None:
        local_rank = rank if local_world is None else rank % local_world
    if local_world is None:
        local_world = world
    if not 1 <= local_world <= world:
        raise ShardlineError(f"LOCAL_WORLD_SIZE={local_world} must be in [1, WORLD_SIZE={world}]")
    if not 0 <= local_rank < local_world:
        raise ShardlineError(
            f"LOCAL_RANK={local_rank} is outside [0, LOCAL_WORLD_SIZE={local_world}) on rank {rank}"
        )

    addr = config.env_var("MASTER_ADDR", env) or ""
    if not addr and source == "slurm":
        addr = config.env_var("SLURM_LAUNCH_NODE_IPADDR", env) or ""
        nodelist = config.env_var("SLURM_JOB_NODELIST", env)
        if not addr and nodelist:
            addr = first_slurm_host(nodelist)
    if not addr:
        if world == 1:
            addr = "127.0.0.1"
        else:
            raise ShardlineError(
                f"MASTER_ADDR is not set on rank {rank}; set it to rank 0's host "
                "(torchrun and `shardline run` do this)"
            )
    port = _int_var(env, "MASTER_PORT")
    if port is None:
        if world == 1:
            port = 0
        else:
            raise ShardlineError(f"MASTER_PORT is not set on rank {rank}; set it to a free port")
    if not 0 <= port <= 65535 or (port == 0 and world > 1):
        raise ShardlineError(f"MASTER_PORT={port} must be a port in [1, 65535]")
    return RendezvousInfo(addr, port, rank, world, local_rank, local_world, source)


def _slurm_tasks_on_this_node(env: Mapping[str, str] | None) -> int | None:
    # SLURM_TASKS_PER_NODE looks like "4(x2),3"; SLURM_NODEID picks the entry.
    spec = config.env_var("SLURM_TASKS_PER_NODE", env)
    node = _int_var(env, "SLURM_NODEID")
    if not spec:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node or 0] if (node or 0) < len(counts) else None


def timeout_seconds(timeout: timedelta | float | None = None) -> float:
    """A new group's deadline: the argument, else ``SHARDLINE_TIMEOUT``, else 300 s.

    Waits that belong to a group take that group's ``timeout`` instead (it is this, once).
    """
    if timeout is None:
        return config.default_timeout()
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise ShardlineError(f"timeout must be positive, got {seconds} s")
    return seconds


def launcher_hosts_store(info: RendezvousInfo, env: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher hosts the store at ``info``'s address (see [Note: who hosts the store]).

    torchrun's rule: ``TORCHELASTIC_USE_AGENT_STORE=True``, and the store asked for is the one
    at the launcher's own ``MASTER_ADDR:MASTER_PORT``.
    """
    return (
        config.env_var("TORCHELASTIC_USE_AGENT_STORE", env) == "True"
        and config.env_var("MASTER_ADDR", env) == info.master_addr
        and config.env_var("MASTER_PORT", env) == str(info.master_port)
    )


def create_store(
    info: RendezvousInfo,
    timeout: timedelta | float | None = None,
    env: Mapping[str, str] | None = None,
) -> Store:
    """Opens the job's TCPStore: a client of the launcher's, else rank 0 hosts it.

    A launcher's store is seen through ``attempt_store`` (keys of this attempt only).

    Args:
        info: This process's place in the job.
        timeout: Deadline of every store wait; ``SHARDLINE_TIMEOUT`` or 300 s by default.
        env: Variables to read; ``os.environ`` by default.

    Raises:
        ShardlineError: rank 0 cannot bind ``MASTER_ADDR:MASTER_PORT`` (message names both),
            or a rank cannot reach the store before the timeout.
    """
    seconds = timeout_seconds(timeout)
    hosted = launcher_hosts_store(info, env)
    is_master = info.rank == 0 and not hosted
    where = f"{info.master_addr}:{info.master_port}"
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            info.master_addr,
            info.master_port,
            info.world_size,
            is_master,
            timedelta(seconds=seconds),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:
        text = str(exc)
        in_use = getattr(exc, "errno", None) == errno.EADDRINUSE or "address already in use" in (
            text.lower()
        )
        if is_master and in_use:
            raise ShardlineError(
                f"rank 0 cannot host the rendezvous store on {where}: address already in use; "
                "pick another MASTER_PORT or stop the process holding it"
            ) from exc
        role = "host" if is_master else "reach"
        host = "the launcher" if hosted else "rank 0"
        raise ShardlineError(
            f"rank {info.rank} cannot {role} the rendezvous store at {where}: {text}; "
            f"check MASTER_ADDR/MASTER_PORT and that {host} is running"
        ) from exc
    return attempt_store(store, env) if hosted else store


def attempt_store(store: Store, env: Mapping[str, str] | None = None) -> Store:
    """A launcher's store, seen by the workers of its current attempt only.

    A launcher's store outlives the workers it restarts (torchrun's does), so, as torch does,
    each attempt's keys live under ``/worker/attempt_<TORCHELASTIC_RESTART_COUNT>``: nothing a
    failed attempt left (addresses, a published failure) is read by the next.
    """
    attempt = (config.env_var("TORCHELASTIC_RESTART_COUNT", env) or "0").strip() or "0"
    return dist.PrefixStore(f"/worker/attempt_{attempt}", store)  # type: ignore[attr-defined]


def host_identity(env: Mapping[str, str] | None = None) -> str:
    """This host's identity: ``SHARDLINE_HOST_ID`` if set, else hostname plus boot id.

    Ranks with equal identities talk through shared memory; tests set ``SHARDLINE_HOST_ID``
    to force the TCP path between processes of one machine.
    """
    given = config.raw("SHARDLINE_HOST_ID", env)
    return given if given is not None else machine_identity()


def machine_identity() -> str:
    """This machine's identity, hostname plus boot id, whatever ``SHARDLINE_HOST_ID`` says.

    Ranks with equal machine identities share its cores, which decides how long they may
    spin while waiting.
    """
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def _secret_from_env(env: Mapping[str, str] | None) -> bytes | None:
    raw = config.raw("SHARDLINE_SECRET", env)
    if raw is None:
        return None
    return hashlib.sha256(raw.encode("utf-8")).digest()


INSECURE_SECRET = b"shardline-insecure-no-secret"


def _fail_together(client: StoreClient, world_size: int, *, key: str) -> None:
    """Lets every rank finish its store calls before rank 0 (the store's host) exits.

    Ranks other than 0 check in and return; rank 0 waits (up to 10 s) until all did, so the
    others raise the same clear error instead of "connection reset" from a vanished store.
    """
    step = "reporting the missing SHARDLINE_SECRET to the other ranks"
    if client.rank != 0:
        client.add(key, 1, step)
        return
    deadline = time.monotonic() + 10
    while client.add(key, 0, step) < world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.01)


def job_secret(
    store: Store | StoreClient,
    rank: int,
    host_ids: list[str],
    *,
    key: str,
    env: Mapping[str, str] | None = None,
) -> bytes:
    """The job's shared secret for the HMAC handshake.

    ``SHARDLINE_SECRET`` (any string, hashed with SHA-256) when set. Otherwise a single-host
    job gets 32 random bytes from rank 0 through the store; this is weaker (anyone who can
    reach the store can read it), but single-host jobs bind to loopback only. A multi-host job
    without a secret fails unless ``SHARDLINE_INSECURE=1`` opts out (empty secret).

    Args:
        store: The job's store (or a client of it for the task at hand).
        rank: This rank in the group being formed.
        host_ids: Every rank's host identity.
        key: Store key for a generated secret.
        env: Variables to read; ``os.environ`` by default.

    Raises:
        ShardlineError: a multi-host job without a secret, or the store failed (the message
            names the rank and the step).
    """
    from_env = _secret_from_env(env)
    if from_env is not None:
        return from_env
    client = store_errors(store, rank=rank, task="resolving the job secret")
    if len(set(host_ids)) > 1:
        if config.get("SHARDLINE_INSECURE", env):
            # The handshake still runs (it rejects strays and garbage) but proves nothing.
            return INSECURE_SECRET
        _fail_together(client, len(host_ids), key=f"{key}/missing")
        raise ShardlineError(
            f"rank {rank}: this job spans {len(set(host_ids))} hosts but SHARDLINE_SECRET is "
            "not set; set the same SHARDLINE_SECRET on every rank (`shardline run` does), or "
            "set SHARDLINE_INSECURE=1 to accept unauthenticated connections"
        )
    if rank == 0:
        client.set(key, secrets.token_bytes(32), "publishing the job secret it generated")
    return client.get(key, "reading the job secret rank 0 generated")
