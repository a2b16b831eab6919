"""Schedules timed under a cost model, and zero-bubble schedules built by list scheduling.

``simulate`` runs a schedule (``schedules.Action`` lists, one per rank) on a model of the
machine: each action takes its kind's cost (``cost_of``), messages arrive the moment they
are sent, and a rank starts its next action as soon as what it needs has run. What comes
out (the step's length, each rank's busy time, its bubble) is the theory a measured step is
compared with; for GPipe and 1F1B with ``B = 2 F`` it is the textbook
``(p - 1) / (m + p - 1)``.

``zero_bubble`` builds ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism") the way
the paper's own scheduler does: by simulation. Each rank, when free, runs the input-gradient
pass ``I`` that is ready (it is on the critical path back to the first stage), else the next
forward that is ready and fits the memory limit, else a deferred weight pass ``W`` (which
needs nothing from other ranks, so it fills what would be a bubble). A few rules for how many
``W`` a rank may defer are tried and the shortest simulated step is kept. The memory limit is
``p`` micro-batches in flight (forward run, ``W`` not yet) on every rank: the most 1F1B holds
on its first stage, so the peak over ranks is 1F1B's.

With ``limit=2p - 1`` (ZB-H2's memory, the paper's second schedule) the same scheduler runs
more forwards ahead. Under the unit costs its step is ZB-H1's or shorter (shorter for 46 of
the 280 sizes up to 8 ranks and 4p micro-batches, by one unit). Where an input pass costs
more than a forward and a backward less than two (small CPU stages measured ``I`` 1.15 ``F``,
``W`` 0.7 ``F``, ``B`` 1.67 ``F``), the weight passes ZB-H1 holds back no longer cover the
gaps, and the room for more forwards does: at 4 ranks and 8 micro-batches, under those
costs, 1F1B's step is 1.02x ZB-H1's and 1.14x ZB-H2's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from shardline.parallel.pipeline.actions import Action

__all__ = ["UNIT", "Timing", "cost_of", "simulate", "zero_bubble"]

# Forward 1, whole backward 2, split into an input pass and a weight pass of 1 each: the
# costs the schedules' papers analyse with (a backward does about twice a forward's work).
UNIT: Mapping[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def cost_of(a: Action, cost: Mapping[str, float] = UNIT) -> float:
    """What ``a`` costs under ``cost``.

    The first stage has no input gradient to compute: its ``I`` is free and its ``W`` is the
    whole backward.
    """
    if a.stage == 0 and a.kind in ("I", "W"):
        return 0.0 if a.kind == "I" else cost["I"] + cost["W"]
    return cost[a.kind]


@dataclass(frozen=True)
class Timing:
    """A schedule's simulated step: its length and what each rank computed in it."""

    makespan: float
    busy: list[float]  # per rank

    @property
    def bubble(self) -> float:
        """The share of the step the ranks spend idle, over all ranks."""
        total = self.makespan * len(self.busy)
        return (total - sum(self.busy)) / total if total else 0.0


def _needs(a: Action, stages: int, split: bool) -> tuple[str, int, int] | None:
    """The action on another stage that ``a`` waits for, if any."""
    if a.kind == "F":
        return ("F", a.stage - 1, a.mb) if a.stage > 0 else None
    if a.kind in ("B", "I") and a.stage < stages - 1:
        return ("I" if split else "B", a.stage + 1, a.mb)
    return None


def simulate(
    actions: list[list[Action]],
    p: int,
    v: int = 1,
    cost: Mapping[str, float] | Callable[[Action], float] = UNIT,
) -> Timing:
    """The step ``actions`` takes under ``cost``.

    ``cost`` is per action kind (``cost_of``), or a function of the action (each stage's own
    measured times, say). The schedule must be one ``schedules.check`` accepts (it cannot deadlock).
    """
    took = cost if callable(cost) else lambda a: cost_of(a, cost)
    stages = p * v
    split = any(a.kind == "I" for acts in actions for a in acts)
    end: dict[tuple[str, int, int], float] = {}
    clock, busy, pos = [0.0] * p, [0.0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                need = _needs(a, stages, split)
                if need is not None and need not in end:
                    break
                start = max(clock[r], end[need] if need is not None else 0.0)
                spent = took(a)
                clock[r] = start + spent
                busy[r] += spent
                end[(a.kind, a.stage, a.mb)] = clock[r]
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(actions[r]) for r in range(p)), "simulate: the schedule deadlocks"
    return Timing(max(clock), busy)


