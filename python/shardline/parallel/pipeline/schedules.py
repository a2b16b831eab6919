"""Pipeline schedules as data: for each rank, the ordered list of actions it runs in one step.

Stages are numbered ``0 .. S-1`` with ``S = p * v`` (``p`` ranks, ``v`` virtual stages per
rank); stage ``s`` lives on rank ``s % p`` (Megatron's interleaving: rank ``r`` holds stages
``r, r + p, ...``). An action is ``F`` (forward of one micro-batch through one stage), ``B``
(its whole backward), or, for zero-bubble schedules, ``I`` (backward to the stage's input
only) and ``W`` (the weight gradients, later). The runtime executes any schedule that
``check`` accepts, so a new schedule is a new function here, not new runtime code.

What the runtime derives from a schedule, and ``check`` verifies by simulation:

- ``F(s, i)`` needs ``F(s - 1, i)``'s output (sent by its rank right after it ran);
- ``B(s, i)``/``I(s, i)`` need ``F(s, i)`` and the gradient from ``B``/``I(s + 1, i)``;
- ``W(s, i)`` needs ``I(s, i)``.
"""

from __future__ import annotations

from shardline.errors import InvalidArgumentError
from shardline.parallel.pipeline.actions import Action, stage_rank
from shardline.parallel.pipeline.simulate import zero_bubble

__all__ = ["SCHEDULES", "SPLIT", "Action", "build", "check", "stage_rank"]


def _gpipe(p: int, m: int, v: int) -> list[list[Action]]:
    # Every forward, then every backward, micro-batches in order (memory: m per stage).
    out = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        fwd = [Action("F", s, i) for i in range(m) for s in stages]
        bwd = [Action("B", s, i) for i in range(m) for s in reversed(stages)]
        out.append(fwd + bwd)
    return out


