"""Buddy copies: each rank's commit is also held by the next rank of its group.

With buddies, one lost rank's committed state is rebuilt from the survivors, with no disk
read: rank ``r`` sends its commit to rank ``(r + 1) % n`` (its buddy) and keeps the commit of
rank ``(r - 1) % n``. Host memory per rank doubles; a commit costs one point-to-point
exchange of this rank's share on top of the host copy.

A commit travels as a header (its skeleton, tensors replaced by ``Slot``s, and each tensor's
shape and dtype, pickled) and its tensors, each sent as it is (through the group's device:
NCCL stages a tensor at a time through the GPU).
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from shardline.comm.group import ProcessGroup

__all__ = ["Slot", "exchange", "give", "take"]


@dataclass(frozen=True)
class Slot:
    """Where a tensor was in a commit's skeleton: its index among the tensors sent."""

    index: int


def _send(g: ProcessGroup, t: torch.Tensor, dst: int, works: list[Any], keep: list[Any]) -> None:
    on = t.to(g.device) if t.device != g.device else t
    keep.append(on)
    works.append(g.send(on, dst, async_op=True))


def _recv(g: ProcessGroup, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=g.device)
    g.recv(buf, src)
    return buf.cpu() if buf.device.type != "cpu" else buf


def _send_commit(
    g: ProcessGroup, skeleton: Any, tensors: list[torch.Tensor], dst: int
) -> tuple[list[Any], list[Any]]:
    works: list[Any] = []
    keep: list[Any] = []
    specs = [(tuple(t.shape), t.dtype) for t in tensors]
    blob = torch.frombuffer(bytearray(pickle.dumps((skeleton, specs))), dtype=torch.uint8)
    _send(g, torch.tensor([blob.numel()], dtype=torch.int64), dst, works, keep)
    _send(g, blob, dst, works, keep)
    for t in tensors:
        if t.numel():
            _send(g, t.reshape(-1), dst, works, keep)
    return works, keep


def _recv_commit(g: ProcessGroup, src: int) -> tuple[Any, list[torch.Tensor]]:
    n = int(_recv(g, (1,), torch.int64, src)[0])
    header = _recv(g, (n,), torch.uint8, src).numpy().tobytes()
    skeleton, specs = pickle.loads(header)  # from a rank of our own job
    tensors = [
        _recv(g, (math.prod(shape),), dtype, src).reshape(shape)
        if math.prod(shape)
        else torch.empty(shape, dtype=dtype)
        for shape, dtype in specs
    ]
    return skeleton, tensors


def exchange(
    g: ProcessGroup, skeleton: Any, tensors: list[torch.Tensor]
) -> tuple[Any, list[torch.Tensor]]:
    """Sends this rank's commit to the next rank; returns the previous rank's. Collective."""
    r, n = g.rank, g.world_size
    if n == 2 or g.backend == "nccl":
        # One direction at a time: odd ranks receive first, even ranks send first. Two ranks
        # are each other's buddy over one connection (over TCP a large send and receive with
        # one peer at once can wait on each other); NCCL runs a rank's sends and receives one
        # after another on its stream, so a ring of ranks all sending first would wait forever.
        # With an odd n the last (even) rank sends to 0, which sends to 1 first: the chain
        # still ends.
        if r % 2:
            got = _recv_commit(g, (r - 1) % n)
            give(g, skeleton, tensors, (r + 1) % n)
            return got
        give(g, skeleton, tensors, (r + 1) % n)
        return _recv_commit(g, (r - 1) % n)
    works, keep = _send_commit(g, skeleton, tensors, (r + 1) % n)
    got = _recv_commit(g, (r - 1) % n)
    for w in works:
        w.wait()
    del keep
    return got


def give(g: ProcessGroup, skeleton: Any, tensors: list[torch.Tensor], dst: int) -> None:
    """Sends a held commit to rank ``dst`` (which calls ``take``)."""
    works, keep = _send_commit(g, skeleton, tensors, dst)
    for w in works:
        w.wait()
    del keep


def take(g: ProcessGroup, src: int) -> tuple[Any, list[torch.Tensor]]:
    """Receives the commit rank ``src`` sends with ``give``."""
    return _recv_commit(g, src)
