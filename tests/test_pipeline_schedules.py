"""Schedules as data, timed by simulation: the textbook bubbles, and zero-bubble's."""

from __future__ import annotations

import pytest

from shardline.parallel.pipeline.schedules import Action, build
from shardline.parallel.pipeline.simulate import UNIT, simulate

SIZES = [(p, m) for p in range(2, 9) for m in range(1, 4 * p + 1)]


def in_flight(acts: list[Action]) -> int:
    """The most micro-batches a rank holds at once: forward run, last backward pass not yet."""
    last = "W" if any(a.kind == "W" for a in acts) else "B"
    held = peak = 0
    for a in acts:
        held += a.kind == "F"
        held -= a.kind == last
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulated_bubble_is_the_textbook_one(name: str) -> None:
    for p, m in SIZES:
        timing = simulate(build(name, p, m), p)
        assert timing.bubble == pytest.approx((p - 1) / (m + p - 1)), (p, m)
        assert timing.busy == [m * (UNIT["F"] + UNIT["B"])] * p


def test_zero_bubble_halves_1f1b_bubble_at_1f1b_memory() -> None:
    """ZB-H1: from m = p on, ranks idle at most half as long as under 1F1B, never longer at
    any m, and no rank holds more micro-batches than 1F1B's first stage (min(p, m))."""
    for p, m in SIZES:
        zb, one = build("zero_bubble", p, m), build("1f1b", p, m)
        work = m * (UNIT["F"] + UNIT["B"])
        idle_zb = simulate(zb, p).makespan - work
        idle_one = simulate(one, p).makespan - work
        assert idle_zb <= idle_one, (p, m)
        if m >= p:
            assert idle_zb <= 0.5 * idle_one, (p, m, idle_zb, idle_one)
        assert max(map(in_flight, zb)) <= max(map(in_flight, one)) == min(p, m), (p, m)


def test_zero_bubble_is_deterministic() -> None:
    """Every rank builds the schedule itself: the same arguments give the same actions."""
    assert build("zero_bubble", 4, 8) == build("zero_bubble", 4, 8)
