"""ZeRO's schedule: when each unit is all-gathered, freed and reduced, in forward and backward.

Hooks on the user's modules and parameters call in here. The orders are fixed so that every
rank issues the same collectives whatever modules it ran (see the package docstring):
forward gathers every unit once in unit order (stage 3: just before first use, ``prefetch``
ahead); backward gathers every unit once in reverse order of last use (stage 3) and reduces
every unit once in reverse unit order, on the reduce group, ``_MAX_INFLIGHT`` at a time.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd import Variable

from shardline.errors import ShardlineError
from shardline.parallel.data.zero.base import TrainingState, Waitable, ZeroBase
from shardline.parallel.data.zero.layout import UnitLayout
from shardline.parallel.data.zero.units import GradState, ParamState, Unit, copy_stream
from shardline.parallel.deterministic.collector import wide_grad

if TYPE_CHECKING:
    from shardline.compression.codec import Compressor

__all__ = ["Finishing", "GatherReduceSchedule"]

# The engine writes gathered parameters into memory autograd saved; the bytes are the ones that
# were saved, so the version counter must not move (torch's FSDP does the same).
_preserve_version = torch.autograd.grad_mode._unsafe_preserve_version_counter
_MAX_INFLIGHT = 1  # gradient reductions in flight before backward waits for the oldest


class Finishing:
    """A compressed reduction in flight, waited for like a ``Work``.

    It never reports completion early: its ``finish`` may run further collectives, so when it
    runs must not depend on timing (every rank must issue them at the same point).
    """

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    def is_completed(self) -> bool:
        """Always ``False`` until waited for (see the class docstring)."""
        return self._finish is None

    def wait(self) -> None:
        """Finishes the reduction (once)."""
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


class GatherReduceSchedule:
    """The hooks and collectives of one training step (see the module docstring).

    A part of ``ShardedDataParallel``, which owns it and points its hooks at it: it operates
    on the wrapper's units and its step's state (the fields of ``base.ZeroBase``), which it
    reaches through a weak reference, so the wrapper is freed as before, and re-forms the
    units through their ``UnitLayout``.
    """

    def __init__(self, wrapper: ZeroBase, layout: UnitLayout) -> None:
        self._wrapper = weakref.ref(wrapper)
        self._layout = layout  # the wrapper's: re-forms the units after the first backward

    @property
    def _w(self) -> ZeroBase:
        """The wrapper whose units this schedule gathers and reduces."""
        w = self._wrapper()
        assert w is not None, "the ShardedDataParallel of this schedule was freed"
        return w

    def reset(self) -> None:
        """No step under way: a new wrapper's state, and ``regroup``'s.

        What a failed step left in flight is dropped, not waited for.
        """
        w = self._w
        w._require_sync = w._sync_backward = True
        w._needs_gather = False  # stages 1/2: an optimizer stepped the shards
        w._fwd_next = w._bw_next = w._rs_next = 0
        w._inflight, w._replicating = [], []
        w._bw_gathered = set()
        w._state = TrainingState.IDLE
        w._unit_stack = []  # units of the modules running now
        w._drop = []  # gathered in backward only to keep ranks in step
        w._releasable = []  # done in backward, freed at the next event
        w._graph_done = True
        w._held = w._accumulating = False  # a step the caller drives (held.py)

    # -- gathering -------------------------------------------------------------------------------

    def _gather(self, u: Unit) -> None:
        """Starts the all-gather of ``u``'s parameters into ``u.full``.

        Always issues one collective: callers follow a schedule every rank follows, so
        skipping one here would pair this rank's next all-gather with another unit's.
        """
        w = self._w
        self._layout.adopt_symmetric()  # before the layout's first collective
        self._wait(u)
        u.alloc()
        side = None
        if u.offload is not None and u.owner is None and w._device.type == "cuda":
            # The shard's copy to the device and the all-gather it feeds go on a side stream,
            # after what the compute stream queued so far (``full`` was allocated there), so
            # the compute queued next does not wait for the bus.
            side = copy_stream(w._device, "to_device")
            side.wait_stream(torch.cuda.current_stream(w._device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            src = u.gather_source()
            with _preserve_version(u.full):
                if u.owner is None:
                    work = w._gather_group.all_gather(u.full, src, async_op=True)
                else:  # a whole unit: the owner's values, in place
                    work = w._gather_group.broadcast(u.full, src=u.owner, async_op=True)
        assert work is not None
        u.gather_work, u.gather_input = work, src
        u.param_state = ParamState.GATHERING

    def _wait(self, u: Unit) -> None:
        if u.gather_work is not None:
            with _preserve_version(u.full):
                u.gather_work.wait()
            src = u.gather_input
            if src is not None and src.is_cuda and u.offload is not None:
                # Made on a side stream: not reused before this stream, which now waits for
                # the all-gather, gets here.
                src.record_stream(torch.cuda.current_stream(src.device))
            u.gather_work = u.gather_input = None
            u.param_state = ParamState.GATHERED

    def _release(self, u: Unit) -> None:
        self._wait(u)
        u.free()

    # -- forward ---------------------------------------------------------------------------------

    def _begin_forward(self) -> None:
        w = self._w
        w._state = TrainingState.FORWARD
        w._sync_backward = w._require_sync
        for u in w._units:
            u.active = 0
            u.uses_left = u.expected_uses
            u.uses_seen = 0
        if w.stage > 1:
            for u in w._units:
                if u.shard_grad is not None and not any(
                    loc.grad is not None for loc in u.locals
                ):  # zero_grad() dropped them all: free the memory until backward needs it
                    u.shard_grad = None
        if w.stage == 3:
            for u in w._units:
                if u.param_state is not ParamState.SHARDED:
                    self._release(u)
                if w._graph_done:  # (a retained graph's second backward keeps the counts)
                    u.packed = u.fwd_uses = 0
            w._graph_done = False
            w._fwd_next = 0
        elif w._needs_gather:
            w._needs_gather = False
            for u in w._units:
                self._gather(u)

    def _ensure_forward(self, u: Unit) -> None:
        w = self._w
        if w.stage == 3:
            last = min(len(w._units) - 1, u.index + w.prefetch)
            while w._fwd_next <= last:
                self._gather(w._units[w._fwd_next])
                w._fwd_next += 1
            if u.param_state is ParamState.SHARDED:  # freed, then used again
                self._gather(u)
        self._wait(u)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        w = self._w
        if w._held:  # whole already, for a caller's step (held.py)
            return
        if torch._C._current_graph_task_id() != -1:  # recomputed in backward (checkpointing)
            if w.stage == 3:
                self._flush_releases()
                self._pre_backward(w._module_units[module])
            return
        if w._state is not TrainingState.FORWARD:
            raise ShardlineError(
                f"ShardedDataParallel: module {type(module).__name__} ran outside the wrapper's "
                "forward; call the wrapped model, not its inner module"
            )
        if w._trace is not None and not w._traced:
            w._trace.append(w._module_names[module])
        units = w._module_units[module]
        for u in units:
            self._ensure_forward(u)
            u.active += 1
            u.uses_seen += 1
            u.fwd_uses += 1
        w._unit_stack.append(units)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        w = self._w
        if w._held:
            return
        if torch._C._current_graph_task_id() != -1 or w._state is not TrainingState.FORWARD:
            return
        units = w._module_units[module]
        if w._unit_stack:
            w._unit_stack.pop()
        for u in units:
            u.active -= 1
            u.uses_left -= 1
        if w.stage == 3:
            keep = w._bw_order[0]
            for u in units:
                if u.active == 0 and u.uses_left <= 0 and u is not keep:
                    self._release(u)

    def _pack(self, t: torch.Tensor) -> tuple[tuple[Unit, ...], torch.Tensor]:
        """Tags a tensor autograd saves with the units whose parameters backward needs then."""
        w = self._w
        units = tuple(w._unit_stack[-1]) if w._unit_stack else ()
        owner = w._unit_of.get(id(t))  # a parameter saved outside its own modules
        if owner is not None and owner not in units:
            units = (*units, owner)
        for u in units:
            u.packed += 1
        return units, t

    def _unpack(self, packed: tuple[tuple[Unit, ...], torch.Tensor]) -> torch.Tensor:
        units, t = packed
        self._flush_releases()
        if units:
            self._pre_backward(list(units))
            for u in units:
                u.unpacked += 1
                self._maybe_release(u)
        return t

    def _end_forward(self) -> None:
        w = self._w
        w._traced = True
        for u in w._units:
            if u.uses_seen:
                u.expected_uses = u.uses_seen
        if w.stage != 3:
            for u in w._units:  # units no module of this rank used
                self._wait(u)
            return
        while w._fwd_next < len(w._units):  # units no module of this rank used
            self._gather(w._units[w._fwd_next])
            w._fwd_next += 1
        keep = w._bw_order[0] if torch.is_grad_enabled() else None
        for u in w._units:
            if u is keep:
                self._wait(u)
            else:
                self._release(u)
        w._bw_gathered = {keep.index} if keep is not None else set()
        w._bw_next = 0

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer stepped: if it holds our shards, their device copies are stale.

        Under offload the device copies go; at stages 1/2 the parameters are re-gathered
        before the next forward.
        """
        w = self._w
        mine = any(id(p) in w._local_ids for g in optimizer.param_groups for p in g["params"])
        if not mine:
            return
        for u in w._units:
            u.dev_shard = None
        if w.stage < 3:
            w._needs_gather = True

    # -- backward --------------------------------------------------------------------------------

    def _queue_final(self) -> None:
        w = self._w
        if w._state is not TrainingState.BACKWARD:
            w._state = TrainingState.BACKWARD
            Variable._execution_engine.queue_callback(self._end_backward)
            for u in w._units:
                u.grads_pending = sum(p.requires_grad for p in u.params)
                if u.grad_state is not GradState.PUBLISHED:
                    u.grad_state = GradState.IDLE
            w._rs_next = 0

    def _issue_backward_gathers(self, upto: Unit | None, extra: int) -> None:
        """Issues backward all-gathers, in their fixed order, through ``upto`` and ``extra`` more.

        All of them when ``upto`` is ``None``.
        """
        w = self._w
        order = w._bw_order
        last = (
            len(order) - 1 if upto is None else min(len(order) - 1, w._bw_pos[upto.index] + extra)
        )
        while w._bw_next <= last:
            self._issue_backward_gather(order[w._bw_next])

    def _issue_backward_gather(self, v: Unit) -> None:
        w = self._w
        w._bw_next += 1
        if v.index in w._bw_gathered:
            return
        self._gather(v)
        w._bw_gathered.add(v.index)
        if v.fwd_uses == 0:  # this rank ran none of its modules: drop it once gathered
            w._drop.append(v)

    def _pre_backward(self, units: list[Unit]) -> None:
        w = self._w
        self._queue_final()
        for u in units:
            self._issue_backward_gathers(u, w.prefetch)
            if u.param_state is ParamState.SHARDED:
                raise ShardlineError(
                    f"ShardedDataParallel on rank {w.group.rank}: unit {u.index} "
                    f"({u.modules[0] or '<root>'} ..) is needed in backward after it was "
                    "released: its gradients were complete and its saved tensors used; is a "
                    "parameter used outside its module's forward?"
                )
            self._wait(u)
        drop = w._drop
        while drop and (drop[0].gather_work is None or drop[0].gather_work.is_completed()):
            self._release(drop.pop(0))

    def _maybe_release(self, u: Unit) -> None:
        """Stage 3: frees ``u`` once its gradients are in and its saved tensors were used.

        Deferred to the next backward event: the node that unpacked the last saved tensor
        has not computed with it yet.
        """
        w = self._w
        if (
            w.stage == 3
            and u.grads_pending == 0
            and u.unpacked >= u.packed
            and u.param_state is not ParamState.SHARDED
            and u not in w._releasable
        ):
            w._releasable.append(u)

    def _flush_releases(self) -> None:
        w = self._w
        while w._releasable:
            self._release(w._releasable.pop())

    def _grad_hook(self, param: torch.Tensor) -> None:
        w = self._w
        if w._held:  # a caller's step (held.py): the gradient adds into the step's buffer
            self._fold(param)
            return
        self._queue_final()
        self._flush_releases()
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        wide = wide_grad(param)  # deterministic mode's sum before its rounding to bf16
        grad = grad if wide is None else wide
        u, i = w._unit_of[id(param)], w._slot[id(param)]
        if u.grad_state is GradState.REDUCING:
            raise ShardlineError(
                f"ShardedDataParallel on rank {w.group.rank}: parameter {u.names[i]!r} "
                "got a second gradient in one backward, after its unit was reduced "
                "(reentrant activation checkpointing?); use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        with torch.no_grad():
            self._touch(u)
            u.add_grad(i, grad, last=u.grads_pending == 1)
        u.grads_pending -= 1
        if u.grads_pending == 0:
            self._maybe_release(u)
            if w._sync_backward:
                self._launch_ready()

    def _fold(self, p: torch.Tensor) -> None:
        """Held steps (``held``): adds ``p``'s ``.grad`` into its unit's buffer.

        Unless it is a view of it, as ``unshard`` made it (autograd then adds in place).
        """
        w = self._w
        g = p.grad
        if g is None:
            return
        u = w._unit_of[id(p)]
        wide = wide_grad(p)
        if u.grad_full is None or g._base is u.grad_full:
            return
        g = g if wide is None else wide
        o = u.offsets[w._slot[id(p)]]
        with torch.no_grad():
            u.grad_full[o : o + p.numel()].view(g.shape).add_(g)
        p.grad = None

    def _touch(self, u: Unit) -> None:
        """First gradient (or the final flush) of ``u`` in this backward."""
        if u.grad_state in (GradState.ACCUMULATING, GradState.REDUCING):
            return
        if u.grad_state is GradState.PUBLISHED and self._stale(u):
            u.grad_filled = [False] * len(u.params)  # the optimizer dropped them
            u.held_grads.clear()
        u.grad_state = GradState.ACCUMULATING

    def _stale(self, u: Unit) -> bool:
        """The optimizer side zeroed the gradients shown to it at the end of the last backward.

        ``zero_grad()`` sets them to ``None``; ``zero_grad(set_to_none=False)`` zeros the local
        views in place (their shared version counter moves and they read all zero).
        """
        if not u.locals_have_grads():
            return True
        base = u.shown_base() if u.shown_base is not None else None
        return base is not None and base._version != u.grad_version and not bool(torch.any(base))

    def _launch_ready(self) -> None:
        w = self._w
        order = w._rs_order
        while w._rs_next < len(order) and order[w._rs_next].grads_pending == 0:
            self._launch(order[w._rs_next])
            w._rs_next += 1

    def _launch(self, u: Unit) -> None:
        w = self._w
        self._layout.adopt_symmetric()  # before the layout's first collective
        self._touch(u)
        u.fill_missing()
        u.grad_state = GradState.REDUCING
        assert u.grad_full is not None
        work: Waitable | None
        if u.owner is not None:
            # A whole unit, at every stage: this backward's gradients go to the owner, which
            # adds them to what it holds unless its optimizer dropped that (only the owner
            # sees its locals' .grad).
            fresh = u.shard_grad is None or not u.locals_have_grads()
            work = w._reduce_group.reduce(u.grad_full, u.owner, op="avg", async_op=True)
            out = u.grad_full
        elif w._compression is not None:
            work, out, fresh = self._launch_compressed(u, w._compression)
        elif w.stage == 1:
            work = w._reduce_group.all_reduce(u.grad_full, op="avg", async_op=True)
            out, fresh = u.grad_full, True
        else:
            fresh = u.shard_grad is None or not u.locals_have_grads()
            if fresh and u.shard_grad is not None and u.rdtype == u.wdtype and not u.offload:
                out = u.shard_grad
            else:
                out = torch.empty(u.shard_numel, dtype=u.rdtype, device=w._device)
            work = w._reduce_group.reduce_scatter(out, u.grad_full, op="avg", async_op=True)
        assert work is not None
        w._inflight.append((u, work, out, fresh))
        # A host-blocking wait here could close a cycle with a rank that has yet to reach a
        # gather this rank has not issued (ranks running modules in different orders); CUDA
        # waits only order streams.
        blocking = w._device.type == "cuda" or w._bw_next >= len(w._bw_order)
        while len(w._inflight) > _MAX_INFLIGHT and (blocking or w._inflight[0][1].is_completed()):
            self._finish(*w._inflight.pop(0))

    def _launch_compressed(
        self, u: Unit, compressor: Compressor
    ) -> tuple[Finishing, torch.Tensor, bool]:
        """Starts ``u``'s reduction through the compressor (sums: divided by the size first)."""
        w = self._w
        assert u.grad_full is not None
        u.grad_full.div_(w._reduce_group.world_size)
        layout = u.entries()
        if w.stage == 1:
            finish = compressor.reduce(w._reduce_group, u.grad_full, key=u.index, layout=layout)
            return Finishing(finish), u.grad_full, True
        fresh = u.shard_grad is None or not u.locals_have_grads()
        out = torch.empty(u.shard_numel, dtype=u.rdtype, device=w._device)
        finish = compressor.reduce(
            w._reduce_group, u.grad_full, key=u.index, layout=layout, out=out
        )
        return Finishing(finish), out, fresh

    def _finish(self, u: Unit, work: Waitable, out: torch.Tensor, fresh: bool) -> None:
        """Waits for ``u``'s reduction and keeps this rank's part.

        ``fresh``: the part replaces what the rank held instead of adding to it. With
        replicas (HSDP), the part is first averaged over them, asynchronously: it is kept
        when that completes, at the end of backward (``_finish_replicas``).
        """
        w = self._w
        work.wait()
        held = u.owner is None or u.rank == u.owner  # a whole unit reduces into its owner
        if w._replicate is not None and held:
            again = w._replicate.all_reduce(out, op="avg", async_op=True)
            assert again is not None
            w._replicating.append((u, again, out, fresh))
            return
        self._keep(u, out, fresh)

    def _finish_replicas(self) -> None:
        """Keeps the parts whose average over the replicas was still in flight."""
        w = self._w
        while w._replicating:
            u, work, out, fresh = w._replicating.pop(0)
            work.wait()
            self._keep(u, out, fresh)

    def _keep(self, u: Unit, out: torch.Tensor, fresh: bool) -> None:
        """``u``'s reduced gradient ``out``: this rank's part of it, replacing or adding."""
        w = self._w
        if u.offload is not None and (u.owner is None or u.rank == u.owner):
            u.keep_on_host(out[u.lo : u.hi] if w.stage == 1 and u.owner is None else out,
                           fresh=fresh)  # fmt: skip
            if w.stage > 1 or u.owner is not None:
                u.grad_full = None
                u.grad_filled = []
            return
        if w.stage == 1 and u.owner is None:
            owned = out[u.lo : u.hi]
            if u.rdtype == u.wdtype:
                u.shard_grad = owned
            else:
                u.shard_grad = owned.to(u.wdtype)
            return
        if u.owner is not None and u.rank != u.owner:  # reduced into another rank's
            u.grad_full = None
            u.grad_filled = []
            return
        if out is not u.shard_grad:
            if fresh or u.shard_grad is None:
                u.shard_grad = out if out.dtype == u.wdtype else out.to(u.wdtype)
            else:
                u.shard_grad.add_(out)
        u.grad_full = None
        u.grad_filled = []

    def _end_backward(self) -> None:
        w = self._w
        w._state = TrainingState.IDLE
        try:
            if w.stage == 3:
                self._issue_backward_gathers(None, 0)
            if w._sync_backward:
                for u in w._rs_order[w._rs_next :]:
                    self._launch(u)
                w._rs_next = len(w._rs_order)
                while w._inflight:
                    self._finish(*w._inflight.pop(0))
                self._finish_replicas()
                if w.offload is not None and w._device.type == "cuda":
                    # The gradients' copies to pinned host memory (a side stream), before the
                    # optimizer reads them.
                    torch.cuda.synchronize(w._device)
                for u in w._units:
                    u.publish_grads()
                w._synced_steps += 1
                if w._compression is not None:
                    w._compression.advance()
            else:
                for u in w._units:
                    u.mark_accumulating()
            for u in w._units:
                if w.stage == 3:
                    self._release(u)
                u.unpacked = 0
            w._graph_done = True  # a new forward starts counting saved tensors afresh
            w._bw_gathered.clear()
            w._bw_next = 0
            w._drop.clear()
            w._releasable.clear()
            if w._sync_backward and w._trace is not None:
                trace, w._trace = w._trace, None
                if (
                    w._reorder
                    and w._optimizer is not None
                    and not self._layout._optimizer_has_state()
                ):
                    self._layout._reform(trace)
        except BaseException as exc:
            w.group.abort(f"backward failed on rank {w.group.rank}: {exc}")
            raise
