"""What a step of each choice costs, modelled from what ``probes.probe_step`` measured.

The memory planner (``fit.plan_strategy``) says which choices fit; this says which of them is
fastest. ``predict`` adds this rank's probes (``Probes``: its compute, optimizer and link) up
for one choice. Communication is what the strategy issues per step
(``collectives``, as ``zero/schedule.py`` and DDP issue it): DDP all-reduces the gradients
during backward; ZeRO-1 all-reduces them and ZeRO-2 reduce-scatters them during backward,
and both gather the stepped shards as forward begins; ZeRO-3 gathers every unit in forward
and again in backward and reduce-scatters the gradients. A phase's communication hides
behind that phase's compute (``Probes.overlap`` of it: all of it on CUDA, where the
collectives run on their own stream; on CPU, where they share the cores and memory
bandwidth with compute, half is assumed: ``trials`` measure what the model misses) except
its last collective. Where the host issuing the compute and every collective takes longer
than the device, that is the step. The optimizer steps every parameter under DDP, a
``1/N`` shard under ZeRO. For layouts that split a replica over ranks (tensor parallelism,
pipelines) ``fit`` scales the compute to the rank's part of the replica's batch and adds
what waits in full: the layers' collectives, the pipeline's sends across its cuts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from shardline.parallel.precision import MixedPrecision

__all__ = [
    "Collective",
    "Compute",
    "Link",
    "ModelShape",
    "Probes",
    "StepTime",
    "collectives",
    "predict",
]

_DDP_FIRST_BUCKET, _DDP_BUCKET = 2**20, 25 * 2**20  # DDP's default buckets, bytes


@dataclass(frozen=True)
class Compute:
    """One rank's batch through forward and backward, in seconds.

    ``host``: the time the host took to issue them (on CUDA less than their sum unless the
    host is what limits the step). ``fixed``: the part of the two that a pass costs whatever
    its rows (0 where not probed): a batch of ``k`` of the probe's ``R`` rows takes
    ``fixed + (forward + backward - fixed) * k / R``.
    """

    forward: float
    backward: float
    host: float
    fixed: float = 0.0


@dataclass(frozen=True)
class Link:
    """The group's all-reduce: ``latency + 2 (N-1)/N * bytes / bandwidth`` seconds.

    ``issue``: host seconds to start one asynchronous collective.
    """

    latency: float
    bandwidth: float
    issue: float = 0.0

    def all_reduce(self, nbytes: float, world: int, calls: int) -> float:
        """Seconds for ``calls`` all-reduces of ``nbytes`` in all."""
        return calls * self.latency + 2 * (world - 1) / world * nbytes / self.bandwidth

    def gather(self, nbytes: float, world: int, calls: int) -> float:
        """Seconds for ``calls`` all-gathers (or reduce-scatters) of ``nbytes`` in all."""
        return calls * self.latency + (world - 1) / world * nbytes / self.bandwidth


@dataclass(frozen=True)
class Probes:
    """What ``probe_step`` measured on this rank.

    Attributes:
        compute: By ``(recompute policy, compute dtype)``; the dtype is ``None`` for the
            model's own.
        optimizer: Seconds per element one optimizer step updates.
        link: The group's all-reduce; ``None`` for one rank.
        overlap: Fraction of a phase's compute its communication can hide behind.
        seconds: How long the probes took.
        notes: The compute probes that failed (their choices stay untimed), and why.
        ahead: The host issues work ahead of the device (CUDA): its time per step then goes
            with the kernels it launches, not with their work.
    """

    compute: Mapping[tuple[str | None, torch.dtype | None], Compute]
    optimizer: float
    link: Link | None
    overlap: float
    seconds: float = 0.0
    notes: tuple[str, ...] = ()
    ahead: bool = False


@dataclass(frozen=True)
class ModelShape:
    """What the step model needs of the model.

    Its trainable elements, their dtype (the first floating parameter's) and how many
    tensors hold them.
    """

    elements: int
    dtype: torch.dtype
    tensors: int = 0

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        """The shape of ``model``."""
        params = [p for p in model.parameters() if p.requires_grad]
        dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
        return cls(sum(p.numel() for p in params), dtype, len(params))


@dataclass(frozen=True)
class StepTime:
    """One choice's predicted step, in seconds.

    Attributes:
        compute: Forward and backward, recomputation included.
        comm: The strategy's communication, were none of it hidden.
        exposed: What the step waits beyond compute: the part of ``comm`` that compute does
            not hide, or the host issuing the work where it falls behind the device.
        optimizer: The optimizer step over the parameters this rank updates.
        slowest: The slowest rank's total, once the ranks agreed (``StrategyPlan.agreed``).
        trial: The slowest rank's median step when it was tried (``StrategyPlan.tried``).
    """

    compute: float
    comm: float
    exposed: float
    optimizer: float
    slowest: float | None = None
    trial: float | None = None

    @property
    def total(self) -> float:
        """Predicted seconds per step: compute, exposed communication, optimizer.

        The slowest rank's, once agreed.
        """
        if self.slowest is not None:
            return self.slowest
        return self.compute + self.exposed + self.optimizer


def compute_dtype(
    strategy: str, shape: ModelShape, mp: MixedPrecision | None
) -> torch.dtype | None:
    """The dtype a strategy computes in, ``None`` for the model's own (DDP keeps it)."""
    if strategy == "ddp" or mp is None or mp.param_dtype in (None, shape.dtype):
        return None
    return mp.param_dtype


@dataclass(frozen=True)
class Collective:
    """Collectives of one kind that a strategy issues per step.

    ``calls`` of them, ``nbytes`` in all: each rank's input to an all-reduce or a
    reduce-scatter, the output of an all-gather.
    """

    phase: str  # "forward" or "backward"
    op: str  # "all_reduce", "all_gather", "reduce_scatter" (or "send": point to point)
    calls: int
    nbytes: int


def collectives(
    strategy: str, units: int, shape: ModelShape, world: int, mp: MixedPrecision | None
) -> list[Collective]:
    """What ``strategy`` issues per step over ``units`` ZeRO units (none on one rank).

    DDP all-reduces its gradients in buckets (a first of 1 MiB, then up to 25 MiB) and a
    byte per parameter (which ones were used); ZeRO gathers each unit in the compute dtype
    and reduces its gradient in the reduction dtype.
    """
    if world == 1:
        return []
    n = shape.elements
    if strategy == "ddp":
        grads = n * shape.dtype.itemsize
        buckets = 1 + max(0, math.ceil((grads - _DDP_FIRST_BUCKET) / _DDP_BUCKET))
        # and a byte per parameter: which ones some rank used
        return [Collective("backward", "all_reduce", buckets + 1, grads + shape.tensors)]
    policy = mp or MixedPrecision()
    gathered = n * policy.compute_dtype(shape.dtype).itemsize
    reduced = n * policy.reduction_dtype(shape.dtype).itemsize
    out = [Collective("forward", "all_gather", units, gathered)]
    if strategy == "zero1":
        out.append(Collective("backward", "all_reduce", units, reduced))
    else:
        if strategy == "zero3" and units > 1:
            # each unit gathered again in backward, but the one forward used last (kept): an
            # average unit's bytes less
            again = gathered * (units - 1) // units
            out.append(Collective("backward", "all_gather", units - 1, again))
        out.append(Collective("backward", "reduce_scatter", units, reduced))
    return out


def predict(
    strategy: str,
    recompute: str | None,
    units: int,
    shape: ModelShape,
    world: int,
    mp: MixedPrecision | None,
    probes: Probes,
    *,
    dtype: torch.dtype | None = None,
    scale: float = 1.0,
    launches: float = 1.0,
    blocking: Iterable[Collective] = (),
    blocking_world: int = 1,
) -> StepTime | None:
    """The step time of ``strategy`` (ddp, zero1-3, no offload) from ``probes``.

    For a layout that splits each replica over several ranks (``shape`` then this rank's
    part, ``world`` the replicas): ``scale`` times the probe's compute of one rank's batch
    is this rank's (``fit`` works it out for tensor parallelism and pipelines); where the
    host issues ahead of the device, it issues ``launches`` times the probe's kernels (a
    pipeline's micro-batches each run its stage's); ``blocking`` (collectives over
    ``blocking_world`` ranks, or point-to-point sends) waits in full. ``dtype``: the
    low-precision dtype it computes in where that is not the strategy's (``compute_dtype``;
    a pipeline computes in ``mp``'s under any strategy). ``None`` when the probes lack its
    compute (a policy or dtype not probed).
    """
    probed = probes.compute.get((recompute, dtype or compute_dtype(strategy, shape, mp)))
    if probed is None:
        return None
    host = probed.host * (launches if probes.ahead else scale)
    measured = Compute(probed.forward * scale, probed.backward * scale, host)
    link = probes.link
    comm = {"forward": 0.0, "backward": 0.0}
    calls = {"forward": 0, "backward": 0}
    waits, issued = 0.0, 0
    for c in blocking if link is not None else ():
        assert link is not None
        if c.op == "send":  # point to point: every byte crosses once
            waits += c.calls * link.latency + c.nbytes / link.bandwidth
        else:
            moves = link.all_reduce if c.op == "all_reduce" else link.gather
            waits += moves(c.nbytes, blocking_world, c.calls)
        issued += c.calls
    for c in collectives(strategy, units, shape, world, mp) if link is not None else []:
        assert link is not None
        moves = link.all_reduce if c.op == "all_reduce" else link.gather
        comm[c.phase] += moves(c.nbytes, world, c.calls)
        calls[c.phase] += c.calls
    # A phase hides its communication behind ``overlap`` of its compute, but for its last call.
    busy = {"forward": measured.forward, "backward": measured.backward}
    exposed = waits + sum(
        max(comm[p] - probes.overlap * busy[p], comm[p] / calls[p]) for p in comm if calls[p]
    )
    compute = measured.forward + measured.backward
    # Where the host issues work ahead of the device (CUDA), the step is the slower of two
    # timelines: the device's compute and exposed communication, or the host issuing the
    # compute and every collective (on CPU the host is the device: issuing adds to the step).
    issue = link.issue if link is not None else 0.0
    exposed = max(exposed, measured.host + (sum(calls.values()) + issued) * issue - compute)
    updated = shape.elements if strategy == "ddp" else math.ceil(shape.elements / world)
    return StepTime(
        compute=compute,
        comm=sum(comm.values()) + waits,
        exposed=exposed,
        optimizer=updated * probes.optimizer,
    )
