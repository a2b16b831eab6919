"""The native backend: one ``shardline._native.Group`` per ProcessGroup, set up via the store.

Setup, for a group named ``name`` (all store keys live under ``shardline/<name>/``):

1. every rank publishes its host identity and reads everybody's;
2. the job secret is resolved (``SHARDLINE_SECRET``, or generated on one host);
3. every rank binds a ``Listener`` (loopback on one host; else ``SHARDLINE_BIND_ADDR`` or the
   address that routes to the master) and publishes its address;
4. the lowest rank of each host with two or more ranks sweeps stale arenas, creates the
   shared-memory arena ``/dev/shm/shardline-<pid>-<hex>`` and publishes its path;
5. every rank constructs its ``Group`` (linking stops at once if a rank published a join
   failure: see [Note: a rank that fails while joining] in ``_store``); after a store barrier
   the creator unlinks the arena's name, so nothing is left in ``/dev/shm`` even if a rank is
   killed with ``kill -9``.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from shardline import config
from shardline.comm._buffers import dtype_name
from shardline.comm.rendezvous.env import job_secret, machine_identity
from shardline.comm.rendezvous.store import StoreClient, exchange, store_barrier
from shardline.comm.work import Counts
from shardline.errors import ShardlineError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    from shardline import _native

__all__ = ["NativeBackend", "bind_address", "create"]

# Bytes per shared-memory slot (two per rank). With cores to spare, small slots keep each
# chunk in cache while the next is copied; on small or oversubscribed machines every chunk
# boundary is a sync point that may wait for a descheduled rank, so fewer, larger chunks win.
DEFAULT_SLOT_BYTES = 256 << 10
FEW_CORES_SLOT_BYTES = 4 << 20
# With 4 comm threads per rank (below), each phase's passes are split four ways, and 256 KiB
# slots leave pieces too small to pay for the split: with the helpers, 1 MiB slots made 2- and
# 4-rank ops of 16-64 MiB 1.1-1.6x faster than 256 KiB ones on a 16-core host. Async ops
# (DDP's) use the larger slots too, on one thread, at a small cost: DDP at 2 ranks ran about
# 4 % slower than with 256 KiB.
THREADS_SLOT_BYTES = 1 << 20


def _native_module() -> Any:
    try:
        from shardline import _native  # noqa: PLC0415
    except ImportError as exc:
        raise ShardlineError(
            "the native engine shardline._native is not built; install shardline with "
            "`pip install .` (or `maturin develop --release`), or use backend='gloo'"
        ) from exc
    return _native


def bind_address(master_addr: str | None) -> str:
    """The address other hosts reach this rank at.

    ``SHARDLINE_BIND_ADDR`` if set; else the local address of the route to ``master_addr``
    (no packet is sent); else the address of this host's name.
    """
    given: str | None = config.raw("SHARDLINE_BIND_ADDR")
    if given is not None:
        return given
    if master_addr:
        try:
            family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((master_addr, 9))
                return str(s.getsockname()[0])
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def _env_int(name: str, default: int) -> int:
    """The integer setting ``name`` (checked by ``config``), else ``default``."""
    value: int | None = config.get(name)
    return default if value is None else value


def _job_ranks_on_node() -> int:
    """``LOCAL_WORLD_SIZE`` (the launcher's ranks on this node), 0 when unset or malformed."""
    raw = (config.env_var("LOCAL_WORLD_SIZE") or "").strip()
    return int(raw) if raw.isdigit() else 0


def _slot_bytes(local_ranks: int, threads: int = 1) -> int:
    """``SHARDLINE_SHM_SLOT_BYTES``, else a size chosen for the machine (see the constants)."""
    cores = len(os.sched_getaffinity(0))
    if cores <= 4 or local_ranks > cores:
        default = FEW_CORES_SLOT_BYTES
    else:
        default = THREADS_SLOT_BYTES if threads >= MAX_COMM_THREADS else DEFAULT_SLOT_BYTES
    return _env_int("SHARDLINE_SHM_SLOT_BYTES", default)


# Helper threads per rank for large blocking shared-memory ops, when every rank has at least
# this many cores. On a 16-core host, 4 threads per rank copied at 78-121 GB/s with 2-4 ranks
# against 26-47 GB/s with one, and made 16-64 MiB ops 1.3-3.9x faster. With 2 cores per rank
# (8 ranks) 2 threads gained little and made 8-rank broadcasts of 16-64 MiB 2.2x slower, so
# fewer than 4 cores per rank get none.
# More than 4 per rank were not measured.
MAX_COMM_THREADS = 4
# Ops below these sizes run on one thread: with 1 MiB slots (4 threads) a 1 MiB op is already
# split well; with 256 KiB slots (2-3 threads, set by hand) 1 MiB ops got slower (8 ranks:
# 206 -> 305 us).
THREADS_MIN_BYTES = 1 << 20
FEW_THREADS_MIN_BYTES = 4 << 20


def comm_threads(machine_ranks: int) -> int:
    """Threads per rank for large blocking shared-memory ops.

    ``SHARDLINE_COMM_THREADS`` if set; else ``MAX_COMM_THREADS`` when this process's cores,
    divided among the job's ranks on the machine, give every rank that many, and 1 (no
    helpers) otherwise.
    """
    cores = len(os.sched_getaffinity(0))
    spare = cores // max(1, machine_ranks) >= MAX_COMM_THREADS
    default = MAX_COMM_THREADS if spare else 1
    return _env_int("SHARDLINE_COMM_THREADS", default)


def comm_threads_min_bytes(threads: int) -> int:
    """Bytes of the smallest op that uses the comm threads.

    ``SHARDLINE_COMM_THREADS_MIN_BYTES`` if set; else ``THREADS_MIN_BYTES`` with 4 threads per
    rank and ``FEW_THREADS_MIN_BYTES`` with fewer.
    """
    default = THREADS_MIN_BYTES if threads >= MAX_COMM_THREADS else FEW_THREADS_MIN_BYTES
    return _env_int("SHARDLINE_COMM_THREADS_MIN_BYTES", default)


class NativeBackend:
    """Adapter from checked tensors to the engine's byte buffers (zero copy)."""

    name = "native"
    completes_blocking_ops = True  # async_op=False runs the op inline, to its end

    def __init__(
        self,
        group: _native.Group,
        *,
        store: Store,
        group_name: str,
        secret: bytes,
        host_id: str,
        master_addr: str | None,
        timeout: float,
    ) -> None:
        self._g = group
        self._store = store
        self.group_name = group_name
        self._secret = secret
        self._host_id = host_id
        self._master_addr = master_addr
        self._timeout = timeout
        self.rank = group.rank
        self.world_size = group.world_size
        self.transport = group.transport

    @property
    def engine(self) -> _native.Group:
        """The engine's communicator this backend drives."""
        return self._g

    def all_reduce(self, t: torch.Tensor, op: str, *, async_op: bool = True) -> _native.Work:
        return self._g.all_reduce(t, dtype_name(t), op, async_op=async_op)

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op: str, *, async_op: bool = True
    ) -> _native.Work:
        return self._g.reduce_scatter(out, inp, dtype_name(out), op, async_op)

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, counts: Counts, *, async_op: bool = True
    ) -> _native.Work:
        return self._g.all_gather(out, inp, dtype_name(inp), counts, async_op)

    def broadcast(self, t: torch.Tensor, root: int, *, async_op: bool = True) -> _native.Work:
        return self._g.broadcast(t, dtype_name(t), root, async_op=async_op)

    def reduce(self, t: torch.Tensor, op: str, root: int, *, async_op: bool = True) -> _native.Work:
        return self._g.reduce(t, dtype_name(t), op, root, async_op=async_op)

    def gather(
        self, out: torch.Tensor | None, inp: torch.Tensor, root: int, *, async_op: bool = True
    ) -> _native.Work:
        return self._g.gather(out, inp, dtype_name(inp), root, async_op=async_op)

    def scatter(
        self, out: torch.Tensor, inp: torch.Tensor | None, root: int, *, async_op: bool = True
    ) -> _native.Work:
        return self._g.scatter(out, inp, dtype_name(out), root, async_op=async_op)

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = True
    ) -> _native.Work:
        return self._g.all_to_all(out, inp, dtype_name(inp), async_op=async_op)

    def barrier(self, *, async_op: bool = True) -> _native.Work:
        return self._g.barrier(async_op=async_op)

    def send(
        self, t: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = True
    ) -> _native.Work:
        return self._g.send(t, dtype_name(t), dst, async_op=async_op, tag=tag)

    def recv(
        self, t: torch.Tensor, src: int | None, *, tag: int = 0, async_op: bool = True
    ) -> _native.Work:
        return self._g.recv(t, dtype_name(t), src, async_op=async_op, tag=tag)

    def subgroup(
        self,
        name: str,
        ranks: Sequence[int],
        *,
        overlap_compute: bool = False,
        timeout: float | None = None,
    ) -> NativeBackend:
        del overlap_compute  # a hint for GPU backends; CPU collectives take no SMs
        return create(
            self._store,
            list(ranks).index(self.rank),
            len(ranks),
            name=name,
            host_id=self._host_id,
            timeout=self._timeout if timeout is None else timeout,
            secret=self._secret,
            master_addr=self._master_addr,
        )

    def abort(self, reason: str) -> None:
        self._g.abort(reason)

    def close(self) -> None:
        self._g.close()


