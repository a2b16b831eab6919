"""Trial steps: the choices the step model ranks closest, each trained briefly on a copy.

The step model (``timing.predict``) ranks the fitting choices from probes, but not every cost is
in it: the wrappers' own host work per unit, a recompute policy's hooks. ``to_try`` takes the
fastest few it predicts, within 1.6x of its best (2 to 4 of them), the fastest predicted of up
to 3 layouts more within it (tensor-parallel and pipeline degrees and schedules: the model's
errors go by layout more than by choice within one) and a zero-bubble pipeline's 1F1B twin;
fewer where their predicted steps would take more than ``_BUDGET_S``; only those with room for
a whole copy of the model beside them in what a rank has, and ``trial_steps`` trains
each on a deep copy of the model: wrapped as the choice would be (a tensor-parallel or pipeline
choice on its replica's batch, ``tp`` or ``pp`` ranks' batches; a pipeline by its ``step``),
with the optimizer that ``as_distributed`` was told of, three steps to warm up (the optimizer
makes its state) and ten timed, the median kept. The model itself, its gradients and the RNG
state are untouched. Every rank runs the same trials in the same order (they hold collectives);
``as_distributed`` then takes the slowest rank's time of each. Trials read apart from one to the
next, and from the settled steps (one H200 host: zero1 and zero2 tried at 27.6 and 30.2 ms, then
measured at 23.4 and 21.3): ``to_retry`` names the fastest and those within ``_CLOSE`` of it
(at least the two fastest: a trial that read fast by chance is checked against its nearest
rival), which are tried once more in the reverse order, and each keeps the mean of its two
trials.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardline.parallel.layout_meta import widened
from shardline.parallel.pipeline_layout import SCHEDULE
from shardline.parallel.probes import call_args, kept_rng, loss_of, optimizer_class, sync

if TYPE_CHECKING:
    from shardline.parallel.fit import Candidate, StrategyPlan

__all__ = ["to_retry", "to_try", "trial_steps", "tried_steps"]

# Choices predicted within this of the best are tried: where the host limits a GPU step, the
# model's error between choices reached 1.5x (benches/results/plan-grid-*).
_WITHIN = 1.6
_MOST, _FEWEST = 4, 2
# Layouts beyond those of the fastest few, each tried by its fastest predicted choice: on 16
# CPU cores the model put a 4-stage zero-bubble pipeline at 1.31x its fastest plain choice,
# behind 3 ZeRO stages and a tensor-parallel one, where it measured 0.92x
# (benches/results/plan-grid-cpu-16c-4r-small-tp-pp.txt).
_LAYOUTS = 3
# Steps per trial to warm up (the optimizer's state, the allocator, the units' order), then
# timed: with 2 and 3 the trials read well above the settled step on CPU and GPU hosts; with
# 5 timed, trials on an H200 host read 0.85-1.9x the choices' steps in the grid
# (benches/results/plan-grid-cuda-2xh200-medium-bf16-pp-*.txt).
_WARMUP, _STEPS = 3, 10
_BUDGET_S = 30.0  # the trials' predicted seconds (doubled: the model's error) stay under this
# Trials this close to the fastest are tried again (their order could be the trials' noise).
_CLOSE = 1.15


def to_try(plan: StrategyPlan) -> list[Candidate]:
    """The choices to try: fitting, predicted, the fastest few (module docstring).

    The same on every rank once the plan is agreed. Fewer than two: nothing to try.
    """
    shape = plan.shape
    copy_bytes = shape.elements * shape.dtype.itemsize if shape is not None else 0
    timed = sorted(
        (
            c
            for c in plan.candidates
            if c.fits
            and c.offload is None
            and c.time is not None
            # the copy is whole until the wrapper shards it: room for it beside the choice in
            # what the rank has (the headroom is for training; a trial is freed after)
            and c.estimate.total + copy_bytes <= plan.available_bytes
        ),
        key=lambda c: (c.time.total if c.time is not None else 0.0, c.order),
    )
    if len(timed) < _FEWEST:
        return []
    best = timed[0].time.total if timed[0].time is not None else 0.0
    close = [c for c in timed if c.time is not None and c.time.total <= _WITHIN * best]
    picked = (close if len(close) >= _FEWEST else timed[:_FEWEST])[:_MOST]
    fastest: dict[tuple[int, int, str], Candidate] = {}  # of each layout, in predicted order
    for c in close:
        fastest.setdefault(_layout(c), c)
    covered = {_layout(c) for c in picked}
    picked += [c for key, c in fastest.items() if key not in covered][:_LAYOUTS]
    # A zero-bubble (or interleaved) pipeline is tried beside its 1F1B twin: the step model
    # prices its schedule on equal stages, and not zero-bubble's backward in two passes,
    # which measured 1.2-1.8x the twin's step on an H200 host while every stage walked its
    # graph, 0.86-0.94x since its stages' layers defer their weight gradients
    # (benches/results/plan-grid-*-pp*.txt).
    picked += [
        t
        for c in picked
        if c.pp > 1 and c.schedule != SCHEDULE
        for t in timed
        if t not in picked and t.schedule == SCHEDULE and t.order[:4] == c.order[:4]
    ]

    def cost(chosen: list[Candidate]) -> float:
        return sum(2 * (_WARMUP + _STEPS) * (c.time.total if c.time else 0.0) for c in chosen)

    while len(picked) > _FEWEST and cost(picked) > _BUDGET_S:
        picked.pop()
    return picked if cost(picked) <= _BUDGET_S else []


def _layout(c: Candidate) -> tuple[int, int, str]:
    """What ``to_try`` covers: the tensor-parallel and pipeline degrees and the schedule."""
    return (c.tp, c.pp, c.schedule if c.pp > 1 else "")


def to_retry(tried: list[Candidate], seconds: list[float]) -> list[Candidate]:
    """Of ``tried`` (trained for ``seconds`` each, every rank's slowest), those to try again.

    The fastest and those within ``_CLOSE`` of it, and at least the two fastest (a trial
    that read fast by chance is then checked against its nearest rival), in the reverse
    order (a slow start, or a trend over the trials, then falls on the other end): the same
    on every rank, whose ``seconds`` are agreed. None for fewer than two.
    """
    if len(tried) < _FEWEST:
        return []
    ranked = sorted(range(len(tried)), key=lambda i: seconds[i])
    best = seconds[ranked[0]]
    again = {i for i in ranked if seconds[i] <= _CLOSE * best} | set(ranked[:_FEWEST])
    return [tried[i] for i in sorted(again, reverse=True)]


def tried_steps(
    candidates: list[Candidate],
    trial: Callable[[list[Candidate]], list[float]],
    agree: Callable[[list[float]], list[float]],
) -> list[float]:
    """Seconds per step of each candidate: tried, then the close ones again (``to_retry``).

    ``trial(candidates)`` is ``trial_steps`` over them on this rank; ``agree`` turns this
    rank's seconds into every rank's slowest (a collective). Each tried twice keeps the mean.
    """
    seconds = agree(trial(candidates))
    again = to_retry(candidates, seconds)
    if not again:
        return seconds
    second = dict(zip((c.order for c in again), agree(trial(again)), strict=True))
    return [
        (t + second[c.order]) / 2 if c.order in second else t
        for c, t in zip(candidates, seconds, strict=True)
    ]


def trial_steps(
    model: nn.Module,
    example_input: Any,
    candidates: list[Candidate],
    wrap: Callable[[nn.Module, Candidate], nn.Module],
    optimizer: str | torch.optim.Optimizer | None,
) -> list[float]:
    """Seconds per step of each candidate, trained on a copy of ``model`` (module docstring).

    ``wrap(copy, candidate)`` wraps the copy as the candidate would be (recomputation
    applied). Every rank of the group ``wrap`` uses must call this with the same candidates.

    Raises:
        Whatever a trial raises, with the choice it was trying in a note.
    """
    device = next(model.parameters()).device
    cls, hp = optimizer_class(optimizer)
    times = []
    with kept_rng(device):
        for c in candidates:
            # A tp or pp replica trains that many ranks' batches: the same global batch.
            args, kwargs = call_args(widened(example_input, c.batch_scale))
            try:
                times.append(_trial(model, args, kwargs, c, wrap, cls, hp, device))
            except Exception as e:
                e.add_note(
                    f"while as_distributed tried {c.name} for a few steps on a copy of the "
                    "model; pass trials=False to choose by the predicted step alone, or "
                    "timing=False by memory alone"
                )
                raise
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return times


def _trial(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    c: Candidate,
    wrap: Callable[[nn.Module, Candidate], nn.Module],
    cls: type[torch.optim.Optimizer] | None,
    hp: dict[str, Any],
    device: torch.device,
) -> float:
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    wrapped = wrap(twin, c)
    opt = cls(wrapped.parameters(), **hp) if cls is not None else None
    steps = []
    for _ in range(_WARMUP + _STEPS):
        sync(device)
        t0 = time.perf_counter()
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        if c.pp > 1:  # forward and backward of every micro-batch
            wrapped.step(*args, **kwargs)  # type: ignore[operator]
        else:
            loss_of(wrapped(*args, **kwargs)).backward()  # type: ignore[no-untyped-call]
        if opt is not None:
            opt.step()
        sync(device)
        steps.append(time.perf_counter() - t0)
    return statistics.median(steps[_WARMUP:])
