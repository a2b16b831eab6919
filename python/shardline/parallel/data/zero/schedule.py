"""ZeRO's schedule: when each unit is all-gathered, freed and reduced, in forward and backward.

Hooks on the user's modules and parameters call in here. The orders are fixed so that every
rank issues the same collectives whatever modules it ran (see the package docstring):
forward gathers every unit once in unit order (stage 3: just before first use, ``prefetch``
ahead); backward gathers every unit once in reverse order of last use (stage 3) and reduces
every unit once in reverse unit order, on the reduce group, ``_MAX_INFLIGHT`` at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd import Variable

from shardline.errors import ShardlineError
from shardline.parallel.data.zero.base import TrainingState, Waitable
from shardline.parallel.data.zero.layout import UnitLayout
from shardline.parallel.data.zero.units import GradState, ParamState, Unit, copy_stream

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


class GatherReduceSchedule(UnitLayout):
    """The hooks and collectives of one training step (see the module docstring)."""

    # -- gathering -------------------------------------------------------------------------------

    def _gather(self, u: Unit) -> None:
        """Starts the all-gather of ``u``'s parameters into ``u.full``.

        Always issues one collective: callers follow a schedule every rank follows, so
        skipping one here would pair this rank's next all-gather with another unit's.
        """
        self._wait(u)
        u.alloc()
        side = None
        if u.offload is not None and u.owner is None and self._device.type == "cuda":
            # The shard's copy to the device and the all-gather it feeds go on a side stream,
            # after what the compute stream queued so far (``full`` was allocated there), so
            # the compute queued next does not wait for the bus.
            side = copy_stream(self._device, "to_device")
            side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            src = u.gather_source()
            with _preserve_version(u.full):
                if u.owner is None:
                    work = self._gather_group.all_gather(u.full, src, async_op=True)
                else:  # a whole unit: the owner's values, in place
                    work = self._gather_group.broadcast(u.full, src=u.owner, async_op=True)
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
        self._state = TrainingState.FORWARD
        self._sync_backward = self._require_sync
        for u in self._units:
            u.active = 0
            u.uses_left = u.expected_uses
            u.uses_seen = 0
        if self.stage > 1:
            for u in self._units:
                if u.shard_grad is not None and not any(
                    loc.grad is not None for loc in u.locals
                ):  # zero_grad() dropped them all: free the memory until backward needs it
                    u.shard_grad = None
        if self.stage == 3:
            for u in self._units:
                if u.param_state is not ParamState.SHARDED:
                    self._release(u)
                if self._graph_done:  # (a retained graph's second backward keeps the counts)
                    u.packed = u.fwd_uses = 0
            self._graph_done = False
            self._fwd_next = 0
        elif self._needs_gather:
            self._needs_gather = False
            for u in self._units:
                self._gather(u)

    def _ensure_forward(self, u: Unit) -> None:
        if self.stage == 3:
            last = min(len(self._units) - 1, u.index + self.prefetch)
            while self._fwd_next <= last:
                self._gather(self._units[self._fwd_next])
                self._fwd_next += 1
            if u.param_state is ParamState.SHARDED:  # freed, then used again
                self._gather(u)
        self._wait(u)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self._held:  # whole already, for a caller's step (held.py)
            return
        if torch._C._current_graph_task_id() != -1:  # recomputed in backward (checkpointing)
            if self.stage == 3:
                self._flush_releases()
                self._pre_backward(self._module_units[module])
            return
        if self._state is not TrainingState.FORWARD:
            raise ShardlineError(
                f"ShardedDataParallel: module {type(module).__name__} ran outside the wrapper's "
                "forward; call the wrapped model, not its inner module"
            )
        if self._trace is not None and not self._traced:
            self._trace.append(self._module_names[module])
        units = self._module_units[module]
        for u in units:
            self._ensure_forward(u)
            u.active += 1
            u.uses_seen += 1
            u.fwd_uses += 1
        self._unit_stack.append(units)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._held:
            return
        if torch._C._current_graph_task_id() != -1 or self._state is not TrainingState.FORWARD:
            return
        units = self._module_units[module]
        if self._unit_stack:
            self._unit_stack.pop()
        for u in units:
            u.active -= 1
            u.uses_left -= 1
        if self.stage == 3:
            keep = self._bw_order[0]
            for u in units:
                if u.active == 0 and u.uses_left <= 0 and u is not keep:
                    self._release(u)

    def _pack(self, t: torch.Tensor) -> tuple[tuple[Unit, ...], torch.Tensor]:
        """Tags a tensor autograd saves with the units whose parameters backward needs then."""
        units = tuple(self._unit_stack[-1]) if self._unit_stack else ()
        owner = self._unit_of.get(id(t))  # a parameter saved outside its own modules
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
        self._traced = True
        for u in self._units:
            if u.uses_seen:
                u.expected_uses = u.uses_seen
        if self.stage != 3:
            for u in self._units:  # units no module of this rank used
                self._wait(u)
            return
        while self._fwd_next < len(self._units):  # units no module of this rank used
            self._gather(self._units[self._fwd_next])
            self._fwd_next += 1
        keep = self._bw_order[0] if torch.is_grad_enabled() else None
        for u in self._units:
            if u is keep:
                self._wait(u)
            else:
                self._release(u)
        self._bw_gathered = {keep.index} if keep is not None else set()
        self._bw_next = 0

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer stepped: if it holds our shards, their device copies are stale.

        Under offload the device copies go; at stages 1/2 the parameters are re-gathered
        before the next forward.
        """
        mine = any(id(p) in self._local_ids for g in optimizer.param_groups for p in g["params"])
        if not mine:
            return
        for u in self._units:
            u.dev_shard = None
        if self.stage < 3:
            self._needs_gather = True

    # -- backward --------------------------------------------------------------------------------

    def _queue_final(self) -> None:
        if self._state is not TrainingState.BACKWARD:
            self._state = TrainingState.BACKWARD
            Variable._execution_engine.queue_callback(self._end_backward)
            for u in self._units:
                u.grads_pending = sum(p.requires_grad for p in u.params)
                if u.grad_state is not GradState.PUBLISHED:
                    u.grad_state = GradState.IDLE
            self._rs_next = 0

    def _issue_backward_gathers(self, upto: Unit | None, extra: int) -> None:
        """Issues backward all-gathers, in their fixed order, through ``upto`` and ``extra`` more.

        All of them when ``upto`` is ``None``.
        """
        order = self._bw_order
        last = (
            len(order) - 1
            if upto is None
            else min(len(order) - 1, self._bw_pos[upto.index] + extra)
        )
        while self._bw_next <= last:
            self._issue_backward_gather(order[self._bw_next])

    def _issue_backward_gather(self, v: Unit) -> None:
        self._bw_next += 1
        if v.index in self._bw_gathered:
            return
        self._gather(v)
        self._bw_gathered.add(v.index)
        if v.fwd_uses == 0:  # this rank ran none of its modules: drop it once gathered
            self._drop.append(v)

    def _pre_backward(self, units: list[Unit]) -> None:
        self._queue_final()
        for u in units:
            self._issue_backward_gathers(u, self.prefetch)
            if u.param_state is ParamState.SHARDED:
                raise ShardlineError(
                    f"ShardedDataParallel on rank {self.group.rank}: unit {u.index} "
                    f"({u.modules[0] or '<root>'} ..) is needed in backward after it was "
                    "released: its gradients were complete and its saved tensors used; is a "
                    "parameter used outside its module's forward?"
                )
            self._wait(u)
        drop = self._drop
        while drop and (drop[0].gather_work is None or drop[0].gather_work.is_completed()):
            self._release(drop.pop(0))

    def _maybe_release(self, u: Unit) -> None:
        """Stage 3: frees ``u`` once its gradients are in and its saved tensors were used.

        Deferred to the next backward event: the node that unpacked the last saved tensor
        has not computed with it yet.
        """
        if (
            self.stage == 3
            and u.grads_pending == 0
            and u.unpacked >= u.packed
            and u.param_state is not ParamState.SHARDED
            and u not in self._releasable
        ):
            self._releasable.append(u)

    def _flush_releases(self) -> None:
        while self._releasable:
            self._release(self._releasable.pop())

    def _grad_hook(self, param: torch.Tensor) -> None:
        if self._held:  # a caller's step (held.py): the gradient adds into the step's buffer
            self._fold(param)
            return
        self._queue_final()
        self._flush_releases()
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        u, i = self._unit_of[id(param)], self._slot[id(param)]
        if u.grad_state is GradState.REDUCING:
            raise ShardlineError(
                f"ShardedDataParallel on rank {self.group.rank}: parameter {u.names[i]!r} "
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
            if self._sync_backward:
                self._launch_ready()

    def _fold(self, p: torch.Tensor) -> None:
        """Held steps (``held``): adds ``p``'s ``.grad`` into its unit's buffer.

        Unless it is a view of it, as ``unshard`` made it (autograd then adds in place).
        """
        g = p.grad
        if g is None:
            return
        u = self._unit_of[id(p)]
        if u.grad_full is None or g._base is u.grad_full:
            return
        o = u.offsets[self._slot[id(p)]]
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
        order = self._rs_order
        while self._rs_next < len(order) and order[self._rs_next].grads_pending == 0:
            self._launch(order[self._rs_next])
            self._rs_next += 1

    def _launch(self, u: Unit) -> None:
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
            work = self._reduce_group.reduce(u.grad_full, u.owner, op="avg", async_op=True)
            out = u.grad_full
        elif self._compression is not None:
            work, out, fresh = self._launch_compressed(u, self._compression)
        elif self.stage == 1:
            work = self._reduce_group.all_reduce(u.grad_full, op="avg", async_op=True)
            out, fresh = u.grad_full, True
        else:
            fresh = u.shard_grad is None or not u.locals_have_grads()
            if fresh and u.shard_grad is not None and u.rdtype == u.wdtype and not u.offload:
                out = u.shard_grad
            else:
                out = torch.empty(u.shard_numel, dtype=u.rdtype, device=self._device)
            work = self._reduce_group.reduce_scatter(out, u.grad_full, op="avg", async_op=True)
        assert work is not None
        self._inflight.append((u, work, out, fresh))
        # A host-blocking wait here could close a cycle with a rank that has yet to reach a
        # gather this rank has not issued (ranks running modules in different orders); CUDA
        # waits only order streams.
        blocking = self._device.type == "cuda" or self._bw_next >= len(self._bw_order)
        while len(self._inflight) > _MAX_INFLIGHT and (
            blocking or self._inflight[0][1].is_completed()
        ):
            self._finish(*self._inflight.pop(0))

    def _launch_compressed(
        self, u: Unit, compressor: Compressor
    ) -> tuple[Finishing, torch.Tensor, bool]:
        """Starts ``u``'s reduction through the compressor (sums: divided by the size first)."""
        assert u.grad_full is not None
        u.grad_full.div_(self._reduce_group.world_size)
        layout = u.entries()
        if self.stage == 1:
            finish = compressor.reduce(self._reduce_group, u.grad_full, key=u.index, layout=layout)
            return Finishing(finish), u.grad_full, True
        fresh = u.shard_grad is None or not u.locals_have_grads()
        out = torch.empty(u.shard_numel, dtype=u.rdtype, device=self._device)
        finish = compressor.reduce(
            self._reduce_group, u.grad_full, key=u.index, layout=layout, out=out
        )
        return Finishing(finish), out, fresh

    def _finish(self, u: Unit, work: Waitable, out: torch.Tensor, fresh: bool) -> None:
        """Waits for ``u``'s reduction and keeps this rank's part.

        ``fresh``: the part replaces what the rank held instead of adding to it. With
        replicas (HSDP), the part is first averaged over them, asynchronously: it is kept
        when that completes, at the end of backward (``_finish_replicas``).
        """
        work.wait()
        held = u.owner is None or u.rank == u.owner  # a whole unit reduces into its owner
        if self._replicate is not None and held:
            again = self._replicate.all_reduce(out, op="avg", async_op=True)
            assert again is not None
            self._replicating.append((u, again, out, fresh))
            return
        self._keep(u, out, fresh)

    def _finish_replicas(self) -> None:
        """Keeps the parts whose average over the replicas was still in flight."""
        while self._replicating:
            u, work, out, fresh = self._replicating.pop(0)
            work.wait()
            self._keep(u, out, fresh)

    def _keep(self, u: Unit, out: torch.Tensor, fresh: bool) -> None:
        """``u``'s reduced gradient ``out``: this rank's part of it, replacing or adding."""
        if u.offload is not None and (u.owner is None or u.rank == u.owner):
            u.keep_on_host(out[u.lo : u.hi] if self.stage == 1 and u.owner is None else out,
                           fresh=fresh)  # fmt: skip
            if self.stage > 1 or u.owner is not None:
                u.grad_full = None
                u.grad_filled = []
            return
        if self.stage == 1 and u.owner is None:
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
        self._state = TrainingState.IDLE
        try:
            if self.stage == 3:
                self._issue_backward_gathers(None, 0)
            if self._sync_backward:
                for u in self._rs_order[self._rs_next :]:
                    self._launch(u)
                self._rs_next = len(self._rs_order)
                while self._inflight:
                    self._finish(*self._inflight.pop(0))
                self._finish_replicas()
                if self.offload is not None and self._device.type == "cuda":
                    # The gradients' copies to pinned host memory (a side stream), before the
                    # optimizer reads them.
                    torch.cuda.synchronize(self._device)
                for u in self._units:
                    u.publish_grads()
                self._synced_steps += 1
                if self._compression is not None:
                    self._compression.advance()
            else:
                for u in self._units:
                    u.mark_accumulating()
            for u in self._units:
                if self.stage == 3:
                    self._release(u)
                u.unpacked = 0
            self._graph_done = True  # a new forward starts counting saved tensors afresh
            self._bw_gathered.clear()
            self._bw_next = 0
            self._drop.clear()
            self._releasable.clear()
            if self._sync_backward and self._trace is not None:
                trace, self._trace = self._trace, None
                if (
                    self._reorder
                    and self._optimizer is not None
                    and not self._optimizer_has_state()
                ):
                    self._reform(trace)
        except BaseException as exc:
            self.group.abort(f"backward failed on rank {self.group.rank}: {exc}")
            raise
