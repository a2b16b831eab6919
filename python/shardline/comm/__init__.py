"""Communication layer: rendezvous, process groups, device meshes and the public collectives.

- ``rendezvous``: env:// and SLURM variables, the TCPStore, host identity, secret, timeout.
- ``world``: the job and its default group: ``init``, ``shutdown``, ``default_group``.
- ``group``: ``ProcessGroup``, the collectives strategies call; ``work``: ``Work``.
- ``backends``: ``native`` (the Rust engine, CPU), ``nccl`` (torch's, CUDA), ``gloo`` (torch's,
  a reference) and ``mpi`` (mpi4py, optional).
- ``mesh``: ``DeviceMesh``, a process group per named axis.
- ``collectives``: the module-level collectives on the default group.
- ``objects``: ``all_gather_object`` and ``broadcast_object``, pickled objects.
- ``torch_backend``: the ``torch.distributed`` backend ``"shardline"``.

``init_process_group`` (here) creates a group from a store, with no global state.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from shardline.comm.group import ProcessGroup
from shardline.comm.rendezvous.env import host_identity, timeout_seconds
from shardline.comm.work import Work
from shardline.config import BACKENDS
from shardline.errors import ShardlineError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["ProcessGroup", "Work", "init_process_group"]


def init_process_group(
    store: Store | None,
    rank: int,
    world_size: int,
    *,
    backend: str = "native",
    host_id: str | None = None,
    name: str = "world",
    timeout: timedelta | float | None = None,
    secret: bytes | None = None,
    master_addr: str | None = None,
    device: torch.device | str | int | None = None,
) -> ProcessGroup:
    """Creates a ProcessGroup from an existing store (no global state; ranks may be threads).

    Args:
        store: A store every rank of the group is connected to (e.g. a ``TCPStore``); only
            ``"mpi"``, which rendezvous through MPI itself, accepts ``None``.
        rank: This rank, in ``[0, world_size)``.
        world_size: Number of ranks.
        backend: ``"native"`` (CPU tensors, the Rust engine), ``"nccl"`` (CUDA tensors,
            through torch's NCCL), ``"gloo"`` (torch's gloo, CPU) or ``"mpi"`` (mpi4py, CPU;
            ``rank``/``world_size`` must be MPI's).
        host_id: This rank's host identity; ``rendezvous.host_identity()`` when ``None``.
            Ranks with equal ids use shared memory, others TCP.
        name: Group name; namespaces store keys, so two groups on one store need two names.
        timeout: Deadline of every blocking wait (default ``SHARDLINE_TIMEOUT`` or 300 s): the
            group's ``timeout``, which its sub-groups inherit and work on the group (a
            checkpoint's commit, async SGD) waits by.
        secret: Job secret for TCP authentication; from ``SHARDLINE_SECRET`` when ``None``.
        master_addr: The store's host, to pick the address other hosts reach this rank at.
        device: The nccl backend's GPU (``"cuda:1"``, ``1``, a ``torch.device``); ``None``
            picks ``SHARDLINE_DEVICE=cuda:N`` or ``cuda:LOCAL_RANK``. Ignored by the others.

    Raises:
        ShardlineError: unknown or unavailable backend, bad rank, or setup failure.
    """
    seconds = timeout_seconds(timeout)
    if backend == "mpi":
        # Before any check of this rank alone: mpi.create checks every rank collectively, so
        # a bad rank fails all ranks instead of leaving the others waiting in MPI.
        from shardline.comm.backends import mpi  # noqa: PLC0415

        return ProcessGroup(
            mpi.create(store, rank, world_size, name=name, timeout=seconds), timeout=seconds
        )
    if not 0 <= rank < world_size:
        raise ShardlineError(f"rank {rank} is outside [0, world_size={world_size})")
    if master_addr is None:
        master_addr = getattr(store, "host", None)
    if backend not in BACKENDS:
        raise ShardlineError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if store is None:
        raise ShardlineError(f"backend={backend!r} needs a store (e.g. a torch TCPStore)")
    if backend == "native":
        from shardline.comm.backends import native  # noqa: PLC0415

        impl = native.create(
            store,
            rank,
            world_size,
            name=name,
            host_id=host_id if host_id is not None else host_identity(),
            timeout=seconds,
            secret=secret,
            master_addr=master_addr,
        )
        return ProcessGroup(impl, timeout=seconds)
    if backend == "gloo":
        from shardline.comm.backends import gloo  # noqa: PLC0415

        return ProcessGroup(
            gloo.create(store, rank, world_size, name=name, timeout=seconds), timeout=seconds
        )
    from shardline.comm.backends import nccl  # noqa: PLC0415

    return ProcessGroup(
        nccl.create(store, rank, world_size, name=name, timeout=seconds, device=device),
        timeout=seconds,
    )
