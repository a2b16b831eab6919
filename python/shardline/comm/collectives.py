"""The module-level collectives, on the default group unless ``group=`` is given.

Each function takes ``group=None`` (the default group from ``init``) and mirrors the
``ProcessGroup`` method of the same name. On a rank outside a group, ``new_group`` gives
``NON_MEMBER`` (torch's ``GroupMember.NON_GROUP_MEMBER``): passed as ``group=``, the call does
nothing on that rank and returns ``None`` (``get_rank``, ``get_world_size`` and ``recv``: -1), as
in torch, where ``None`` would have run it on the default group.

The job's lifetime (``init``, ``shutdown``, ``is_initialized``, ``default_group``,
``choose_backend``) lives in ``shardline.comm.world``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardline.comm._buffers import TensorLike
from shardline.comm.group import ProcessGroup, TensorList
from shardline.comm.work import Work
from shardline.comm.world import default_group

__all__ = [
    "NON_MEMBER",
    "NonMember",
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


class NonMember:
    """What ``new_group`` gives a rank outside the new group (``NON_MEMBER``); see the module doc.

    Falsy, and without collectives of its own: ``group.all_reduce`` on it raises naming why.
    """

    __slots__ = ()

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "shardline.NON_MEMBER"

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"this rank is not in the group new_group made (NON_MEMBER), which has no {name!r}; "
            "pass it as group= to shardline's functions (shardline.all_reduce(t, group=...)), "
            "which do nothing on ranks outside it"
        )


NON_MEMBER = NonMember()

Group = ProcessGroup | NonMember | None


def _g(group: Group) -> ProcessGroup | NonMember:
    return group if group is not None else default_group()


def get_rank(group: Group = None) -> int:
    """This process's rank in ``group`` (-1 outside it: ``NON_MEMBER``)."""
    g = _g(group)
    return -1 if isinstance(g, NonMember) else g.rank


def get_world_size(group: Group = None) -> int:
    """Number of ranks in ``group`` (-1 on a rank outside it: ``NON_MEMBER``)."""
    g = _g(group)
    return -1 if isinstance(g, NonMember) else g.world_size


def barrier(group: Group = None, async_op: bool = False) -> Work | None:
    """See ``ProcessGroup.barrier``."""
    g = _g(group)
    return None if isinstance(g, NonMember) else g.barrier(async_op=async_op)


def all_reduce(
    tensor: TensorLike,
    op: object = "sum",
    group: Group = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.all_reduce``."""
    g = _g(group)
    return None if isinstance(g, NonMember) else g.all_reduce(tensor, op, async_op=async_op)


def reduce_scatter(
    output: TensorLike,
    input: TensorLike | TensorList,
    op: object = "sum",
    group: Group = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.reduce_scatter``."""
    g = _g(group)
    return (
        None if isinstance(g, NonMember) else g.reduce_scatter(output, input, op, async_op=async_op)
    )


def all_gather(
    output: TensorLike | TensorList,
    input: TensorLike,
    group: Group = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.all_gather``."""
    g = _g(group)
    return None if isinstance(g, NonMember) else g.all_gather(output, input, async_op=async_op)


def broadcast(
    tensor: TensorLike, src: int = 0, group: Group = None, async_op: bool = False
) -> Work | None:
    """See ``ProcessGroup.broadcast``."""
    g = _g(group)
    return None if isinstance(g, NonMember) else g.broadcast(tensor, src, async_op=async_op)


def reduce(
    tensor: TensorLike,
    dst: int = 0,
    op: object = "sum",
    group: Group = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.reduce``."""
    g = _g(group)
    return None if isinstance(g, NonMember) else g.reduce(tensor, dst, op, async_op=async_op)


def gather(
    tensor: TensorLike,
    gather_list: TensorLike | TensorList | None = None,
    dst: int = 0,
    group: Group = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.gather``."""
    g = _g(group)
    return (
        None if isinstance(g, NonMember) else g.gather(tensor, gather_list, dst, async_op=async_op)
    )


def scatter(
    tensor: TensorLike,
    scatter_list: TensorLike | TensorList | None = None,
    src: int = 0,
    group: Group = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.scatter``."""
    g = _g(group)
    return (
        None
        if isinstance(g, NonMember)
        else g.scatter(tensor, scatter_list, src, async_op=async_op)
    )


def all_to_all(
    output: TensorLike,
    input: TensorLike,
    group: Group = None,
    async_op: bool = False,
) -> Work | None:
    """See ``ProcessGroup.all_to_all``."""
    g = _g(group)
    return None if isinstance(g, NonMember) else g.all_to_all(output, input, async_op=async_op)


def send(
    tensor: TensorLike,
    dst: int,
    group: Group = None,
    async_op: bool = False,
    tag: int = 0,
) -> Work | None:
    """See ``ProcessGroup.send``."""
    g = _g(group)
    return None if isinstance(g, NonMember) else g.send(tensor, dst, async_op=async_op, tag=tag)


def recv(
    tensor: TensorLike,
    src: int | None = None,
    group: Group = None,
    async_op: bool = False,
    tag: int = 0,
) -> Work | int:
    """See ``ProcessGroup.recv``: the sender's rank, or a ``Work`` with ``async_op``."""
    g = _g(group)
    return -1 if isinstance(g, NonMember) else g.recv(tensor, src, async_op=async_op, tag=tag)


def new_group(ranks: Sequence[int], group: Group = None) -> ProcessGroup | NonMember:
    """See ``ProcessGroup.new_group``; every rank of ``group`` must call it.

    A rank outside ``ranks`` gets ``NON_MEMBER``, which these functions skip (torch's way).
    """
    g = _g(group)
    if isinstance(g, NonMember):
        return NON_MEMBER
    sub = g.new_group(ranks)
    return sub if sub is not None else NON_MEMBER