def _one_f_one_b(p: int, m: int, v: int) -> list[list[Action]]:
    # PipeDream-flush: p - r - 1 warm-up forwards, then one forward / one backward, then the
    # remaining backwards (memory: at most p - r micro-batches in flight on rank r).
    assert v == 1
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [Action("F", r, i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            acts += [Action("F", r, f), Action("B", r, b)]
            f, b = f + 1, b + 1
        acts += [Action("B", r, i) for i in range(b, m)]
        out.append(acts)
    return out


def _interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    # Megatron's interleaved 1F1B: micro-batches go through a rank's v chunks in groups of p;
    # (p - r - 1) * 2 + (v - 1) * p warm-up forwards, then 1F1B, then the cool-down.
    total = m * v

    def chunk_mb(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    out = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts: list[Action] = []
        f = b = 0

        def fwd(k: int, r: int = r) -> Action:
            c, i = chunk_mb(k, True)
            return Action("F", c * p + r, i)

        def bwd(k: int, r: int = r) -> Action:
            c, i = chunk_mb(k, False)
            return Action("B", c * p + r, i)

        while f < warm:
            acts.append(fwd(f))
            f += 1
        while f < total:
            acts += [fwd(f), bwd(b)]
            f, b = f + 1, b + 1
        while b < total:
            acts.append(bwd(b))
            b += 1
        out.append(acts)
    return out


def _zero_bubble(p: int, m: int, v: int) -> list[list[Action]]:
    # ZB-H1 (Qi et al., 2023): each backward split into I (to the input, on the critical path)
    # and W (weights, deferred into what would be bubbles), ordered by list scheduling under
    # the memory 1F1B peaks at (simulate.py says how).
    assert v == 1
    return zero_bubble(p, m)


def _zero_bubble_h2(p: int, m: int, v: int) -> list[list[Action]]:
    # ZB-H2's memory: up to 2p - 1 micro-batches held per rank (GPipe's m at most), room for
    # more forwards ahead where the input pass costs more than a forward (simulate.py).
    assert v == 1
    return zero_bubble(p, m, limit=2 * p - 1)


SCHEDULES = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved": _interleaved,
    "zero_bubble": _zero_bubble,
    "zero_bubble_h2": _zero_bubble_h2,
}
# Schedules whose backward is split into input and weight passes (``I`` and ``W``).
SPLIT = ("zero_bubble", "zero_bubble_h2")


def build(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Every rank's actions for one step of schedule ``name``, checked by ``check``.

    Args:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zero_bubble"`` (ZB-H1) or
            ``"zero_bubble_h2"`` (up to ``2p - 1`` micro-batches held).
        p: Ranks in the pipeline.
        m: Micro-batches per step.
        v: Virtual stages (model chunks) per rank: 1, except for ``"gpipe"`` (any) and
            ``"interleaved"`` (at least 2, with ``m`` a multiple of ``p``).

    Raises:
        InvalidArgumentError: an unknown schedule, or sizes it does not support.
    """
    if name not in SCHEDULES:
        raise InvalidArgumentError(
            f"schedule={name!r} is not a schedule; use one of {', '.join(SCHEDULES)}"
        )
    if p < 1 or m < 1 or v < 1:
        raise InvalidArgumentError(
            f"a pipeline needs at least one rank, micro-batch and stage per rank; got p={p}, "
            f"microbatches={m}, virtual_stages={v}"
        )
    if name in ("1f1b", *SPLIT) and v != 1:
        raise InvalidArgumentError(
            f"schedule={name!r} runs one stage per rank; for virtual_stages={v} use "
            "schedule='interleaved' (or 'gpipe')"
        )
    if name == "interleaved":
        if v < 2:
            raise InvalidArgumentError(
                "schedule='interleaved' needs virtual_stages >= 2 (stages per rank); with one "
                "stage per rank use schedule='1f1b'"
            )
        if m % p:
            raise InvalidArgumentError(
                f"schedule='interleaved' needs microbatches to be a multiple of the pipeline's "
                f"{p} ranks; got microbatches={m}: use {(m // p + 1) * p}"
            )
    actions = SCHEDULES[name](p, m, v)
    check(actions, p, m, v)
    return actions


def check(actions: list[list[Action]], p: int, m: int, v: int = 1) -> None:
    """Verifies that ``actions`` is a schedule that can run.

    Every micro-batch goes through every stage once, on the right ranks, and nothing waits
    for itself: a simulation in which a rank runs its next action as soon as what it needs
    has run somewhere.

    Raises:
        InvalidArgumentError: an action on the wrong rank, a missing or repeated action, or a
            deadlock (named by the actions every rank waits at).
    """
    stages = p * v
    if len(actions) != p:
        raise InvalidArgumentError(f"a schedule for {p} ranks has {len(actions)} action lists")
    split = any(a.kind in ("I", "W") for acts in actions for a in acts)
    kinds = ("F", "I", "W") if split else ("F", "B")
    want = {(k, s, i) for k in kinds for s in range(stages) for i in range(m)}
    seen: set[tuple[str, int, int]] = set()
    for r, acts in enumerate(actions):
        for a in acts:
            if stage_rank(a.stage, p) != r or not 0 <= a.stage < stages or not 0 <= a.mb < m:
                raise InvalidArgumentError(f"schedule: rank {r} cannot run {a!r}")
            key = (a.kind, a.stage, a.mb)
            if key in seen or key not in want:
                raise InvalidArgumentError(f"schedule: {a!r} is repeated or out of place")
            seen.add(key)
    if seen != want:
        missing = sorted(want - seen)[:4]
        raise InvalidArgumentError(f"schedule: actions missing, e.g. {missing}")
    done: set[tuple[str, int, int]] = set()
    back = "I" if split else "B"

    def ready(a: Action) -> bool:
        if a.kind == "F":
            return a.stage == 0 or ("F", a.stage - 1, a.mb) in done
        if a.kind == "W":
            return ("I", a.stage, a.mb) in done
        return ("F", a.stage, a.mb) in done and (
            a.stage == stages - 1 or (back, a.stage + 1, a.mb) in done
        )

    pos = [0] * p
    while any(pos[r] < len(actions[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(actions[r]) and ready(actions[r][pos[r]]):
                a = actions[r][pos[r]]
                done.add((a.kind, a.stage, a.mb))
                pos[r] += 1
                moved = True
        if not moved:
            stuck = {r: actions[r][pos[r]] for r in range(p) if pos[r] < len(actions[r])}
            raise InvalidArgumentError(f"schedule deadlocks: ranks wait at {stuck}")
