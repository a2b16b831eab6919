"""A priced choice's predicted step.

The step model (``timing.predict``) applied to a plain, a tensor-parallel or a pipeline
choice, from the layouts ``fit.plan_strategy`` priced it on.
"""

from __future__ import annotations

import torch

from shardline.parallel.candidate import Candidate
from shardline.parallel.pipeline_layout import VIRTUAL, PipelineLayout, step_ratio
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.tensor_layout import TensorLayout
from shardline.parallel.timing import (
    Collective,
    ModelShape,
    Probes,
    StepTime,
    compute_dtype,
    predict,
)

__all__ = ["choice_dtype", "predicted_step"]


def choice_dtype(c: Candidate, shape: ModelShape, mp: MixedPrecision | None) -> torch.dtype | None:
    """The low-precision dtype ``c`` computes in (a pipeline autocasts under any strategy)."""
    if c.pp > 1:  # mp's compute dtype where it is not the model's own
        low = mp.param_dtype if mp is not None else None
        return low if low != shape.dtype else None
    return compute_dtype(c.strategy, shape, mp)


def predicted_step(
    c: Candidate,
    probes: Probes,
    shape: ModelShape,
    world_size: int,
    mp: MixedPrecision | None,
    layouts: tuple[TensorLayout, ...],
    pipelines: tuple[PipelineLayout, ...],
) -> StepTime | None:
    """``c``'s step from ``probes``, for a model of ``shape`` over ``world_size`` ranks.

    ``None`` where the probes lack its compute.
    """
    if c.pp > 1:
        return _pipeline_step(c, probes, shape, mp, pipelines)
    if c.tp == 1:
        return predict(
            c.strategy, c.recompute, c.estimate.num_units, shape, world_size, mp, probes,
        )  # fmt: skip
    layout = next(t for t in layouts if t.size == c.tp)
    # The layers' collectives were counted in the model's dtype; they move the compute's.
    dtype = compute_dtype(c.strategy, shape, mp) or shape.dtype
    ratio = dtype.itemsize / shape.dtype.itemsize
    blocking = [
        Collective(phase, op, calls, int(nbytes * ratio))
        for phase, op, calls, nbytes in layout.traffic
    ]
    return predict(
        c.strategy, c.recompute, c.estimate.num_units, ModelShape.of(layout.model),
        c.estimate.world_size, mp, probes, scale=c.tp * (1 - layout.split) + layout.split,
        blocking=blocking, blocking_world=c.tp,
    )  # fmt: skip


def _pipeline_step(
    c: Candidate,
    probes: Probes,
    shape: ModelShape,
    mp: MixedPrecision | None,
    pipelines: tuple[PipelineLayout, ...],
) -> StepTime | None:
    """A pipeline over ``pp`` stages: its schedule's step on the slowest stage.

    A replica trains ``pp`` ranks' batches, so a micro-batch through the whole chain is
    ``pp / m`` of the probe's compute and through the slowest stage ``share`` of that;
    the schedule takes ``step_ratio`` times the ``m`` micro-batches' work (1F1B:
    ``(m + pp - 1) / m``, ``m + pp - 1`` slots), simulated with the probe's forward and
    backward. Each micro-batch's activation crosses the cut forward and its gradient
    back. Where the host issues ahead (CUDA), it launches the stage's kernels once per
    micro-batch: ``m`` times ``share`` of the probe's, whatever their size. On CPU each
    micro-batch's pass costs the probe's ``fixed`` part whatever its rows: ``m`` micro-batches
    of a replica's ``s`` batches (``batch_scale``) take ``s`` probes' work plus ``m - s``
    fixed parts. A stage that recomputes runs each micro-batch's forward again in its
    backward: simulated so, its compute and launches grow by that forward.
    """
    virtual = VIRTUAL if c.schedule == "interleaved" else 1
    layout = next(
        p
        for p in pipelines
        if (p.size, p.microbatches, p.tp, p.virtual) == (c.pp, c.microbatches, c.tp, virtual)
    )
    m, pp = c.microbatches, c.pp
    low = choice_dtype(c, shape, mp)
    probe = probes.compute.get((None, low))
    if probe is None:
        return None
    f, b = probe.forward, probe.backward
    # A recomputing stage runs each micro-batch's forward again in its backward.
    again = f if c.recompute is not None else 0.0
    grow = (f + b + again) / (f + b) if f + b > 0 else 1.0
    ratio = step_ratio(c.schedule, pp, m, f, b + again, virtual) * grow
    if not probes.ahead and f + b > 0:  # each micro-batch pays a pass's fixed part
        s = c.batch_scale
        ratio *= 1 + (m - s) * probe.fixed / (s * (f + b))
    # Each of the rank's stages but the chain's last sends every micro-batch on.
    senders = virtual - (1 if layout.stage == pp - 1 else 0)
    sends = [
        Collective(phase, "send", m * senders, m * layout.boundary)
        for phase in ("forward", "backward")
    ] if layout.boundary else []  # fmt: skip
    # With tp ranks per stage: the split layers' share of the stage's compute on 1 / tp
    # each, and their collectives per micro-batch (counted in the model's dtype).
    ratio_bytes = (low or shape.dtype).itemsize / shape.dtype.itemsize
    tp_calls = [
        Collective(phase, op, m * calls, int(m * nbytes * ratio_bytes))
        for phase, op, calls, nbytes in layout.traffic
    ]
    split = c.tp * (1 - layout.tp_split) + layout.tp_split if c.tp > 1 else 1.0
    return predict(
        c.strategy, None, c.estimate.num_units, ModelShape.of(layout.model),
        c.estimate.world_size, mp, probes, dtype=low,
        scale=pp * layout.share * ratio * split,
        launches=m * layout.share * grow,
        blocking=sends + tp_calls, blocking_world=c.tp,
    )  # fmt: skip
