"""The module-level collectives, on the default group unless ``group=`` is given.

Each function takes ``group=None`` (the default group from ``init``) and mirrors the
``ProcessGroup`` method of the same name. The job's lifetime (``init``, ``shutdown``,
``is_initialized``, ``default_group``, ``choose_backend``) lives in ``shardline.comm.world``.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardline.comm._buffers import TensorLike
from shardline.comm.group import ProcessGroup, TensorList
from shardline.comm.work import Work
from shardline.comm.world import default_group

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "get_rank",
    "get_world_size",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
]


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
    tensor: TensorLike,
    dst: int,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: int = 0,
) -> Work | None:
    """See ``ProcessGroup.send``."""
    return _g(group).send(tensor, dst, async_op=async_op, tag=tag)


def recv(
    tensor: TensorLike,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: int = 0,
) -> Work | int:
    """See ``ProcessGroup.recv``: the sender's rank, or a ``Work`` with ``async_op``."""
    return _g(group).recv(tensor, src, async_op=async_op, tag=tag)


def new_group(ranks: Sequence[int], group: ProcessGroup | None = None) -> ProcessGroup | None:
    """See ``ProcessGroup.new_group``; every rank of ``group`` must call it."""
    return _g(group).new_group(ranks)