def create(
    store: Store,
    rank: int,
    world_size: int,
    *,
    name: str,
    host_id: str,
    timeout: float,
    secret: bytes | None = None,
    master_addr: str | None = None,
) -> NativeBackend:
    """Runs the setup in this module's docstring and returns the backend for one group.

    Args:
        store: The job's store (every rank of the group passes one connected to the same).
        rank: This rank within the group.
        world_size: Number of ranks in the group.
        name: Unique group name; namespaces the store keys.
        host_id: This host's identity (see ``rendezvous.host_identity``).
        timeout: Deadline of every blocking wait, in seconds.
        secret: Job secret; resolved from the environment when ``None``.
        master_addr: The store's host, used to pick a reachable bind address.
    """
    native = _native_module()
    prefix = f"shardline/{name}"
    client = StoreClient(store, rank=rank, task=f"creating group {name!r}")
    # One round for both identities: the host id decides shared memory, the machine (the
    # same unless SHARDLINE_HOST_ID overrides it) how many ranks share this machine's cores.
    ident = f"{host_id}\0{machine_identity()}"
    idents = exchange(client, f"{prefix}/host", world_size, ident, "host identity")
    host_ids = [i.split("\0", 1)[0] for i in idents]
    machines = [i.split("\0", 1)[-1] for i in idents]
    machine_ranks = machines.count(machines[rank])
    # A sub-group's ranks share the machine with the rest of the job: count the job's.
    job_local = _job_ranks_on_node()
    threads = comm_threads(max(machine_ranks, job_local))
    if secret is None:
        secret = job_secret(client, rank, host_ids, key=f"{prefix}/secret")
    listener = None
    addrs = [""] * world_size
    if world_size > 1:
        # Every group gets TCP links: between hosts for collectives, and for send/recv.
        # A single-host job binds loopback only.
        single_host = len(set(host_ids)) == 1
        listener = native.Listener("127.0.0.1" if single_host else bind_address(master_addr))
        addrs = exchange(client, f"{prefix}/addr", world_size, listener.address, "address")

    local = [r for r in range(world_size) if host_ids[r] == host_id]
    arena_path: str | None = None
    created = False
    if len(local) >= 2:
        key = f"{prefix}/arena/{local[0]}"
        if rank == local[0]:
            native.arena_sweep()
            arena_path = f"/dev/shm/shardline-{os.getpid()}-{secrets.token_hex(8)}"
            native.arena_create(arena_path, len(local), _slot_bytes(len(local), threads))
            created = True
            client.set(key, arena_path, "publishing its host's shared-memory arena")
        else:
            arena_path = client.get(key, "reading its host's shared-memory arena").decode()
    try:
        group = native.Group(
            rank,
            world_size,
            name=name,
            secret=secret,
            host_ids=host_ids,
            addrs=addrs,
            listener=listener,
            arena_path=arena_path,
            timeout=timeout,
            machine_ranks=machine_ranks,
            comm_threads=threads,
            comm_threads_min_bytes=comm_threads_min_bytes(threads),
            spin_us=config.get("SHARDLINE_SPIN_US"),
            stream_stores=config.get("SHARDLINE_STREAM_STORES"),
            oneshot_bytes=config.get("SHARDLINE_ONESHOT_BYTES"),
            keepalive=config.get("SHARDLINE_KEEPALIVE"),
            # A rank that failed while joining ends the linking at once (it never connects).
            cancel=lambda: client.raise_if_failed("linking with every rank"),
        )
        store_barrier(
            client, f"{prefix}/ready", world_size, timeout, "waiting for every rank to connect"
        )
    finally:
        if created and arena_path is not None:
            native.arena_unlink(arena_path)
    return NativeBackend(
        group,
        store=store,
        group_name=name,
        secret=secret,
        host_id=host_id,
        master_addr=master_addr,
        timeout=timeout,
    )
