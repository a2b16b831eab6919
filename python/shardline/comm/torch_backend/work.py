"""torch ``Work``s over native ops: ``ShardlineWork``, and the threads that complete futures.

[Note: completion] Every op is started on the engine with ``async_op=True`` and returned as a
``ShardlineWork`` (a ``torch.distributed.Work``). ``wait()`` waits for the native op in the
calling thread (blocking collectives cost no thread hand-off). ``get_future()`` returns a
``torch.futures.Future`` holding the op's output tensors that completes when the op finishes
whether or not anybody calls ``wait()``: DDP's reducer calls ``allreduce`` then
``get_future()`` and only ever waits on the future (from the autograd thread, without the GIL).
The first ``get_future()`` hands the op to ``_Completer``, a pool of daemon threads in which a
thread waits for the native op (GIL released), writes list outputs, then completes the future;
completing runs the future's ``then`` callbacks in that thread. The pool keeps the invariant
that every handed-over op has a thread of its own that runs no callback meanwhile (a thread
that is idle and not yet promised to another op, else a new one), so a callback that blocks,
even on another op's future, cannot keep a later op's future from completing. Every wait is
bounded by the engine's deadline, so every future completes, with a result or the op's error.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardline.errors import CollectiveTimeoutError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Work as _WorkBase

    from shardline.comm.work import Work
else:  # a torch without distributed support still imports shardline (see register())
    _WorkBase = getattr(dist, "_Work", object)

__all__ = ["ShardlineWork"]

_IDLE_S = 30.0  # a completer thread with nothing to do for this long exits


class _Op:
    """The state of one torch op: its native Works, outputs, and the future handed out.

    [Note: locks] ``_wait_lock`` serialises waiting and writing list outputs (held while the
    engine works, never while user callbacks run); ``_state_lock`` guards the flags and the
    future and is only ever held briefly, so ``get_future()`` never waits for the op.
    """

    def __init__(
        self,
        works: Sequence[Work],
        result: list[torch.Tensor],
        after: Callable[[], None] | None = None,
    ) -> None:
        self._works = list(works)
        self.result = result
        self._after = after
        self._wait_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None
        self._notified = False
        self.source: int | None = None  # a receive's sender, once it is done

    @property
    def done(self) -> bool:
        """Whether the op finished and its outputs are written (or it failed)."""
        return self._done

    @property
    def error(self) -> BaseException | None:
        """The op's error once it failed."""
        return self._error

    def finish(self, timeout: float | None) -> None:
        """Waits for the op, writes list outputs once, completes the future; raises its error.

        Raises:
            CollectiveTimeoutError: ``timeout`` passed first; the op keeps running.
            ShardlineError: the op failed.
        """
        if not self._done:
            deadline = None if timeout is None else time.monotonic() + timeout
            if not self._wait_lock.acquire(timeout=-1 if timeout is None else timeout):
                raise CollectiveTimeoutError(
                    f"Work.wait: the op did not complete within {timeout:.3f} s"
                )
            try:
                if not self._done:
                    self._wait(deadline)
            finally:
                self._wait_lock.release()
            self.notify()
        if self._error is not None:
            raise self._error

    def _wait(self, deadline: float | None) -> None:
        error: BaseException | None = None
        try:
            for w in self._works:
                w.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                self.source = w.source
            if self._after is not None:
                self._after()
        except CollectiveTimeoutError as exc:
            if deadline is not None and not all(w.is_completed() for w in self._works):
                raise  # the caller's timeout, not the op's deadline: the op keeps running
            error = exc
        except Exception as exc:  # any failure is the op's result
            error = exc
        with self._state_lock:
            self._error = error
            self._done = True
            self._works = []  # drop the tensors the engine held
            self._after = None

    def notify(self) -> None:
        """Completes the future, once, if one was handed out and the op is done."""
        with self._state_lock:
            if not self._done or self._future is None or self._notified:
                return
            self._notified = True
            future, error = self._future, self._error
        # Runs the future's callbacks in this thread (see [Note: completion]).
        if error is not None:
            future.set_exception(error)  # type: ignore[arg-type]  # torch's stub is too narrow
        else:
            future.set_result(self.result)

    def future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """The op's future (one per op), completed when the op finishes."""
        with self._state_lock:
            if self._future is not None:
                return self._future
            future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
            self._future = future
            done = self._done
        if done:
            self.notify()
        else:
            _COMPLETER.submit(self)
        return future

    def is_completed(self) -> bool:
        """Whether the op is done; finishes it (list outputs) if the engine is."""
        if self._done:
            return True
        if all(w.is_completed() for w in self._works):
            with contextlib.suppress(Exception):
                self.finish(None)
            return True
        return False


class _Completer:
    """An elastic pool of daemon threads that finish ops whose future was handed out.

    Invariant: every queued op has a thread promised to it that is not running callbacks: an
    idle unpromised thread if there is one (``_free``), else a new thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._free = 0
        self._spawned = 0

    def submit(self, op: _Op) -> None:
        """Queues ``op``; a thread finishes it and completes its future."""
        with self._lock:
            self._queue.put(op)
            if self._free > 0:
                self._free -= 1
                return
            self._spawned += 1
            name = f"shardline-torch-completer-{self._spawned}"
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        promised = True  # a new thread is promised to the op that spawned it
        while True:
            if not promised:
                with self._lock:
                    self._free += 1
            try:
                op = self._queue.get(timeout=_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._free > 0:  # nobody counts on this thread: leave
                        self._free -= 1
                        return
                # Every idle thread, this one included, is promised to an op already queued.
                promised = True
                continue
            promised = False
            with contextlib.suppress(Exception):  # the op's error goes to its future
                op.finish(None)


_COMPLETER = _Completer()


class ShardlineWork(_WorkBase):
    """A ``torch.distributed.Work`` over one or more native ops (see [Note: completion])."""

    def __init__(self, op: _Op) -> None:
        super().__init__()
        self._op = op

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Blocks until the op is done and its outputs are written; returns ``True``.

        Args:
            timeout: Give up after this long; ``None`` or zero (torch's "no timeout") waits up
                to the group's deadline.

        Raises:
            CollectiveTimeoutError: ``timeout`` passed first (the op keeps running).
            ShardlineError: the op failed (``PeerLostError``, ``CollectiveMismatchError``, ...).
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self._op.finish(seconds if seconds is not None and seconds > 0 else None)
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A future of the op's output tensors, completed when the op finishes."""
        return self._op.future()

    def is_completed(self) -> bool:
        """Whether the op finished (successfully or not)."""
        return self._op.is_completed()

    def is_success(self) -> bool:
        """Whether the op finished without error."""
        return self._op.is_completed() and self._op.error is None

    def exception(self) -> BaseException | None:
        """The op's error, if it failed."""
        return self._op.error

    def result(self) -> list[torch.Tensor]:
        """The op's output tensors."""
        return self._op.result

    def _source_rank(self) -> int:
        """The group rank a finished receive took its message from (torch's name)."""
        self._op.finish(None)
        if self._op.source is None:
            raise RuntimeError(
                "_source_rank() is only for the Work of a recv or of a recv from any source"
            )
        return self._op.source
