"""The module-level API on the default group: ``init``, the collectives, ``shutdown``.

Each function takes ``group=None`` (the default group from ``init``) and mirrors the
``ProcessGroup`` method of the same name.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from shardline.comm import init_process_group
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


def init(backend: str | None = None, timeout: timedelta | float | None = None) -> ProcessGroup:
    """Joins the job described by the environment and creates the default group.

    Reads torchrun's env:// variables or SLURM's (see ``shardline.comm.rendezvous``), opens
    the TCPStore on rank 0, and connects every rank.

    Args:
        backend: ``"native"`` (default; CPU tensors) or ``"gloo"``. ``"nccl"`` and ``"mpi"``
            arrive with later issues.
        timeout: Deadline of every blocking wait; ``SHARDLINE_TIMEOUT`` or 300 s by default.

    Returns:
        The default group.

    Raises:
        ShardlineError: already initialised, inconsistent environment, or setup failure.
    """
    global _default, _store
    with _lock:
        if _default is not None:
            raise ShardlineError(
                f"shardline is already initialised on rank {_default.rank}; call "
                "shardline.shutdown() first"
            )
        info = read_env()
        store = create_store(info, timeout)
        group = init_process_group(
            store,
            info.rank,
            info.world_size,
            backend=backend or "native",
            host_id=host_identity(),
            timeout=timeout,
            master_addr=info.master_addr,
        )
        _default, _store = group, store
        return group


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
