"""Schedules as data, timed by simulation (the textbook bubbles, and zero-bubble's), and
stages balanced by FLOPs."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.parallel.pipeline.schedules import Action, build
from shardline.parallel.pipeline.simulate import UNIT, simulate
from shardline.parallel.pipeline.split import balanced_parts, child_costs
from tests._ranks import run_ranks

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


# Costs measured on small CPU stages (4 x 64 tokens, width 128, one thread): the input pass
# 1.15 forwards, the weight pass 0.7, the whole backward 1.67 (not the 1 + 1 = 2 of UNIT).
CPU = {"F": 3.0, "B": 5.0, "I": 3.45, "W": 2.1}


def test_zero_bubble_h2_takes_2p_minus_1_micro_batches_for_a_shorter_step() -> None:
    """ZB-H2: no rank holds more than 2p - 1 micro-batches (nor m). Its step is never longer
    than ZB-H1's, under the unit costs or CPU's; under CPU's it is shorter than ZB-H1's
    for every m > p and than 1F1B's for every m >= p (where ZB-H1 can be longer)."""
    h1_longer = 0
    for p, m in SIZES:
        h2, h1, one = (build(n, p, m) for n in ("zero_bubble_h2", "zero_bubble", "1f1b"))
        assert max(map(in_flight, h2)) <= min(2 * p - 1, m), (p, m)
        for cost in (UNIT, CPU):
            assert simulate(h2, p, cost=cost).makespan <= simulate(h1, p, cost=cost).makespan
        t2, t1, t0 = (simulate(a, p, cost=CPU).makespan for a in (h2, h1, one))
        if m > p:
            assert t2 < t1, (p, m)
        if m >= p:
            assert t2 < t0, (p, m, t2, t0)
            h1_longer += t1 > t0
    assert h1_longer > 0  # the case it is for: ZB-H1 slower than 1F1B under these costs


def test_auto_split_balances_by_flops_given_an_example() -> None:
    """An embedding holds most parameters and computes almost nothing: by parameter count it
    would be a stage alone; by FLOPs on an example it shares a stage with two linears. The
    pipeline cuts there on every rank (FLOPs come from shapes, the same everywhere)."""

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        layers = [("embed", nn.Embedding(10_000, 16))]
        layers += [(f"l{i}", nn.Linear(16, 16)) for i in range(1, 5)]
        return nn.Sequential(OrderedDict(layers))

    ids = torch.randint(0, 10_000, (64, 32))
    children = list(model().named_children())
    assert balanced_parts(children, 2) == [["embed"], ["l1", "l2", "l3", "l4"]]
    costs = child_costs(children, ids)
    assert balanced_parts(children, 2, costs) == [["embed", "l1", "l2"], ["l3", "l4"]]
    with torch.device("meta"):  # a meta model is costed from shapes alone
        assert child_costs(list(model().named_children()), ids) == costs

    held = run_ranks(
        2, lambda g: sorted(dict(sl.pipeline(model(), g, example=ids[:16]).named_children()))
    )
    assert held == [["embed", "l1", "l2"], ["l3", "l4"]]
