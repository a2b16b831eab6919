"""What an elastic job has done so far, kept in its store: trained, finished, who joined late.

``trained`` is set by the first commit, ``finished`` when the training function returns (no
new generation starts then). A process whose first generation comes after ``trained`` joined
a running job: its wrappers skip their start-up collectives (this module tells
``parallel.joining``) and its first ``elastic.run`` restores with the survivors; after that
restore (``settled``) it is an ordinary member.
"""

from __future__ import annotations

from shardline.comm import world
from shardline.comm.rendezvous import membership
from shardline.parallel import joining

__all__ = ["joined_running_job", "mark", "settled"]

_late: bool | None = None  # decided on first ask, in the generation this process joined


def joined_running_job() -> bool:
    """Whether this process joined an elastic job after its first commit and has not restored.

    The answer is read once from the store (nothing commits between a newcomer's ``init`` and
    its restore: every commit is collective over the generation it joined).
    """
    global _late  # noqa: PLW0603
    if _late is None:
        gen, store = world.elastic_generation(), world.elastic_store()
        if gen is None or store is None:
            return False
        _late = gen.number > 1 and membership.marked(store, "trained")
    return _late


def mark(what: str) -> None:
    """In an elastic job, sets the job-wide flag ``what`` (``"trained"``, ``"finished"``)."""
    store = world.elastic_store()
    if store is not None:
        membership.mark(store, what)


def settled() -> None:
    """This process has taken part in a restore: later ``distribute`` calls sync as usual."""
    global _late  # noqa: PLW0603
    _late = False


joining.tell(joined_running_job)