def _list_schedule(
    p: int,
    m: int,
    defer: Callable[[int], int],
    feed: bool,
    cost: Mapping[str, float],
    limit: int,
) -> list[list[Action]]:
    """Zero-bubble by list scheduling: ``defer(r)`` weight passes back at most on rank ``r``.

    No rank holds more than ``limit`` micro-batches (forward run, weight pass not yet).

    With ``feed``, the first half of the ranks put a ready forward before a ready input pass
    (feeding the later stages sooner).
    """
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * p
    nf, ni, nw = [0] * p, [0] * p, [0] * p  # forwards, input and weight passes run so far
    out: list[list[Action]] = [[] for _ in range(p)]

    def choose(r: int, now: float) -> str | None:
        def arrived(key: tuple[str, int, int]) -> bool:
            return key in done and done[key] <= now

        backward = ni[r] < nf[r] and (r == p - 1 or arrived(("I", r + 1, ni[r])))
        fits = nf[r] < m and nf[r] - nw[r] < limit
        forward = fits and (r == 0 or arrived(("F", r - 1, nf[r])))
        if nw[r] < ni[r] and ni[r] - nw[r] >= defer(r):
            return "W"
        if forward and ((feed and 2 * r < p) or not backward):
            return "F"
        if backward:
            return "I"
        return "W" if nw[r] < ni[r] else None

    while any(nw[r] < m for r in range(p)):
        now = min(clock[r] for r in range(p) if nw[r] < m)
        ran = False
        for r in range(p):
            if nw[r] >= m or clock[r] != now:
                continue
            kind = choose(r, now)
            if kind is None:
                continue
            count = {"F": nf, "I": ni, "W": nw}[kind]
            action = Action(kind, r, count[r])  # type: ignore[arg-type]
            out[r].append(action)
            clock[r] = now + cost_of(action, cost)
            done[(kind, r, count[r])] = clock[r]
            count[r] += 1
            ran = True
            break  # what it sends may change what the others choose at this time
        if not ran:  # every rank free now waits: on to the next moment something lands
            later = [t for t in done.values() if t > now]
            later += [clock[r] for r in range(p) if nw[r] < m and clock[r] > now]
            assert later, "zero_bubble: list scheduling stalled"
            step = min(later)
            for r in range(p):
                if nw[r] < m and clock[r] == now:
                    clock[r] = step
    return out


def zero_bubble(
    p: int, m: int, cost: Mapping[str, float] = UNIT, limit: int | None = None
) -> list[list[Action]]:
    """Zero-bubble for ``p`` ranks and ``m`` micro-batches: the best rule under ``cost``.

    The rules are a few ways of deferring weight passes; the shortest simulated step wins.

    ``limit`` is the most micro-batches a rank holds (forward run, weight pass not yet):
    ``None`` is ``p``, 1F1B's peak (ZB-H1); ``2 * p - 1`` is ZB-H2's.
    """
    held = p if limit is None else limit
    rules: list[Callable[[int], int]] = [
        lambda r: p - 1,
        lambda r: m,  # defer as long as memory allows
        lambda r: r + 1,
        lambda r: 2,
        lambda r: max(1, p - r - 1),
        lambda r: 1,
    ]
    best: tuple[float, list[list[Action]]] | None = None
    for rule in rules:
        for feed in (False, True):
            actions = _list_schedule(p, m, rule, feed, cost, held)
            took = simulate(actions, p, cost=cost).makespan
            if best is None or took < best[0]:
                best = (took, actions)
    assert best is not None
    return best[1]
