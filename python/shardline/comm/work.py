"""``Work``: a collective in flight, and the backend interface every ProcessGroup drives."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeAlias

import torch

from shardline.comm.flight import FlightRecorder
from shardline.errors import ShardlineError

__all__ = ["Backend", "Counts", "Handle", "Work", "seconds"]

Counts: TypeAlias = Sequence[int] | None
"""Elements per rank of an unequal all_gather, in rank order; ``None`` when all are equal."""


def seconds(timeout: timedelta | float | None) -> float | None:
    """``timeout`` in seconds (``None`` stays ``None``)."""
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class Handle(Protocol):
    """What a backend returns for one op (the native ``Work``, or an adapter over gloo's)."""

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until done; raises the op's error."""

    def is_completed(self) -> bool:
        """Whether the op finished (successfully or not)."""

    @property
    def source(self) -> int | None:
        """The rank a finished receive took its message from; ``None`` for other ops."""


class Backend(Protocol):
    """The few primitives a backend implements; ``ProcessGroup`` checks arguments first.

    Every tensor argument is a contiguous tensor of a supported dtype whose sizes are
    already consistent, on the backend's ``device`` (an optional attribute; CPU when absent,
    ``cuda:N`` for nccl); every method starts the op and returns without waiting. ``recv``
    with ``src=None`` takes the first message with its tag from any rank; its handle's
    ``source`` then says which. A backend whose ``async_op=False`` calls return only once the
    op has ended says so with ``completes_blocking_ops = True``: the group then does not wait
    on their handles a second time.
    """

    name: str
    rank: int
    world_size: int
    transport: str

    def all_reduce(self, t: torch.Tensor, op: str, *, async_op: bool = True) -> Handle: ...
    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op: str, *, async_op: bool = True
    ) -> Handle: ...
    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, counts: Counts, *, async_op: bool = True
    ) -> Handle: ...
    def broadcast(self, t: torch.Tensor, root: int, *, async_op: bool = True) -> Handle: ...
    def reduce(self, t: torch.Tensor, op: str, root: int, *, async_op: bool = True) -> Handle: ...
    def gather(
        self, out: torch.Tensor | None, inp: torch.Tensor, root: int, *, async_op: bool = True
    ) -> Handle: ...
    def scatter(
        self, out: torch.Tensor, inp: torch.Tensor | None, root: int, *, async_op: bool = True
    ) -> Handle: ...
    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = True
    ) -> Handle: ...
    def barrier(self, *, async_op: bool = True) -> Handle: ...
    def send(self, t: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = True) -> Handle: ...
    def recv(
        self, t: torch.Tensor, src: int | None, *, tag: int = 0, async_op: bool = True
    ) -> Handle: ...
    def subgroup(
        self,
        name: str,
        ranks: Sequence[int],
        *,
        overlap_compute: bool = False,
        timeout: float | None = None,
    ) -> Backend: ...
    def abort(self, reason: str) -> None: ...
    def close(self) -> None: ...


class Work:
    """A collective in flight, returned by every op called with ``async_op=True``.

    [Note: ownership] a Work holds every tensor the engine reads or writes until the op is
    done, so dropping the caller's references early cannot free memory under the engine.
    Outputs given as lists of tensors are filled in by ``wait()``.
    """

    def __init__(
        self,
        handle: Handle,
        keepalive: tuple[object, ...],
        finalize: Callable[[], None] | None = None,
        on_error: Callable[[list[Any] | None, ShardlineError], ShardlineError] | None = None,
        record: list[Any] | None = None,
    ) -> None:
        self._handle = handle
        self._keepalive: tuple[object, ...] | None = keepalive
        self._finalize = finalize
        # The group notes the failure and may explain it (see ProcessGroup._failed).
        self._on_error = on_error
        self._record = record  # the flight recorder's record of the op

    def wait(self, timeout: timedelta | float | None = None) -> None:
        """Blocks until the op is done and its outputs are written.

        Args:
            timeout: Give up after this long (``timedelta`` or seconds); ``None`` waits up to
                the group's deadline.

        Raises:
            CollectiveTimeoutError: ``timeout`` passed first (the op keeps running).
            ShardlineError: the op failed (``PeerLostError``, ``CollectiveMismatchError``, ...).
        """
        try:
            self._handle.wait(seconds(timeout))
        except ShardlineError as exc:
            # A timeout the caller gave is theirs (the op keeps running): not the op's failure.
            if self._on_error is None or (timeout is not None and isinstance(exc, TimeoutError)):
                raise
            out = self._on_error(self._record, exc)
            if out is exc:
                raise
            raise out from exc
        FlightRecorder.finish(self._record)
        if self._finalize is not None:
            finalize, self._finalize = self._finalize, None
            finalize()
        self._keepalive = None

    def is_completed(self) -> bool:
        """Whether the op finished (list outputs are written on ``wait()``)."""
        return self._handle.is_completed()

    @property
    def source(self) -> int | None:
        """The rank a finished ``recv`` took its message from (``None`` for other ops)."""
        return self._handle.source

    def _done(self) -> bool:
        if self._keepalive is None:
            return True
        if self._handle.is_completed():
            FlightRecorder.finish(self._record)
            return True
        return False
