"""The module-level API on the default group: ``init``, the collectives, ``shutdown``.

Each function takes ``group=None`` (the default group from ``init``) and mirrors the
``ProcessGroup`` method of the same name.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from shardline import config
from shardline.comm import BACKENDS, init_process_group
from shardline.comm._buffers import TensorLike
from shardline.comm.group import ProcessGroup, TensorList
from shardline.comm.rendezvous import create_store, host_identity, read_env
from shardline.comm.work import Work
from shardline.errors import ShardlineError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "choose_backend",
    "default_group",
    "gather",
    "get_rank",
    "get_world_size",
    "init",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "shutdown",
]

_lock = threading.Lock()
_default: ProcessGroup | None = None
_store: Store | None = None


def choose_backend(
    backend: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    local_world_size: int = 1,
    cuda_devices: int | None = None,
) -> str:
    """The backend ``init`` uses; the same on every rank of a uniform job.

    The rule, first match wins:

    1. ``backend``, if given;
    2. ``SHARDLINE_BACKEND``, if set;
    3. ``SHARDLINE_DEVICE``: ``cpu`` gives ``"native"``, ``cuda`` or ``cuda:N`` gives ``"nccl"``;
    4. ``"nccl"`` if this host has at least one visible GPU per local rank
       (``torch.cuda.device_count() >= LOCAL_WORLD_SIZE``), else ``"native"``.

    Rule 4 never gives two ranks of one GPU (NCCL refuses that); a GPU host that trains on
    CPU sets ``SHARDLINE_DEVICE=cpu``. ``"gloo"`` and ``"mpi"`` are only used when named.

    Args:
        backend: The caller's choice, if any.
        env: Variables to read; ``os.environ`` by default.
        local_world_size: Number of ranks on this host.
        cuda_devices: Visible GPUs; ``torch.cuda.device_count()`` (0 without CUDA) if ``None``.

    Raises:
        ShardlineError: an unknown backend or ``SHARDLINE_DEVICE``.
    """
    if backend:
        if backend not in BACKENDS:
            raise ShardlineError(
                f"backend={backend!r} is not a backend; use one of {', '.join(BACKENDS)}"
            )
        return backend
    named: str | None = config.get("SHARDLINE_BACKEND", env)
    if named is not None:
        return named
    device: str | None = config.get("SHARDLINE_DEVICE", env)
    if device == "cpu":
        return "native"
    if device is not None:
        return "nccl"
    if cuda_devices is None:
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if cuda_devices >= max(local_world_size, 1) else "native"


def init(backend: str | None = None, timeout: timedelta | float | None = None) -> ProcessGroup:
    """Joins the job described by the environment and creates the default group.

    Reads torchrun's env:// variables or SLURM's (see ``shardline.comm.rendezvous``), opens
    the TCPStore on rank 0, and connects every rank. With ``backend="mpi"`` the ranks are
    MPI's and no store is opened: plain ``mpirun -n 4 python train.py`` works, and where
    ``RANK``/``WORLD_SIZE`` are set they must match MPI's.

    Args:
        backend: ``"native"`` (CPU tensors), ``"nccl"`` (CUDA tensors, one GPU per rank,
            ``cuda:LOCAL_RANK``), ``"gloo"`` or ``"mpi"``. ``None`` takes ``SHARDLINE_BACKEND``,
            else chooses by device: see ``choose_backend`` (nccl where every local rank has a
            GPU and ``SHARDLINE_DEVICE`` is not ``cpu``, else native). Every rank must end up
            with the same backend; ranks that disagree with rank 0 fail here.
        timeout: Deadline of every blocking wait; ``SHARDLINE_TIMEOUT`` or 300 s by default.

    Returns:
        The default group.

    Raises:
        ShardlineError: already initialised, inconsistent environment or backend choice, or
            setup failure.
    """
    global _default, _store  # noqa: PLW0603
    with _lock:
        if _default is not None:
            raise ShardlineError(
                f"shardline is already initialised on rank {_default.rank}; call "
                "shardline.shutdown() first"
            )
        named = backend.strip().lower() if backend else config.get("SHARDLINE_BACKEND")
        if named == "mpi":  # MPI has its own rendezvous
            _default = _init_mpi(timeout)
            return _default
        info = read_env()
        chosen = choose_backend(backend, local_world_size=info.local_world_size)
        store = create_store(info, timeout)
        _agree_on_backend(store, info.rank, chosen, explicit=bool(named))
        device = None
        if chosen == "nccl":
            from shardline.comm.backends import nccl  # noqa: PLC0415

            device = nccl.default_device(info.local_rank)
        group = init_process_group(
            store,
            info.rank,
            info.world_size,
            backend=chosen,
            host_id=host_identity(),
            timeout=timeout,
            master_addr=info.master_addr,
            device=device,
        )
        _default, _store = group, store
        return group


def _agree_on_backend(store: Store, rank: int, chosen: str, *, explicit: bool) -> None:
    """Fails a rank whose backend differs from rank 0's, instead of hanging in setup."""
    key = "shardline/init/backend"
    if rank == 0:
        store.set(key, chosen)
        return
    theirs = bytes(store.get(key)).decode()
    if theirs != chosen:
        how = "was given" if explicit else "chose"
        raise ShardlineError(
            f"rank {rank} {how} backend {chosen!r} but rank 0 uses {theirs!r}; every rank needs "
            "the same backend: pass the same backend= or set SHARDLINE_BACKEND (or "
            "SHARDLINE_DEVICE) alike on every host"
        )


