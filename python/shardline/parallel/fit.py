"""Which strategy fits, and which of those is fastest.

``plan_strategy`` prices every strategy, least to most sharded (``strategies.BY_MEMORY``),
then (given an example input) the same with the blocks recomputing their activations, then
on CUDA zero3 with its offloads, with the estimates of ``planner``, and chooses the first
whose total fits ``headroom`` of what ``available_memory`` measures; its ``StrategyPlan``
shows what it priced (``explain()``). ``StrategyPlan.timed`` predicts each fitting choice's
step from probes (``timing``) and chooses the fastest, ``agreed`` takes every rank's
verdicts and ``tried`` the trial steps (``trials``). ``choose_strategy`` gives the
memory-only choice alone; ``as_distributed`` runs the whole plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from shardline.errors import InvalidArgumentError
from shardline.parallel import strategies
from shardline.parallel.candidate import CHOICES, Candidate
from shardline.parallel.choice_step import choice_dtype, predicted_step
from shardline.parallel.data.zero.grouping import default_unit_mb, default_units
from shardline.parallel.layout_meta import widened
from shardline.parallel.memory_available import available_memory, default_device
from shardline.parallel.pipeline_layout import (
    SCHEDULE,
    SCHEDULES,
    PipelineLayout,
    WithLoss,
    pipeline_layouts,
    with_loss,
)
from shardline.parallel.planner import (
    MemoryEstimate,
    _activations_or_note,
    _check_world_size,
    _effective_precision,
    _estimate,
    format_bytes,
    optimizer_states,
    step_lists,
)
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.recompute.blocks import find_blocks, recomputing_blocks
from shardline.parallel.tensor_layout import TensorLayout, priced_layouts
from shardline.parallel.timing import (
    ModelShape,
    Probes,
    StepTime,
)

# A pipeline's schedules on one stage per rank, then 1F1B with each stage recomputing its
# forward in backward (``sl.pipeline(recompute=True)``: a micro-batch keeps only the stage's
# input and output); interleaved 1F1B on its own cut (``PipelineLayout.virtual``).
_PIPELINE_CHOICES: tuple[tuple[str, str | None], ...] = (
    *((schedule, None) for schedule in SCHEDULES if schedule != "interleaved"),
    (SCHEDULE, "full"),
)
_INTERLEAVED: tuple[tuple[str, str | None], ...] = (("interleaved", None),)

__all__ = [
    "CHOICES",
    "Candidate",
    "StrategyPlan",
    "available_memory",
    "choose_strategy",
    "plan_strategy",
]


@dataclass(frozen=True)
class StrategyPlan:
    """Every strategy priced for one rank, and the one chosen (``plan_strategy``).

    Attributes:
        candidates: In the order of ``CHOICES``: least to most sharded, then again with
            recomputation (when priced), then zero3's offloads (on CUDA).
        choice: The first that fits (the fastest tried or predicted, once timed); zero3
            when none does.
        reason: One line saying why, as ``as_distributed`` prints it.
        budget: Bytes per rank a strategy may use: ``headroom`` of ``available_bytes``.
        available_bytes: What one rank may use (measured, unless given).
        host_budget: Host bytes per rank the offloads may use (0 off CUDA).
        shape, world_size, mixed_precision, headroom, example_given: what it was priced for.
        probes: What ``timed`` predicted the step times from; ``None`` until then.
        layouts: The tensor-parallel layouts priced (``tensor_layout``), by ``tp`` size.
        pipelines: This rank's stage of each pipeline priced (``pipeline_layouts``).
        notes: Why a layout was not priced (a model ``tensor_parallel`` cannot split).
    """

    candidates: tuple[Candidate, ...]
    choice: Candidate
    reason: str
    budget: float
    available_bytes: int
    host_budget: float = 0.0
    shape: ModelShape | None = None
    world_size: int = 1
    mixed_precision: MixedPrecision | None = None
    headroom: float = 0.7
    example_given: bool = False
    probes: Probes | None = None
    layouts: tuple[TensorLayout, ...] = ()
    notes: tuple[str, ...] = ()
    pipelines: tuple[PipelineLayout, ...] = ()

    def to_time(self) -> list[tuple[str | None, torch.dtype | None]]:
        """The ``(recompute, compute dtype)`` pairs whose compute the fitting choices need.

        Only those whose probe fits the budget: the parameters (and under mixed precision
        their low-precision copies), one batch's activations and what recomputation makes
        again (the probe drops each gradient as it is made).
        """
        shape = self.shape
        assert shape is not None
        keys: dict[tuple[str | None, torch.dtype | None], None] = {}
        for c in self.candidates:
            if not c.fits or c.offload is not None:
                continue
            dtype = self._dtype(c)
            e = c.estimate
            probe = (
                shape.elements * (shape.dtype.itemsize + (dtype.itemsize if dtype else 0))
                + e.activations
                + e.recomputed
            )
            if probe <= self.budget:  # a pipeline's recomputation is priced from the plain probe
                keys[(c.recompute if c.pp == 1 else None, dtype)] = None
        return list(keys)

    def timed(self, probes: Probes) -> StrategyPlan:
        """This plan with every choice's step predicted from ``probes``.

        The fastest that fits is chosen (within 2 % of it, the least sharded). The offloads
        stay untimed: they are chosen only when nothing else fits.
        """
        return self._rechosen(
            [
                c if c.offload is not None else replace(c, time=self._predict(c, probes))
                for c in self.candidates
            ],
            probes,
        )

    def _dtype(self, c: Candidate) -> torch.dtype | None:
        """The low-precision dtype ``c`` computes in (a pipeline autocasts under any strategy)."""
        assert self.shape is not None
        return choice_dtype(c, self.shape, self.mixed_precision)

    def _predict(self, c: Candidate, probes: Probes) -> StepTime | None:
        assert self.shape is not None
        return predicted_step(
            c, probes, self.shape, self.world_size, self.mixed_precision, self.layouts,
            self.pipelines,
        )  # fmt: skip

    def agreed(self, totals: list[float], fits: list[bool]) -> StrategyPlan:
        """This plan with every rank's verdicts, chosen again.

        ``totals``: the slowest rank's step per candidate (``inf`` where one is untimed);
        ``fits``: whether it fits on every rank.
        """
        return self._rechosen(
            [
                replace(
                    c,
                    fits=ok,
                    time=None if c.time is None or math.isinf(t) else replace(c.time, slowest=t),
                )
                for c, t, ok in zip(self.candidates, totals, fits, strict=True)
            ],
            self.probes,
        )

    def tried(self, tried: list[Candidate], seconds: list[float]) -> StrategyPlan:
        """This plan with the trial steps of ``tried`` (the slowest rank's), chosen again.

        The fastest tried is chosen (within 2 % of it, the least sharded).
        """
        measured = {c.order: t for c, t in zip(tried, seconds, strict=True)}
        return self._rechosen(
            [
                replace(c, time=replace(c.time, trial=measured[c.order]))
                if c.order in measured and c.time is not None
                else c
                for c in self.candidates
            ],
            self.probes,
        )

    def _rechosen(self, candidates: list[Candidate], probes: Probes | None) -> StrategyPlan:
        choice, reason = _choose(
            candidates, self.budget, self.available_bytes, self.headroom, self.example_given
        )
        return replace(
            self, candidates=tuple(candidates), choice=choice, reason=reason, probes=probes
        )

    def explain(self) -> str:
        """A table of the candidates: bytes per rank by component, whether each fits."""
        width = max(len(c.name) for c in self.candidates) + 2
        timed = self.probes is not None
        head = (
            f"{'strategy':<{width}}{'params':>10}{'grads':>10}{'master':>10}{'optimizer':>11}"
            f"{'buffers':>10}{'activations':>13}{'recomputed':>12}{'scratch':>10}{'total':>10}"
            f"{'host':>10}" + (f"{'step':>10}{'trial':>10}" if timed else "") + "  fits"
        )
        rows = [head]
        for c in self.candidates:
            e = c.estimate
            buffers = e.comm_buffers + e.regather
            cells = (e.params, e.grads, e.master, e.optimizer, buffers, e.activations,
                     e.recomputed, e.step_scratch, e.total, e.host)  # fmt: skip
            widths = (10, 10, 10, 11, 10, 13, 12, 10, 10, 10)
            row = f"{c.name:<{width}}" + "".join(
                f"{format_bytes(v):>{w}}" for v, w in zip(cells, widths, strict=True)
            )
            if timed:
                t = c.time
                row += f"{_ms(t.total) if t is not None else '-':>10}"
                row += f"{_ms(t.trial) if t is not None and t.trial is not None else '-':>10}"
            verdict = "yes" if c.fits else f"no (over by {format_bytes(e.total - self.budget)})"
            if not c.fits and e.total <= self.budget:  # the host part is what does not fit
                verdict = f"no (host over by {format_bytes(e.host - self.host_budget)})"
            rows.append(f"{row}  {verdict}{'  <- chosen' if c is self.choice else ''}")
        acts = self.choice.estimate.activations_estimated
        rows.append(
            "total: the largest of backward's peak (ZeRO-2/3's gradients in place of the "
            "activations backward frees), the optimizer step's (every gradient, its scratch) "
            "and the forward's start (ZeRO-1/2's re-gather buffers, freed before the "
            "activations grow)"
        )
        rows.append(
            f"budget per rank: {format_bytes(self.budget)} of {format_bytes(self.available_bytes)}"
            " available"
            + (f"; host: {format_bytes(self.host_budget)}" if self.host_budget else "")
            + ("" if acts else "; activations not counted (pass example_input)")
        )
        t, p = self.choice.time, self.probes
        if t is not None and p is not None:
            rows.append(
                f"step of {self.choice.name} on this rank: compute {_ms(t.compute)}, "
                f"communication {_ms(t.comm)}, waiting beyond compute {_ms(t.exposed)}, "
                f"optimizer {_ms(t.optimizer)}"
                + (
                    f"; link {p.link.latency * 1e6:.0f} us + {p.link.bandwidth / 1e9:.2f} GB/s"
                    if p.link is not None
                    else ""
                )
                + f"; probes took {p.seconds:.1f} s"
            )
        if p is not None:
            rows.extend(p.notes)
        rows.extend(self.notes)
        rows.append(f"chosen: {self.reason}")
        return "\n".join(rows)


def plan_strategy(
    model: nn.Module,
    *,
    world_size: int,
    available_bytes: int | None = None,
    optimizer: str | torch.optim.Optimizer | None = "adamw",
    mixed_precision: MixedPrecision | None = None,
    example_input: Any = None,
    headroom: float = 0.7,
    unit_mb: float | None = None,
    prefetch: int = 1,
    device: torch.device | str | int | None = None,
    tensor_parallel: bool = False,
    local_ranks: int | None = None,
    pipeline: bool = False,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    rank: int = 0,
) -> StrategyPlan:
    """Every strategy priced for one rank, and the least sharded one that fits.

    Prices ``ddp``, ``zero1``, ``zero2`` and ``zero3``; with ``example_input`` and a model
    whose repeated blocks can recompute (``recompute_blocks``), the same four again with
    ``recompute="selective"`` and ``"full"``; on CUDA zero3 with ``offload="optimizer"`` and
    ``"cpu"`` (whose host part must fit ``headroom`` of the host memory too). It chooses the
    first that fits, in that order (``CHOICES``): sharding before recomputing, recomputing
    before offloading. With ``tensor_parallel``, after the recomputing choices come the
    layouts that split each replica's layers over ``tp`` ranks of a host (2, 4, ...:
    ``tensor_layout``), the four strategies keeping the ``N / tp`` replicas (with one, the
    ZeRO stages still give ``mixed_precision``'s compute, which DDP does not), priced on
    ``tp`` ranks' batches (the same global batch). With ``pipeline`` (an ``nn.Sequential``
    and its ``loss_fn``; ``example_input`` is then ``(inputs, target)``), after them come
    1F1B and zero-bubble pipelines over ``pp`` = 2, 4, ... ranks with ``pp``, ``2 pp`` and ``4 pp``
    micro-batches, 1F1B with each stage recomputing its forward, and interleaved 1F1B with
    ``VIRTUAL`` stages per rank, DDP or ZeRO over the ``N / pp`` replicas
    (``pipeline_layouts``: this rank's stage); with both, also those pipelines with each
    stage split over ``tp`` ranks (a mesh ``{"dp", "pp", "tp"}``, ``N / (pp tp)``
    replicas). When none fits, the choice is ``zero3``, with a reason that
    says by how much it is short.

    Args:
        model: The plain model.
        world_size: Ranks (N).
        available_bytes: Bytes one rank may use; ``available_memory(device)`` when ``None``.
        optimizer: As for ``estimate_memory``.
        mixed_precision: As for ``estimate_memory`` (ddp is estimated without it).
        example_input: As for ``estimate_memory``; activations count towards the total.
        headroom: Fraction of ``available_bytes`` a strategy may use, in (0, 1].
        unit_mb: As for ``estimate_memory``.
        prefetch: As for ``estimate_memory``.
        device: Where ``available_memory`` looks; the model's CUDA device, else the current
            CUDA device, else the CPU.
        tensor_parallel: Price tensor-parallel layouts too.
        local_ranks: Ranks per host, which a tensor-parallel group stays within;
            ``world_size`` when ``None``.
        pipeline: Price pipelines too (``model`` an ``nn.Sequential``, with ``loss_fn``).
        loss_fn: ``loss_fn(output, target)``, a mean over the samples: with ``pipeline``,
            every choice is priced with it (``WithLoss``).
        rank: This rank, whose pipeline stage is priced.

    Returns:
        A ``StrategyPlan``: ``choice``, ``reason``, every candidate, and ``explain()``.

    Raises:
        InvalidArgumentError: as ``estimate_memory``, or ``headroom`` outside (0, 1] or a
            negative ``available_bytes``.
    """
    _check_world_size(world_size)
    if pipeline:
        model = with_loss(model, loss_fn)
    if not 0 < headroom <= 1:
        raise InvalidArgumentError(f"headroom must be in (0, 1], got {headroom}")
    if available_bytes is None:
        available_bytes = available_memory(device if device is not None else default_device(model))
    if available_bytes < 0:
        raise InvalidArgumentError(f"available_bytes must not be negative, got {available_bytes}")
    if prefetch < 0 or (unit_mb is not None and unit_mb < 0):
        raise InvalidArgumentError(
            f"prefetch ({prefetch}) and unit_mb ({unit_mb}) must not be negative"
        )
    k = optimizer_states(optimizer)
    budget = headroom * available_bytes
    on = torch.device(device) if device is not None else default_device(model)
    # The units ZeRO will make there (the model may not be there yet).
    rule, offload_rule = default_units(on), default_units(on, "optimizer")
    step = step_lists(optimizer)
    cache: dict[tuple[torch.dtype | None, str | None], tuple[tuple[int, int], bool, list[str]]]
    cache = {}

    def priced(
        name: str, offload: str | None = None, recompute: str | None = None
    ) -> MemoryEstimate:
        notes: list[str] = []
        mp = _effective_precision(name, mixed_precision, notes)
        key = (mp.param_dtype if mp is not None else None, recompute)
        if key not in cache:  # one meta forward per compute dtype and recompute policy
            act_notes: list[str] = []
            counted = _activations_or_note(model, example_input, mp, act_notes, recompute)
            cache[key] = (*counted, act_notes)
        (act, again), measured, act_notes = cache[key]
        return _estimate(
            model, name, world_size, k, mp, unit_mb, prefetch, act, measured,
            notes + act_notes, offload, recompute, unit_rule=offload_rule if offload else rule,
            recomputed=again, step=step, device=on,
        )  # fmt: skip

    # Recomputing changes only activations: priced where they are counted and it applies.
    policies: list[str | None] = [None]
    if example_input is not None and find_blocks(model) and not recomputing_blocks(model):
        policies += ["selective", "full"]
    candidates = [
        Candidate(name, None, e, e.total <= budget, policy)
        for policy in policies
        for name in strategies.BY_MEMORY
        for e in [priced(name, None, policy)]
    ]
    layouts, notes = priced_layouts(model, world_size, local_ranks, example_input, tensor_parallel)
    for layout in layouts:
        t = layout.size
        batch = widened(example_input, t) if example_input is not None else None
        tp_unit = unit_mb if unit_mb is not None else default_unit_mb(
            on, sum(p.nbytes for p in layout.model.parameters())
        )  # fmt: skip
        for name in strategies.BY_MEMORY:
            act_notes: list[str] = []
            mp = _effective_precision(name, mixed_precision, act_notes)
            (act, again), measured = _activations_or_note(layout.model, batch, mp, act_notes)
            e = _estimate(
                layout.model, name, world_size // t, k, mp, tp_unit, prefetch, act, measured,
                act_notes, unit_rule=rule, recomputed=again, step=step, device=on,
            )  # fmt: skip
            candidates.append(Candidate(name, None, e, e.total <= budget, tp=t))
    pipes: list[PipelineLayout] = []
    if pipeline:
        assert isinstance(model, WithLoss)
        # with tensor parallelism priced too, the pipelines whose stages split over tp ranks
        tp_sizes = [1, *(layout.size for layout in layouts)]
        pipes, pipe_notes = pipeline_layouts(
            model, world_size, rank, example_input, mixed_precision, tp_sizes
        )  # fmt: skip
        notes += pipe_notes
    for pipe in pipes:
        dp = world_size // (pipe.size * pipe.tp)
        pp_unit = unit_mb if unit_mb is not None else default_unit_mb(
            on, sum(p.nbytes for p in pipe.model.parameters())
        )  # fmt: skip
        for schedule, recompute in _INTERLEAVED if pipe.virtual > 1 else _PIPELINE_CHOICES:
            for name in strategies.BY_MEMORY if dp > 1 else ("ddp",):
                # DDP replicas keep the weights in their dtype: the stages' autocast casts
                # them, and keeps the casts over the step. ZeRO's gather them in the
                # compute dtype: nothing to cast.
                mp = None if name == "ddp" else (mixed_precision or MixedPrecision())
                kept = pipe.activations(schedule, recompute is not None)
                kept += pipe.cast if name == "ddp" else 0
                e = _estimate(
                    pipe.model, name, dp, k, mp, pp_unit, prefetch, kept, True, [],
                    unit_rule=rule, recomputed=pipe.kept if recompute else 0, step=step,
                    device=on, pipelined=True,
                )  # fmt: skip
                candidates.append(
                    Candidate(name, None, e, e.total <= budget, recompute, tp=pipe.tp,
                              pp=pipe.size, microbatches=pipe.microbatches, schedule=schedule)
                )  # fmt: skip
    host_budget = 0.0
    if on.type == "cuda":  # the host can hold what the device cannot: offload
        host_budget = headroom * available_memory("cpu")
        for offload in ("optimizer", "cpu"):
            e = priced("zero3", offload)
            fits = e.total <= budget and e.host <= host_budget
            candidates.append(Candidate("zero3", offload, e, fits))
    given = example_input is not None
    choice, reason = _choose(candidates, budget, available_bytes, headroom, given)
    return StrategyPlan(
        tuple(candidates), choice, reason, budget, available_bytes, host_budget,
        ModelShape.of(model), world_size, mixed_precision, headroom, given, None,
        tuple(layouts), tuple(notes), tuple(pipes),
    )  # fmt: skip


def choose_strategy(
    model: nn.Module,
    *,
    world_size: int,
    available_bytes: int | None = None,
    optimizer: str | torch.optim.Optimizer | None = "adamw",
    mixed_precision: MixedPrecision | None = None,
    example_input: Any = None,
    headroom: float = 0.7,
    unit_mb: float | None = None,
    prefetch: int = 1,
    device: torch.device | str | int | None = None,
) -> tuple[str, str, MemoryEstimate]:
    """The least sharded strategy whose estimate fits ``headroom`` of the available memory.

    ``plan_strategy``'s choice (see there for the arguments and errors), as
    ``(strategy, reason, estimate)``; the reason reads like
    ``"ddp: 1.2 GiB per rank of 12.0 GiB available (70% headroom)"``, and the estimate's
    ``offload`` says whether zero3 offloads.
    """
    plan = plan_strategy(
        model, world_size=world_size, available_bytes=available_bytes, optimizer=optimizer,
        mixed_precision=mixed_precision, example_input=example_input, headroom=headroom,
        unit_mb=unit_mb, prefetch=prefetch, device=device,
    )  # fmt: skip
    return plan.choice.strategy, plan.reason, plan.choice.estimate


def _choose(
    candidates: list[Candidate] | tuple[Candidate, ...],
    budget: float,
    available_bytes: int,
    headroom: float,
    example_given: bool,
) -> tuple[Candidate, str]:
    """The choice among ``candidates`` and why.

    Of those that fit (but the offloads): the fastest in a trial where some were tried, else
    the fastest predicted where some were; else the first that fits; zero3 when none does.
    """
    fitting = [c for c in candidates if c.fits]
    timed = [c for c in fitting if c.offload is None and c.time is not None]
    tried = [c for c in timed if c.time is not None and c.time.trial is not None]

    def seconds(c: Candidate) -> float:
        assert c.time is not None
        return c.time.trial if tried and c.time.trial is not None else c.time.total

    pool = tried or timed
    if pool:
        fastest = min(seconds(c) for c in pool)
        # Within 2 % of the fastest, the least sharded (the earliest in CHOICES) wins.
        choice = next(c for c in pool if seconds(c) <= 1.02 * fastest)
        e = choice.estimate
        others = sorted((c for c in pool if c is not choice), key=seconds)
        how = (
            f"{_ms(seconds(choice))} per step in a trial ({len(tried)} tried of the "
            f"{len(timed)} predicted that fit"
            if tried
            else f"predicted {_ms(seconds(choice))} per step ({len(timed)} predicted that fit"
        )
        reason = (
            f"{choice.name}: {how}; {format_bytes(e.total)} per rank of "
            f"{format_bytes(available_bytes)} available, {headroom:.0%} headroom)"
        )
        if others and seconds(others[0]) < seconds(choice):
            reason += (
                f"; {others[0].name} at {_ms(seconds(others[0]))} is within 2 % and more sharded"
            )
        elif others:
            reason += f"; next {others[0].name} at {_ms(seconds(others[0]))}"
    elif fitting:
        choice = fitting[0]
        e = choice.estimate
        rejected = candidates[: candidates.index(choice)]  # preferred, but none fits
        too_big = ", ".join(
            f"{c.name} ({format_bytes(c.estimate.total)})"
            for c in rejected
            if c.offload is None and c.recompute is None
        )
        if choice.offload is None:
            reason = (
                f"{choice.name}: {format_bytes(e.total)} per rank of "
                f"{format_bytes(available_bytes)} available ({headroom:.0%} headroom)"
            )
            if too_big:
                reason += "; " + too_big + " would not fit"
        else:
            reason = (
                f"zero3 with offload={choice.offload}: {format_bytes(e.total)} per rank "
                f"of {format_bytes(available_bytes)} available, "
                f"{format_bytes(e.host)} of host memory; " + too_big + " would not fit"
            )  # fmt: skip
    else:
        # The least memory without offloading: zero3, recomputing fully when priced.
        choice = min(
            (c for c in candidates if c.strategy == "zero3" and c.offload is None),
            key=lambda c: (c.estimate.total, c.order),
        )
        e = choice.estimate
        reason = (
            f"{choice.name} may not fit: {format_bytes(e.total)} per rank of "
            f"{format_bytes(available_bytes)} available ({headroom:.0%} headroom allows "
            f"{format_bytes(budget)}), short by {format_bytes(e.total - budget)}; add ranks, use "
            "mixed precision or a smaller batch"
            + ("" if example_given else " (or pass example_input to price recomputation)")
        )
    return choice, reason


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
