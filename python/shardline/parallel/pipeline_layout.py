"""What a pipeline over ``pp`` ranks would hold and keep, priced on the meta device.

The planner (``fit.plan_strategy(pipeline=True)``) prices layouts that cut each replica's
``nn.Sequential`` into ``pp`` stages, as ``sl.pipeline`` cuts it (contiguous children,
balanced by each child's forward FLOPs on a micro-batch), run by one of ``SCHEDULES`` over
``m`` micro-batches, with DDP or ZeRO over the ``N / pp`` replicas. ``pipeline_layouts``
builds this rank's stage on the meta device (a copy whose parameters are meta tensors, so
nothing is allocated) and counts what one micro-batch leaves for backward there (the last
stage with its loss). It also says what the slowest stage's share of the compute is and how
many bytes cross each cut per micro-batch.

What a schedule changes comes from its own actions (``schedules.build``, what the pipeline
runs): ``in_flight``, the most micro-batches a stage keeps at once (under 1F1B stage ``s``
keeps ``min(m, pp - s)``), and ``step_ratio``, its step simulated on equal stages
(``simulate``) over the ``m`` micro-batches' work alone.

With tensor parallelism inside the stages (``tp`` ranks per stage, a mesh ``{"dp", "pp",
"tp"}``), the stage is rewritten on the meta device as ``sl.pipeline(tp_group=)`` rewrites it
(the whole chain's ``"auto"`` plan, this stage's part of it), and its tensor-parallel
collectives of one micro-batch are counted as ``tensor_layout`` counts them.

At a fixed global batch a replica trains ``pp`` (times ``tp``) ranks' batches, so the layouts
are priced on ``widened(example, pp * tp)`` cut into ``m`` micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardline.errors import InvalidArgumentError
from shardline.parallel.activations import count_activations
from shardline.parallel.layout_meta import first_line, meta_copy, split_sizes, widened
from shardline.parallel.pipeline import schedules, whole_plan
from shardline.parallel.pipeline.deferred import deferrable, kept_bytes
from shardline.parallel.pipeline.simulate import simulate
from shardline.parallel.pipeline.split import balanced_parts, chain_children, child_costs
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.tensor import tensor_parallel
from shardline.parallel.tensor_layout import MetaGroup, TensorLayout, counted_traffic

__all__ = [
    "SCHEDULE",
    "SCHEDULES",
    "VIRTUAL",
    "PipelineLayout",
    "WithLoss",
    "casts",
    "in_flight",
    "pipeline_layouts",
    "step_ratio",
    "with_loss",
]

SCHEDULE = "1f1b"  # a pipeline choice's schedule unless it names another
# The schedules priced. ZB-H1 keeps at most 1F1B's micro-batches in flight and fills the
# bubbles with the deferred weight passes. Interleaved 1F1B runs ``VIRTUAL`` stages per rank
# (the chain cut into ``pp * VIRTUAL``), its bubble ``1 / VIRTUAL`` of 1F1B's for more sends.
# GPipe keeps all ``m`` at 1F1B's bubble (never better than 1F1B).
SCHEDULES = ("1f1b", "zero_bubble", "interleaved")
VIRTUAL = 2  # interleaved's stages per rank


class WithLoss(nn.Module):
    """``loss_fn(chain(inputs), target)``: a chain and its loss as one module.

    What ``as_distributed(pipeline=True)`` prices, times and tries; a choice that keeps the
    chain whole wraps the chain itself (its names unchanged) and steps with ``loss_fn``.
    """

    def __init__(self, chain: nn.Sequential, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.chain = chain
        self.loss_fn = loss_fn

    def forward(self, inputs: Any, target: Any) -> torch.Tensor:
        """The loss of ``inputs`` against ``target``."""
        return self.loss_fn(self.chain(inputs), target)


def with_loss(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> WithLoss:
    """``model`` and ``loss_fn`` as one module, for pricing pipelines; refuses what cannot be.

    Raises:
        InvalidArgumentError: a model that is not an ``nn.Sequential``, or no ``loss_fn``.
    """
    if isinstance(model, WithLoss):
        return model
    if not isinstance(model, nn.Sequential) or not callable(loss_fn):
        raise InvalidArgumentError(
            "pipeline=True prices pipelines of an nn.Sequential (sl.pipeline splits its "
            f"children) and takes loss_fn(output, target); got {type(model).__name__} and "
            f"loss_fn={loss_fn!r}. Write the model as nn.Sequential(embedding, *blocks, head)"
        )
    return WithLoss(model, loss_fn)


@dataclass(frozen=True)
class PipelineLayout:
    """This rank's stage of a pipeline over ``size`` ranks and ``microbatches``.

    Attributes:
        size: The pipeline's stages, one per rank (pp).
        microbatches: Micro-batches per step (m).
        stage: This rank's stage.
        model: That stage on the meta device (its children; the last stage with the loss).
        share: The slowest stage's share of the chain's compute (its children's costs).
        kept: Bytes one micro-batch leaves for backward on this stage.
        cast: Bytes of the stage's weights cast to the compute dtype, which the pipeline's
            autocast keeps over the whole step (each weight is cast once per step); 0
            without a lower compute dtype. Weights that already are in it (ZeRO's gathers)
            are not cast: see ``casts``.
        boundary: Bytes of one micro-batch's activation crossing this stage's cut (0 for the
            last stage).
        split: The children that start each stage, as ``sl.pipeline`` cuts the chain.
        deferred: Under zero-bubble, bytes one micro-batch keeps from its input pass to its
            weight pass where the stage's layers defer their weight gradients
            (``pipeline.deferred``: the graph is freed at the input pass); 0 where they do
            not (the graph stays, and the micro-batch counts twice there: ``in_flight``).
        tp: Tensor-parallel ranks per stage (1: none); ``model`` is then this rank's slices.
        tp_split: With ``tp``, the share of the stage's trainable elements split over its
            ranks (the matmuls' share of its compute, as the step model takes it).
        traffic: With ``tp``, ``(phase, op, calls, bytes)`` of the tensor-parallel
            collectives of one micro-batch's forward and backward on this stage.
        held: Bytes one micro-batch keeps between its forward and backward where the stage
            recomputes (``sl.pipeline(recompute=True)``): its input (received; the first
            stage's is a slice of the batch) and its output (what it sends on).
        virtual: Stages this rank holds (``VIRTUAL`` under interleaved 1F1B, else 1): the
            chain is cut into ``size * virtual`` and this rank holds stages ``stage``,
            ``stage + size``, ...; ``model`` then lists them, ``kept`` and ``boundary`` are
            their sums, ``share`` this rank's part of the compute.
        chunk_kept: With ``virtual``, ``kept`` of each of this rank's stages, in that order.
    """

    size: int
    microbatches: int
    stage: int
    model: nn.Module
    share: float
    kept: int
    boundary: int
    split: tuple[tuple[str, ...], ...]
    cast: int = 0
    deferred: int = 0
    tp: int = 1
    tp_split: float = 0.0
    traffic: tuple[tuple[str, str, int, int], ...] = ()
    held: int = 0
    virtual: int = 1
    chunk_kept: tuple[int, ...] = ()

    def activations(self, schedule: str, recompute: bool = False) -> int:
        """Bytes this stage keeps for backward at once under ``schedule`` (``in_flight``).

        With ``recompute`` (priced under 1F1B), each micro-batch in flight keeps ``held``;
        the one whose backward runs makes its ``kept`` again (the estimate's
        ``recomputed``). With ``virtual`` stages, each forward keeps its own stage's.
        """
        if self.virtual > 1:
            mine = range(self.stage, self.size * self.virtual, self.size)
            by_stage = dict(zip(mine, self.chunk_kept, strict=True))
            live = peak = 0
            for a in schedules.build(schedule, self.size, self.microbatches, self.virtual)[
                self.stage
            ]:
                live += by_stage[a.stage] if a.kind == "F" else -by_stage[a.stage]
                peak = max(peak, live)
            return peak
        if recompute:
            return round(self.held * in_flight(schedule, self.size, self.microbatches, self.stage))
        if schedule in schedules.SPLIT and self.deferred:
            # a forward keeps the micro-batch, its input pass swaps it for what the weight
            # pass needs, the weight pass frees that
            held = {"F": self.kept, "I": self.deferred - self.kept, "W": -self.deferred}
            return round(_peak(schedule, self.size, self.microbatches, self.stage, held))
        return round(self.kept * in_flight(schedule, self.size, self.microbatches, self.stage))


def in_flight(schedule: str, pp: int, m: int, stage: int) -> float:
    """The most micro-batches ``stage`` keeps for backward at once under ``schedule``.

    From the stage's own actions, in the order the pipeline runs them: a forward adds one, a
    backward (or a zero-bubble weight pass) frees it, as the pipeline's ``peak_activations``
    counts. Under zero-bubble a micro-batch whose input pass ran and whose weight pass has
    not yet also keeps the gradients that weight pass needs (the layers' output gradients,
    of the order of its activations; not measured): it counts twice there, so the price
    errs high. The first stage has no input pass (its weight pass is the whole backward).
    """
    split = stage > 0
    held = {"F": 1.0, "B": -1.0, "I": 1.0 if split else 0.0, "W": -2.0 if split else -1.0}
    return _peak(schedule, pp, m, stage, held)


def _peak(schedule: str, pp: int, m: int, stage: int, held: Mapping[str, float]) -> float:
    """The most ``stage`` holds at once: each action adds ``held[kind]``, in the stage's order."""
    live = peak = 0.0
    for a in schedules.build(schedule, pp, m)[stage]:
        live += held[a.kind]
        peak = max(peak, live)
    return peak


def step_ratio(
    schedule: str, pp: int, m: int, forward: float, backward: float, virtual: int = 1
) -> float:
    """``schedule``'s step over ``m`` micro-batches' work, on ``pp`` equal stages.

    Simulated (``simulate``) with a forward taking ``forward`` and a backward ``backward``
    (halves for zero-bubble's input and weight passes; with ``virtual`` stages per rank,
    each of them ``1 / virtual`` of those); 1F1B's is ``(m + pp - 1) / m``.
    """
    if forward + backward <= 0:
        return (m + pp - 1) / m
    f, b = forward / virtual, backward / virtual
    cost = {"F": f, "B": b, "I": b / 2, "W": b / 2}
    span = simulate(schedules.build(schedule, pp, m, virtual), pp, virtual, cost).makespan
    return span / (m * (forward + backward))


def microbatch_counts(pp: int, batch: int) -> list[int]:
    """The micro-batch counts worth pricing: ``pp``, ``2 pp``, ``4 pp`` that divide ``batch``."""
    return [m for m in (pp, 2 * pp, 4 * pp) if m <= batch and batch % m == 0]


def pipeline_layouts(
    model: WithLoss,
    world_size: int,
    rank: int,
    example_input: tuple[Any, Any] | None,
    mp: MixedPrecision | None,
    tp_sizes: Sequence[int] = (1,),
) -> tuple[list[PipelineLayout], list[str]]:
    """This rank's stage of every pipeline worth pricing, and why any is not.

    ``example_input`` is one rank's ``(inputs, target)``; without it nothing is priced. With
    ``tp_sizes`` above 1, also the pipelines whose stages split over that many ranks (this
    rank's stage on a mesh ``{"dp", "pp", "tp"}``, whose ``tp`` axis varies fastest).
    """
    if example_input is None:
        return [], ["pipelines not priced: they need example_input=(inputs, target)"]
    if not isinstance(example_input, tuple) or len(example_input) != 2:
        raise InvalidArgumentError(
            "pipeline=True: example_input is one rank's (inputs, target), what model.step "
            f"takes; got {type(example_input).__name__}"
            + (f" of {len(example_input)}" if isinstance(example_input, tuple) else "")
        )
    layouts, notes = [], []
    for tp in tp_sizes:
        for pp in split_sizes(world_size // tp, world_size // tp):
            inputs, target = widened(example_input, pp * tp)
            batch = inputs.shape[0] if isinstance(inputs, torch.Tensor) else 0
            for m in microbatch_counts(pp, batch):
                stage = rank // tp % pp
                try:
                    layouts.append(_layout(model, pp, m, stage, inputs, target, mp, tp))
                except Exception as e:  # a layout that cannot be built is not priced: why
                    name = f"tp={tp} " if tp > 1 else ""
                    notes.append(f"not priced: {name}pp={pp} m={m}: {first_line(e)}")
                    break
                try:
                    layouts.append(_interleaved(model, pp, m, stage, inputs, target, mp, tp))
                except Exception as e:
                    name = f"tp={tp} " if tp > 1 else ""
                    notes.append(f"not priced: {name}pp={pp} m={m} interleaved: {first_line(e)}")
    if not layouts and not notes:
        notes.append(f"no pipeline size divides {world_size} ranks and a batch")
    return layouts, notes


def _layout(
    model: WithLoss,
    pp: int,
    m: int,
    stage: int,
    inputs: torch.Tensor,
    target: Any,
    mp: MixedPrecision | None,
    tp: int = 1,
) -> PipelineLayout:
    twin, parts, by_name, cost_of, micro_in, micro_target = _cut(model, pp, m, inputs, target)
    share = max(sum(cost_of[n] for n in part) for part in parts) / max(1, sum(cost_of.values()))
    # The input of this rank's stage: the micro-batch through the stages before it.
    x = micro_in
    with torch.no_grad():
        for part in parts[:stage]:
            for name in part:
                x = by_name[name](x)
    whole = _trainable(by_name[n] for n in parts[stage])
    if tp > 1:
        by_name = _split_over(twin, set(parts[stage]), tp)
    mine = nn.Sequential(*(by_name[n] for n in parts[stage]))
    last = stage == pp - 1
    if last:
        priced: nn.Module = WithLoss(mine, model.loss_fn)
        args: tuple[Any, ...] = (x, _meta(micro_target))
        boundary = 0
    else:
        priced, args = mine, (x,)
        with torch.no_grad():
            out = mine(x)
        boundary = out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0
    kept, _again = count_activations(priced, args, mp)
    low = mp.param_dtype if mp is not None else None
    deferred = kept_bytes(mine, x, low) if stage > 0 and deferrable(mine) else 0
    split = 0.0
    traffic: tuple[tuple[str, str, int, int], ...] = ()
    if tp > 1:
        split = _split_share(whole, _trainable([mine]), tp)
        traffic = _tp_traffic(priced, args, stage > 0, tp, split)
    received = x.numel() * x.element_size() if stage > 0 and isinstance(x, torch.Tensor) else 0
    return PipelineLayout(
        pp, m, stage, priced, share, kept, boundary, tuple(tuple(p) for p in parts),
        casts(mine, low) if low is not None else 0, deferred, tp, split, traffic,
        received + boundary,
    )  # fmt: skip


def _interleaved(
    model: WithLoss,
    pp: int,
    m: int,
    stage: int,
    inputs: torch.Tensor,
    target: Any,
    mp: MixedPrecision | None,
    tp: int = 1,
) -> PipelineLayout:
    """This rank's ``VIRTUAL`` stages of the chain cut into ``pp * VIRTUAL`` stages.

    As ``sl.pipeline(virtual_stages=VIRTUAL)`` cuts it for interleaved 1F1B; with ``tp``, each
    of them rewritten as ``sl.pipeline(tp_group=)`` rewrites them, and their tensor-parallel
    collectives of one micro-batch counted.
    """
    v = VIRTUAL
    twin, parts, by_name, cost_of, x, micro_target = _cut(model, pp * v, m, inputs, target)
    loads = [sum(cost_of[n] for s in range(r, pp * v, pp) for n in parts[s]) for r in range(pp)]
    names = {n for s in range(stage, pp * v, pp) for n in parts[s]}
    whole = _trainable(by_name[n] for n in names)
    if tp > 1:
        by_name = {**by_name, **_split_over(twin, names, tp)}
    split = _split_share(whole, _trainable(by_name[n] for n in names), tp) if tp > 1 else 0.0
    held: list[nn.Module] = []
    kept: list[int] = []
    traffic: list[tuple[str, str, int, int]] = []
    boundary = 0
    for s, part in enumerate(parts):
        chunk = nn.Sequential(*(by_name[n] for n in part))
        last = s == pp * v - 1
        if s % pp == stage:
            priced = WithLoss(chunk, model.loss_fn) if last else chunk
            args = (x, _meta(micro_target)) if last else (x,)
            kept.append(count_activations(priced, args, mp)[0])
            held.append(priced)
            if tp > 1:
                traffic += _tp_traffic(priced, args, s > 0, tp, split)
        if not last:
            with torch.no_grad():
                x = chunk(x)
            if s % pp == stage and isinstance(x, torch.Tensor):
                boundary += x.numel() * x.element_size()
    mine = nn.ModuleList(held)
    low = mp.param_dtype if mp is not None else None
    return PipelineLayout(
        pp, m, stage, mine, max(loads) / max(1, sum(cost_of.values())), sum(kept), boundary,
        tuple(tuple(p) for p in parts), casts(mine, low) if low is not None else 0,
        tp=tp, tp_split=split, traffic=tuple(traffic), virtual=v, chunk_kept=tuple(kept),
    )  # fmt: skip


def _split_over(twin: WithLoss, names: set[str], tp: int) -> dict[str, nn.Module]:
    """The children ``names`` of ``twin``'s chain, rewritten over ``tp`` ranks.

    As ``sl.pipeline(tp_group=)`` rewrites a rank's stages: the whole chain's ``"auto"``
    plan, its part on them.
    """
    group = MetaGroup(tp)
    plan = whole_plan(twin.chain, group, "auto")  # type: ignore[arg-type]
    part_plan = {n: v for n, v in plan.items() if n.split(".")[0] in names}
    tensor_parallel(twin.chain, group, part_plan)  # type: ignore[arg-type]
    return {n: twin.chain.get_submodule(n) for n in names}  # a child may be rewritten itself


def _split_share(whole: int, per_rank: int, tp: int) -> float:
    """The share of ``whole`` trainable elements split over ``tp`` ranks, from one rank's."""
    split = (whole - per_rank) / (whole * (1 - 1 / tp)) if whole else 0.0
    return min(max(split, 0.0), 1.0)


def _tp_traffic(
    priced: nn.Module, args: tuple[Any, ...], grad_in: bool, tp: int, split: float
) -> tuple[tuple[str, str, int, int], ...]:
    """The tensor-parallel collectives of one micro-batch through ``priced``.

    ``grad_in``: its input needs a gradient (a later stage's: its first layer's backward
    collective).
    """
    x = args[0]
    wants = grad_in and isinstance(x, torch.Tensor) and x.is_floating_point()
    inputs = (x.detach().requires_grad_(wants) if isinstance(x, torch.Tensor) else x, *args[1:])
    return counted_traffic(TensorLayout(tp, priced, split), inputs, None).traffic


def _cut(
    model: WithLoss, stages: int, m: int, inputs: torch.Tensor, target: Any
) -> tuple[WithLoss, list[list[str]], dict[str, nn.Module], dict[str, int], Any, Any]:
    """A meta copy of ``model`` and its chain cut into ``stages`` as ``sl.pipeline`` cuts it.

    Balanced by each child's forward cost on one of ``m`` micro-batches. Returns the copy,
    the parts, its children by name, their costs by name, and that micro-batch's inputs (on
    the meta device) and targets.
    """
    twin = meta_copy(model)
    assert isinstance(twin, WithLoss)
    children = chain_children(twin.chain)
    micro_in = _meta(inputs.chunk(m)[0])
    micro_target = target.chunk(m)[0] if isinstance(target, torch.Tensor) else target
    costs = child_costs(children, micro_in)
    parts = balanced_parts(children, stages, costs)
    cost_of = dict(zip((n for n, _ in children), costs, strict=True))
    return twin, parts, dict(children), cost_of, micro_in, micro_target


def _trainable(modules: Any) -> int:
    """Trainable elements of ``modules``, each parameter once."""
    seen = {id(p): p.numel() for mod in modules for p in mod.parameters() if p.requires_grad}
    return sum(seen.values())


# The layers whose weights autocast casts to the lower dtype (its matmul-like ops).
_CAST_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def casts(stage: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``stage``'s weights that autocast to ``dtype`` casts and keeps.

    Those of its linear and convolution layers (weight and bias) that are floating point and
    not already ``dtype``; each parameter once, however many layers share it.
    """
    seen: dict[int, int] = {}
    for m in stage.modules():
        if isinstance(m, _CAST_LAYERS):
            for p in m.parameters(recurse=False):
                if p.is_floating_point() and p.dtype != dtype:
                    seen[id(p)] = p.numel() * dtype.itemsize
    return sum(seen.values())


def _meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) else x
