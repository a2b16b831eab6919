"""``Deferred``: the handle of an op that another library runs (torch's gloo or NCCL, MPI).

The native engine returns its own ``Work``; the backends over other libraries return a
``Deferred`` over what that library hands back (torch ``Work``s, MPI requests), parametrised
by what each needs: how to wait for those and test them, what to run once the op succeeded
(divide for avg, copy a padded or widened result out), which library errors to translate,
and which buffers to keep alive meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

from shardline.errors import ShardlineError

__all__ = [
    "DONE",
    "Deferred",
    "EventWaits",
    "TracedDeferred",
    "torch_works_completed",
    "wait_torch_works",
]


def wait_torch_works(works: Sequence[Any], timeout: float | None) -> None:
    """Waits for each torch ``Work`` of ``works``, ``timeout`` seconds each (``None``: theirs)."""
    for w in works:
        if timeout is None:
            w.wait()
        else:
            w.wait(timedelta(seconds=timeout))


def torch_works_completed(works: Sequence[Any]) -> bool:
    """Whether every torch ``Work`` of ``works`` finished."""
    return all(w.is_completed() for w in works)


class Deferred:
    """An op in flight in another library; a ``Handle`` (see ``shardline.comm.work``).

    ``wait`` waits for ``works``, lets go of them (torch's ``Work``s hold their tensors, so a
    caller that keeps the handle does not keep freed memory alive), runs ``after`` once, and
    drops ``keep``. A failed wait raises (through ``translate``) and may be retried.

    Args:
        works: What the library returned for the op (torch ``Work``s, MPI requests); none for
            an op that is already done, or that ``after`` finishes itself.
        wait: ``wait(works, timeout)`` blocks until ``works`` are done, ``timeout`` seconds
            (``None``: the library's own deadline); torch ``Work.wait`` by default.
        test: ``test(works)`` says whether they are done, without waiting; torch
            ``Work.is_completed`` by default.
        after: Runs once, on the first ``wait`` that succeeds.
        translate: Turns a ``RuntimeError`` the library raised while waiting into a
            ``ShardlineError`` (our own errors pass through); ``None`` lets it through.
        keep: Buffers the library reads or writes, kept alive until the op was waited for.
        source: For a receive, ``source(works)`` gives the rank its message came from, read
            once the op is done.

    ``timing`` is the op's ``shardline.comm.trace.device.OpTiming`` where a backend times it
    on its GPU for a tracer, else ``None``.
    """

    __slots__ = (
        "_after", "_keep", "_source", "_test", "_translate", "_wait", "_works", "source", "timing",
    )  # fmt: skip

    def __init__(
        self,
        works: Sequence[Any] = (),
        *,
        wait: Callable[[Sequence[Any], float | None], None] = wait_torch_works,
        test: Callable[[Sequence[Any]], bool] = torch_works_completed,
        after: Callable[[], None] | None = None,
        translate: Callable[[RuntimeError], ShardlineError] | None = None,
        keep: tuple[object, ...] = (),
        source: Callable[[Sequence[Any]], int] | None = None,
    ) -> None:
        self._works: Sequence[Any] | None = works
        self._source = source
        self.source: int | None = None
        self._wait = wait
        self._test = test
        self._after = after
        self._translate = translate
        self._keep: tuple[object, ...] | None = keep
        # The op's timing on its GPU, set by a backend while a tracer listens.
        self.timing: Any = None

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the op is done and ``after`` ran; raises the op's error."""
        works = self._works
        if works:
            try:
                self._wait(works, timeout)
            except ShardlineError:
                raise
            except RuntimeError as exc:
                if self._translate is None:
                    raise
                raise self._translate(exc) from exc
            if self._source is not None:
                self.source = self._source(works)
        self._works = None
        if self._after is not None:
            after, self._after = self._after, None
            after()
        self._keep = None

    def is_completed(self) -> bool:
        """Whether the op finished (successfully or not)."""
        works = self._works
        return not works or self._test(works)


class EventWaits(NamedTuple):
    """How a ``TracedDeferred`` waits for its works, tests them, and lets go of them."""

    wait: Callable[[Sequence[Any], float | None], None]
    test: Callable[[Sequence[Any]], bool]
    done: Callable[[Sequence[Any]], None]


class TracedDeferred(Deferred):
    """The handle of an op a tracer ran on its group's own stream (``comm.trace.device``).

    Torch keeps none of such an op's buffers alive (it ran as a blocking op there): ``keep``
    holds them until the wait, as for any handle, and a handle dropped before its wait leaves
    them in its ``timing.keep``, which the tracer holds until the GPU is past the op. Its
    works are waited for and tested by ``waits``, and let go of by ``waits.done(works)``
    once: after its wait, or when dropped.

    Made on every traced op's path: its fields are set here directly (``Deferred``'s
    keywords would cost as much again).
    """

    __slots__ = ("_done",)

    def __init__(
        self,
        works: Sequence[Any],
        timing: Any,
        after: Callable[[], None] | None,
        translate: Callable[[RuntimeError], ShardlineError] | None,
        keep: tuple[object, ...],
        waits: EventWaits,
    ) -> None:
        self._works: Sequence[Any] | None = works
        self.timing = timing
        self._after = after
        self._translate = translate
        self._keep: tuple[object, ...] | None = keep
        self._wait, self._test, self._done = waits
        self._source = None
        self.source = None

    def wait(self, timeout: float | None = None) -> None:
        """As ``Deferred.wait``; then lets go of its works."""
        works = self._works
        super().wait(timeout)
        self._release(works)

    def _release(self, works: Sequence[Any] | None) -> None:
        # Once: a waited handle's works are None (``Deferred.wait``), as are a dropped one's.
        if works:
            self._done(works)

    def __del__(self) -> None:
        keep, timing = self._keep, self.timing
        if keep is not None and timing is not None:  # dropped before its wait
            timing.keep.append(keep)
        self._release(self._works)


DONE = Deferred()
"""The handle of an op that a blocking call already waited for."""
