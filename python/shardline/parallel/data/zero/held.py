"""Steps a caller drives: whole parameters held over many micro-batches, one reduction.

A pipeline stage runs its micro-batches' forwards and backwards on the inner module itself,
interleaved as its schedule says, so the per-forward gathers and per-backward reductions of
``schedule`` do not fit it. Instead, as FSDP under a pipeline (``reshard_after_forward=False``,
gradients reduced after the last micro-batch):

- ``unshard(accumulate=True)`` all-gathers every unit that is not whole and current (ZeRO-3
  between steps; any stage after an optimizer step or a load): once per step, however many
  micro-batches follow. Each trainable unit gets a zeroed flat gradient buffer in the reduce
  dtype that the micro-batches' gradients add up in: the parameters' ``.grad`` are views of it
  (autograd accumulates into them in place), or, when the whole parameters are in a lower
  precision than the buffer, the gradient hook adds each micro-batch's gradient into it (as
  FSDP accumulates in its ``reduce_dtype``). The module hooks stand aside meanwhile.
- ``whole_grad(p)``: the step's whole gradient of ``p`` so far, a view of the buffer, into
  which tied copies held by other ranks can be summed before the reduction.
- ``reduce_grads()``: one collective per unit, on the buffer as it is (no whole-size copy):
  ZeRO-1 all-reduces it and keeps this rank's part, ZeRO-2/3 reduce-scatter it. The parts
  become the local parameters' ``.grad`` (added to what those hold unless an optimizer zeroed
  them), the whole gradients are dropped, and ZeRO-3 frees the whole parameters.
- ``reshard()`` ends a hold without gradients (an inference): ZeRO-3 frees the parameters.

``whole_parameters()`` shows the whole parameters with their master values (state dicts).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from shardline.errors import InvalidArgumentError, ShardlineError
from shardline.parallel.data.zero.base import TrainingState, ZeroBase
from shardline.parallel.data.zero.layout import UnitLayout
from shardline.parallel.data.zero.schedule import GatherReduceSchedule
from shardline.parallel.data.zero.units import GradState, ParamState, Unit

__all__ = ["HeldSteps"]


class HeldSteps:
    """``unshard``, ``whole_grad``, ``reduce_grads``, ``reshard`` (see the module docstring).

    A part of ``ShardedDataParallel``, which delegates to it: it drives the wrapper's schedule
    (``GatherReduceSchedule``: its gathers and reductions) on the wrapper's units, which it
    reaches through a weak reference, so the wrapper is freed as before. The hold's flags
    (``_held``, ``_accumulating``) stay the wrapper's: the schedule's hooks read them.
    """

    def __init__(
        self, wrapper: ZeroBase, layout: UnitLayout, schedule: GatherReduceSchedule
    ) -> None:
        self._wrapper = weakref.ref(wrapper)
        self._layout = layout  # the wrapper's: master values gathered
        self._schedule = schedule  # the wrapper's: its gathers and reductions

    @property
    def _w(self) -> ZeroBase:
        """The wrapper whose units are held."""
        w = self._wrapper()
        assert w is not None, "the ShardedDataParallel of these steps was freed"
        return w

    def unshard(self, *, accumulate: bool = False) -> None:
        """Makes every unit whole and keeps it so until ``reduce_grads()`` or ``reshard()``.

        A collective per unit that is not whole and current; none when all are. With
        ``accumulate``, the coming backwards' gradients add up whole in one buffer per unit.
        Meanwhile the caller runs the inner module (``self.module``) directly.

        Raises:
            ShardlineError: called during the wrapper's own forward or backward, or while
                gradients of an earlier hold are still accumulating.
        """
        w = self._w
        if w._state is not TrainingState.IDLE or w._accumulating:
            raise ShardlineError(
                "ShardedDataParallel.unshard() during a forward, a backward, or a hold whose "
                "gradients were not reduced yet; call reduce_grads() first"
            )
        regather = w._needs_gather
        for u in w._units:
            if u.param_state is ParamState.SHARDED or regather:
                self._schedule._gather(u)
        w._needs_gather = False
        for u in w._units:
            self._schedule._wait(u)
        w._held = True
        if accumulate:
            for u in w._units:
                if u.trainable:
                    self._open_grads(u)
            w._accumulating = True

    def _open_grads(self, u: Unit) -> None:
        """A zeroed flat buffer for ``u``'s step, its parameters' ``.grad`` viewing it.

        A gradient a parameter holds already (a step that did not end) is kept in it.
        """
        u.grad_full = torch.zeros(u.padded, dtype=u.rdtype, device=u.full.device)
        u.grad_filled = [True] * len(u.params)
        u.held_grads.clear()
        u.grad_state = GradState.ACCUMULATING
        with torch.no_grad():
            for p, o in zip(u.params, u.offsets, strict=True):
                if not p.requires_grad:
                    continue
                view = u.grad_full[o : o + p.numel()].view(p.shape)
                if p.grad is not None:
                    view.add_(p.grad)
                p.grad = view if view.dtype == p.dtype else None

    def fold_grads(self) -> None:
        """Adds gradients set by hand (not by autograd's accumulation) into the step's buffers.

        Needed only where ``.grad`` was assigned directly during an accumulating hold (a
        pipeline's zero-bubble weight pass); autograd's own are taken as they come.
        """
        w = self._w
        for u in w._units:
            for p in u.params:
                self._schedule._fold(p)

    def whole_grad(self, p: torch.Tensor) -> torch.Tensor:
        """The step's whole gradient of the (whole) parameter ``p`` so far, in the reduce dtype.

        A view of the buffer ``reduce_grads()`` reduces: adding into it in place counts.

        Raises:
            InvalidArgumentError: ``p`` is not a parameter of the wrapped module.
            ShardlineError: outside an accumulating hold.
        """
        w = self._w
        u = w._unit_of.get(id(p))
        if u is None:
            raise InvalidArgumentError("whole_grad: not a parameter of the wrapped module")
        if not w._accumulating or u.grad_full is None:
            raise ShardlineError("whole_grad() is for a hold started by unshard(accumulate=True)")
        self._schedule._fold(p)
        o = u.offsets[w._slot[id(p)]]
        return u.grad_full[o : o + p.numel()].view(p.shape)

    def reduce_grads(self) -> None:
        """Ends an accumulating hold: one reduction per unit, this rank's parts kept.

        See the module docstring; every rank of the group calls it, after the same holds.

        Raises:
            ShardlineError: no accumulating hold is open.
        """
        w = self._w
        if not w._accumulating:
            raise ShardlineError("reduce_grads() without unshard(accumulate=True) before it")
        self.fold_grads()
        for u in w._units:
            for p in u.params:
                p.grad = None  # the whole gradients: their buffer is reduced below
        w._accumulating = False
        before: dict[int, torch.Tensor | None] = {}
        for u in w._rs_order:
            if w.stage == 1 and u.owner is None and u.offload is None:
                before[u.index] = u.shard_grad if u.locals_have_grads() else None
            self._schedule._launch(u)
        while w._inflight:
            self._schedule._finish(*w._inflight.pop(0))
        self._schedule._finish_replicas()
        if w.offload is not None and w._device.type == "cuda":
            torch.cuda.synchronize(w._device)
        for u in w._rs_order:
            if u.index in before:  # ZeRO-1: keep the part, drop the whole buffer
                part, held = u.shard_grad, before[u.index]
                assert part is not None
                if held is not None and held.data_ptr() != part.data_ptr():
                    u.shard_grad = held.add_(part)
                else:
                    u.shard_grad = part.clone()
                u.grad_full = None
                u.grad_filled = []
        for u in w._units:
            u.publish_grads()
        w._synced_steps += 1
        if w._compression is not None:
            w._compression.advance()
        self.reshard()

    def reshard(self) -> None:
        """Ends a hold: ZeRO-3 frees the whole parameters; the module hooks resume.

        Raises:
            ShardlineError: gradients are still accumulating (``reduce_grads()`` ends that).
        """
        w = self._w
        if w._accumulating:
            raise ShardlineError("reshard() during an accumulating hold; call reduce_grads()")
        w._held = False
        if w.stage == 3:
            for u in w._units:
                self._schedule._release(u)

    @contextlib.contextmanager
    def whole_parameters(self, *, writeback: bool = False) -> Iterator[None]:
        """Inside, the module's parameters are whole and hold the master values.

        The module may run inside (an inference), its hooks standing aside. A collective
        (each unit gathered in the master dtype) unless they are whole and current in that
        dtype already. ``writeback``: values written into them inside are
        this rank's parts afterwards (a full state dict loaded).
        """
        w = self._w
        shown: dict[torch.nn.Parameter, torch.Tensor] = {}
        values: list[torch.Tensor] = []
        held, w._held = w._held, True  # the module may run inside: hooks stand aside
        for u in w._units:
            current = (
                u.param_state is ParamState.GATHERED
                and u.cdtype == u.wdtype
                and not w._needs_gather
            )
            values.append(u.full if current else self._layout._gather_master(u))
            for p, o in zip(u.params, u.offsets, strict=True):
                shown[p] = p.data
                p.data = values[-1][o : o + p.numel()].view(p.shape)
        try:
            yield
        finally:
            w._held = held
            for p, data in shown.items():
                p.data = data
            if writeback:
                with torch.no_grad():
                    for u, v in zip(w._units, values, strict=True):
                        if u.hi > u.lo and not (u.shard_is_view and v is u.full):
                            u.shard.copy_(v[u.lo : u.hi])
                        u.dev_shard = None  # offload: the device copy is stale
                w._needs_gather = w.stage < 3
