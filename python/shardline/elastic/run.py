"""``shardline.elastic.run``: the training function, re-entered after a membership change.

::

    state = sl.elastic.State(model=model, optimizer=opt, sampler=sampler, step=0)

    @sl.elastic.run(on_change=lambda old, new: print(f"{old} -> {new} ranks"))
    def train(state):
        while state.step < steps:
            ...
            state.step += 1
            state.commit()

    train(state)

When a rank is lost (``PeerLostError``, or ``CommunicatorClosedError`` from a group a loss
made unusable) or a node joins (``MembershipChanged``, raised by
``State.commit`` on every rank at the same step), the survivors leave the function, re-form
the default group for the next generation (``world.reform``), move the model's strategy and
the sampler onto it (``contract.regroup``), restore the newest complete commit resharded to
the new size (``State._rejoin``), call ``on_change(old_size, new_size)`` and enter the function
again. A replacement or a new process runs the script from the top: its ``shardline.init()``
joins the new generation, its ``distribute()`` runs no collective of its own, and its first
call of the decorated function takes part in the same restore before it enters. One script
serves both.

Outside an elastic job (``shardline run --nnodes MIN:MAX``) the function runs once, as is,
and errors propagate.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar, overload

from shardline.comm import world
from shardline.elastic import job
from shardline.elastic import state as _state
from shardline.elastic.state import State
from shardline.errors import (
    CommunicatorClosedError,
    InvalidArgumentError,
    MembershipChanged,
    PeerLostError,
)

__all__ = ["run"]

_log = logging.getLogger("shardline")
R = TypeVar("R")
OnChange = Callable[[int, int], Any]


@overload
def run(fn: Callable[..., R], *, on_change: OnChange | None = None) -> Callable[..., R]: ...
@overload
def run(
    fn: None = None, *, on_change: OnChange | None = None
) -> Callable[[Callable[..., R]], Callable[..., R]]: ...


def run(fn: Any = None, *, on_change: OnChange | None = None) -> Any:
    """Decorates a training function ``fn(state, ...)`` to survive membership changes.

    Args:
        fn: The training function; its first argument is the ``elastic.State``.
        on_change: Called as ``on_change(old_world_size, new_world_size)`` after each change,
            once the state is restored and before the function is entered again (on every
            rank, newcomers included).

    Returns:
        The decorated function; it returns what ``fn`` returns.
    """

    def decorate(train: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(train)
        def runner(state: State, *args: Any, **kwargs: Any) -> R:
            if not isinstance(state, State):
                raise InvalidArgumentError(
                    f"shardline.elastic.run: {train.__name__}'s first argument must be an "
                    f"elastic.State, not {type(state).__name__}"
                )
            rejoin = job.joined_running_job()  # a newcomer restores with the survivors
            reform = False
            _state._runs += 1  # State.commit's MembershipChanged then gives no advice
            try:
                while True:
                    try:
                        if rejoin:
                            _change(state, reform, on_change)
                            rejoin = reform = False
                        result = train(state, *args, **kwargs)
                        job.mark("finished")  # no new generation now; joiners leave
                        return result
                    except (PeerLostError, CommunicatorClosedError, MembershipChanged) as exc:
                        if world.elastic_generation() is None:
                            raise
                        _log.warning("elastic: %s; re-forming the group", exc)
                        rejoin = reform = True
            finally:
                _state._runs -= 1

        return runner

    return decorate(fn) if fn is not None else decorate


def _change(state: State, reform: bool, on_change: OnChange | None) -> None:
    """Re-forms the group (survivors), restores the state on it, and tells the user."""
    start = time.perf_counter()
    if reform:
        group = world.reform()
        state._move_to(group)
    else:
        group = world.default_group()
    gen = world.elastic_generation()
    assert gen is not None
    state._rejoin(group)
    job.settled()
    _log.warning(
        "elastic: generation %d: %d -> %d ranks, state of commit #%d restored (%s) in %.2f s",
        gen.number, gen.previous_size, gen.world_size, state.commits, state.restored_from,
        time.perf_counter() - start,
    )  # fmt: skip
    if on_change is not None:
        on_change(gen.previous_size, gen.world_size)
