"""Point-to-point messages of a ``ProcessGroup``: ``send`` and ``recv``, tags, any source.

A part of ``ProcessGroup`` kept in a file of its own: ``ProcessGroup.send`` and ``.recv`` (which
carry the documentation) are these, on the group's own checks and op submission.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardline.comm import flight
from shardline.comm.work import Handle, Work
from shardline.errors import InvalidArgumentError, ShardlineError

if TYPE_CHECKING:
    from shardline.comm._buffers import TensorLike
    from shardline.comm.group import ProcessGroup

__all__ = ["recv", "send"]


def send(
    group: ProcessGroup, tensor: TensorLike, dst: int, async_op: bool, tag: int
) -> Work | None:
    """``group.send``: checks the arguments, counts the bytes, submits the op."""
    t = group._t(tensor, "send(tensor)")
    group._check_rank("send", "dst", dst)
    if dst == group.rank:
        raise InvalidArgumentError(f"send on rank {group.rank}: dst is this rank itself")
    tag = _tag(group, "send", tag)
    group._count("send", (t.nbytes, 0))
    return group._submit(
        "send",
        lambda a: group._impl.send(t, dst, tag=tag, async_op=a),
        (tensor, t),
        async_op,
        peer=dst,
    )


def recv(
    group: ProcessGroup, tensor: TensorLike, src: int | None, async_op: bool, tag: int
) -> Work | int:
    """``group.recv``: checks the arguments, counts the bytes, submits; says who sent."""
    t = group._t(tensor, "recv(tensor)")
    if src is not None:
        group._check_rank("recv", "src", src)
        if src == group.rank:
            raise InvalidArgumentError(f"recv on rank {group.rank}: src is this rank itself")
    tag = _tag(group, "recv", tag)
    group._count("recv", (0, t.nbytes))
    started: list[Handle] = []

    def start(a: bool) -> Handle:
        started.append(group._impl.recv(t, src, tag=tag, async_op=a))
        return started[-1]

    peer = flight.ANY_SOURCE if src is None else src
    work = group._submit("recv", start, (tensor, t), async_op, peer=peer)
    if work is not None:
        return work
    if src is not None:
        return src
    source = started[0].source
    if source is None:  # every backend that receives from any source says from whom
        raise ShardlineError(
            f"recv on rank {group.rank}: backend {group.backend!r} did not say which rank "
            "sent the message; please report it"
        )
    return source


def _tag(group: ProcessGroup, op: str, tag: int) -> int:
    if not isinstance(tag, int) or not 0 <= tag < 2**32:
        raise InvalidArgumentError(
            f"{op} on rank {group.rank}: tag={tag!r} must be an integer from 0 to 2**32 - 1"
        )
    return tag
