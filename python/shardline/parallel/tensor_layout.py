"""What tensor parallelism over ``t`` ranks would hold and send, priced on the meta device.

The planner (``fit.plan_strategy(tensor_parallel=True)``) prices layouts that split each
replica's layers over ``t`` ranks (``sl.tensor_parallel``'s ``"auto"`` plan), with data
parallelism over the ``N / t`` replicas. ``tensor_layout`` builds that rank's model on the
meta device (a copy whose parameters are meta tensors, rewritten by ``sl.tensor_parallel``
over a stand-in group that records the collectives its layers issue instead of running
them), so nothing is allocated; from it come the rank's parameters (its slices and what
stays whole), the activations one forward of the replica's batch saves, and the
tensor-parallel collectives of one forward and backward, counted as the layers issue them.

At a fixed global batch a replica trains ``t`` ranks' batches, so the layout is priced on
``widened(example_input, t)``: the example repeated ``t`` times along its first dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardline.parallel.activations import _map_tensors
from shardline.parallel.layout_meta import first_line, meta_copy, split_sizes, widened
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.probes import call_args, loss_of
from shardline.parallel.tensor import tensor_parallel

__all__ = ["MetaGroup", "TensorLayout", "counted_traffic", "priced_layouts", "tensor_layout"]


@dataclass(frozen=True)
class TensorLayout:
    """One rank of a tensor-parallel layout, on the meta device.

    Attributes:
        size: The tensor-parallel ranks per replica (t).
        model: This rank's model: its slices and the parameters kept whole, as meta tensors.
        split: The share of the replica's trainable elements that is split over the ``t``
            ranks (the matmuls' share of the compute, as the step model takes it).
        traffic: ``(phase, op, calls, bytes)`` of the collectives its layers issued in one
            forward and backward of the widened batch (empty when not counted).
    """

    size: int
    model: nn.Module
    split: float
    traffic: tuple[tuple[str, str, int, int], ...] = ()


def tensor_layout(model: nn.Module, t: int) -> TensorLayout | str:
    """Rank 0's part of ``model`` split over ``t`` ranks, or why it cannot be split.

    Every rank of a tensor-parallel group holds the same amount, so rank 0 stands for all.
    """
    twin = meta_copy(model)
    try:
        split = tensor_parallel(twin, MetaGroup(t), "auto")  # type: ignore[arg-type]
    except Exception as e:  # a layout that cannot be built is not priced, and says why
        return f"tp={t}: {first_line(e)}"
    whole = _trainable(model)
    per_rank = _trainable(split)
    share = (whole - per_rank) / (whole * (1 - 1 / t)) if whole else 0.0
    return TensorLayout(t, split, min(max(share, 0.0), 1.0))


def counted_traffic(
    layout: TensorLayout, example_input: Any, mp: MixedPrecision | None
) -> TensorLayout:
    """``layout`` with the tensor-parallel collectives of one forward and backward counted.

    Runs on the meta device in the compute dtype of ``mp``.

    Raises:
        Whatever the forward or backward raises on the meta device.
    """
    group = _group_of(layout.model)
    if group is None:
        return layout

    def meta(x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if mp is not None and x.is_floating_point():
            dtype = mp.compute_dtype(x.dtype)
        # an input that needs its gradient keeps needing it (a pipeline stage's)
        wants = x.requires_grad and dtype.is_floating_point
        return torch.empty(x.shape, dtype=dtype, device="meta").requires_grad_(wants)

    args, kwargs = call_args(_map_tensors(example_input, meta))
    state = {
        n: meta(p).requires_grad_(p.requires_grad and p.is_floating_point())
        for n, p in layout.model.named_parameters()
    }
    state.update({n: meta(b) for n, b in layout.model.named_buffers()})
    calls: list[tuple[str, str, int]] = []
    with group.recording("forward", calls), torch.enable_grad():
        out = torch.func.functional_call(layout.model, state, args, kwargs, strict=False)
        loss = loss_of(out)
    with group.recording("backward", calls):
        loss.backward()  # type: ignore[no-untyped-call]
    totals: dict[tuple[str, str], list[int]] = {}
    for phase, op, nbytes in calls:
        entry = totals.setdefault((phase, op), [0, 0])
        entry[0] += 1
        entry[1] += nbytes
    traffic = tuple((phase, op, calls, nbytes) for (phase, op), (calls, nbytes) in totals.items())
    return TensorLayout(layout.size, layout.model, layout.split, traffic)


def priced_layouts(
    model: nn.Module,
    world_size: int,
    local_ranks: int | None,
    example_input: Any,
    wanted: bool,
) -> tuple[list[TensorLayout], list[str]]:
    """The layouts ``plan_strategy(tensor_parallel=True)`` prices, and why any is not.

    Their traffic is counted on ``example_input`` widened to ``t`` ranks' batches.
    """
    if not wanted:
        return [], []
    layouts, notes = [], []
    for t in split_sizes(world_size, local_ranks or world_size):
        layout = tensor_layout(model, t)
        if isinstance(layout, str):
            notes.append(f"not priced: {layout}")
            continue
        if example_input is not None:
            try:
                layout = counted_traffic(layout, widened(example_input, t), None)
            except Exception as e:  # priced without them, and says so
                notes.append(f"tp={t}: its collectives not counted ({first_line(e)})")
        layouts.append(layout)
    if not notes and not layouts:
        notes.append(f"no tensor-parallel size divides {world_size} ranks and a host's")
    return layouts, notes


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _group_of(model: nn.Module) -> MetaGroup | None:
    for m in model.modules():
        g = getattr(m, "group", None)
        if isinstance(g, MetaGroup):
            return g
    return None


class MetaGroup:
    """Stands in for a tensor-parallel group of ``t`` ranks, as rank 0, on the meta device.

    Collectives record ``(phase, op, bytes)`` while ``recording`` and change nothing: on meta
    tensors there is nothing to move, and every rank holds the same shapes.
    """

    def __init__(self, t: int, members: list[MetaGroup] | None = None) -> None:
        self.world_size = t
        self.rank = 0
        self.device = torch.device("meta")
        self.calls: list[tuple[str, str, int]] = []
        self._phase: str | None = None
        self._members = members if members is not None else [self]

    def recording(self, phase: str, into: list[tuple[str, str, int]]) -> _Phase:
        """Within it, this group and its sub-groups record into ``into`` under ``phase``."""
        return _Phase(self._members, phase, into)

    def _note(self, op: str, t: torch.Tensor) -> None:
        if self._phase is not None:
            self.calls.append((self._phase, op, t.numel() * t.element_size()))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> None:
        """Records the all-reduce of ``tensor``."""
        self._note("all_reduce", tensor)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> None:
        """Records the all-gather into ``out``."""
        self._note("all_gather", out)

    def reduce_scatter(
        self, out: torch.Tensor, tensor: torch.Tensor, op: str = "sum", async_op: bool = False
    ) -> None:
        """Records the reduce-scatter of ``tensor``."""
        self._note("reduce_scatter", tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> None:
        """Records the broadcast of ``tensor``."""
        self._note("broadcast", tensor)

    def new_group(self, ranks: list[int]) -> MetaGroup | None:
        """A sub-group of ``ranks`` that records with this one (``None`` without rank 0)."""
        if 0 not in ranks:
            return None
        sub = MetaGroup(len(ranks), self._members)
        self._members.append(sub)
        return sub


class _Phase:
    """Within it, the groups record their collectives under ``phase`` into one list."""

    def __init__(
        self, members: list[MetaGroup], phase: str, into: list[tuple[str, str, int]]
    ) -> None:
        self.members, self.phase, self.into = members, phase, into

    def __enter__(self) -> None:
        for g in self.members:
            g._phase = self.phase
            g.calls = self.into

    def __exit__(self, *exc: object) -> None:
        for g in self.members:
            g._phase = None