def _init_mpi(timeout: timedelta | float | None) -> ProcessGroup:
    """The default group on MPI: ranks from MPI, checked against RANK/WORLD_SIZE if set."""
    from shardline.comm.backends import mpi  # noqa: PLC0415

    rank, world_size = mpi.mpi_rank_and_size()
    # A launcher's RANK/WORLD_SIZE, if any, must agree with MPI's (mpi.create checks that).
    for name in ("RANK", "WORLD_SIZE"):
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ShardlineError(f"{name}={raw!r} is not an integer") from None
        if name == "RANK":
            rank = value
        else:
            world_size = value
    return init_process_group(None, rank, world_size, backend="mpi", timeout=timeout)


def is_initialized() -> bool:
    """Whether ``init`` created a default group (and ``shutdown`` has not run)."""
    return _default is not None


def default_group() -> ProcessGroup:
    """The default group; raises ``ShardlineError`` if ``init`` has not run."""
    if _default is None:
        raise ShardlineError("shardline is not initialised; call shardline.init() first")
    return _default


def _g(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else default_group()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group``."""
    return _g(group).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group``."""
    return _g(group).world_size


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """See ``ProcessGroup.barrier``."""
    return _g(group).barrier(async_op=async_op)


def all_reduce(
    tensor: TensorLike,
    op: object = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.all_reduce``."""
    return _g(group).all_reduce(tensor, op, async_op=async_op)


def reduce_scatter(
    output: TensorLike,
    input: TensorLike | TensorList,
    op: object = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.reduce_scatter``."""
    return _g(group).reduce_scatter(output, input, op, async_op=async_op)


def all_gather(
    output: TensorLike | TensorList,
    input: TensorLike,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.all_gather``."""
    return _g(group).all_gather(output, input, async_op=async_op)


def broadcast(
    tensor: TensorLike, src: int = 0, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """See ``ProcessGroup.broadcast``."""
    return _g(group).broadcast(tensor, src, async_op=async_op)


def reduce(
    tensor: TensorLike,
    dst: int = 0,
    op: object = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.reduce``."""
    return _g(group).reduce(tensor, dst, op, async_op=async_op)


def gather(
    tensor: TensorLike,
    gather_list: TensorLike | TensorList | None = None,
    dst: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.gather``."""
    return _g(group).gather(tensor, gather_list, dst, async_op=async_op)


def scatter(
    tensor: TensorLike,
    scatter_list: TensorLike | TensorList | None = None,
    src: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.scatter``."""
    return _g(group).scatter(tensor, scatter_list, src, async_op=async_op)


def all_to_all(
    output: TensorLike,
    input: TensorLike,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.all_to_all``."""
    return _g(group).all_to_all(output, input, async_op=async_op)


def send(
    tensor: TensorLike, dst: int, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """See ``ProcessGroup.send``."""
    return _g(group).send(tensor, dst, async_op=async_op)


def recv(
    tensor: TensorLike, src: int, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """See ``ProcessGroup.recv``."""
    return _g(group).recv(tensor, src, async_op=async_op)


def new_group(ranks: Sequence[int], group: ProcessGroup | None = None) -> ProcessGroup | None:
    """See ``ProcessGroup.new_group``; every rank of ``group`` must call it."""
    return _g(group).new_group(ranks)


def shutdown() -> None:
    """Shuts the default group down (waiting for queued ops) and closes the store."""
    global _default, _store  # noqa: PLW0603
    with _lock:
        group, _default = _default, None
        _store = None
        if group is not None:
            group.shutdown()
