"""The units' layout: built from a plan, and re-formed once in the order modules ran.

``_install`` lays a ``UnitPlan`` out (``units.Unit.build``) and derives the orders every rank
follows (forward gathers in unit order, backward gathers in reverse order of last use,
reductions in reverse unit order). ``_reform`` runs once, at the end of the first synchronised
backward and before any optimizer state exists: when the modules ran in another order than
they were registered in, the units are re-planned in rank 0's execution order and the values
and reduced gradients move to the new layout, one old unit at a time. ``_reinstall`` lays the
units out afresh, reading nothing from the old ones and communicating nothing (``regroup``).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from shardline.comm.symmetric import (
    SymmetricArena,
    SymmetricPool,
    symmetric_available,
    wants_symmetric,
)
from shardline.parallel.data.zero.base import ZeroBase
from shardline.parallel.data.zero.grouping import UnitPlan, plan_units
from shardline.parallel.data.zero.units import Unit
from shardline.parallel.replaced import mark_replaced

__all__ = ["UnitLayout", "move_buffers"]


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """Moves ``module``'s buffers (not its parameters) to ``device`` (a host-kept model)."""
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is not None and buf.device != device:
                mod._buffers[name] = buf.to(device)


# Gradient buffers of the largest unit a ZeRO-2/3 pool in symmetric memory holds at once, and
# the largest unit gradient (bytes) it holds at all.
_GRAD_POOL_BUFFERS = 3
_GRAD_POOL_LARGEST = 64 << 20


def _aligned(n: int) -> int:
    return -(-n // SymmetricPool.ALIGN) * SymmetricPool.ALIGN


class UnitLayout:
    """Building and re-forming the units (see the module docstring).

    A part of ``ShardedDataParallel``, which owns it: it lays the units out into the
    wrapper's fields (``base.ZeroBase``), which it reaches through a weak reference, so the
    wrapper is freed as before.
    """

    def __init__(self, wrapper: ZeroBase) -> None:
        self._wrapper = weakref.ref(wrapper)

    @property
    def _w(self) -> ZeroBase:
        """The wrapper whose units these are."""
        w = self._wrapper()
        assert w is not None, "the ShardedDataParallel of this layout was freed"
        return w

    def _install(self, plan: UnitPlan, order: list[str]) -> None:
        """Builds the units of ``plan`` and everything derived from them.

        The parameters' current values (``.data``) are laid out; ``order`` (module names as
        they ran) fixes the backward order of units, registration order when empty.
        """
        w = self._w
        mp = w.mixed_precision
        w._plan = plan
        w._order = list(order)
        w._bw_gathered = set()
        w._units = []
        units = [
            Unit(
                index=spec.index,
                names=list(spec.params),
                params=[w._by_name[n] for n in spec.params],
                world_size=w.group.world_size,
                rank=w.group.rank,
                cdtype=mp.compute_dtype(spec.dtype),
                wdtype=mp.master_dtype(spec.dtype),
                rdtype=mp.reduction_dtype(spec.dtype),
                modules=list(spec.modules),
                owner=spec.owner,
                offload=w.offload,
            )
            for spec in plan.units
        ]
        for unit in units:
            unit.build(w._device, shard_is_view=w.stage < 3 and unit.cdtype == unit.wdtype)
            if w.stage == 3 and w._host_model:
                unit.free()  # the model is in host memory: one unit on the GPU at a time
            w._units.append(unit)
        # Symmetric memory is a collective to allocate, and layouts are not made in step on
        # every rank (a process joining an elastic job lays out once more than the ranks it
        # joins): the units move there before this layout's first collective (``adopt``).
        w.symmetric = wants_symmetric(
            w._gather_group, w._device, w._symmetric_choice, "ShardedDataParallel"
        ) and symmetric_available(w._reduce_group)
        w._symmetric_due = w.symmetric
        w._unit_of = {id(p): u for u in w._units for p in u.params}
        w._slot = {id(p): i for u in w._units for i, p in enumerate(u.params)}
        w._local_ids = {id(loc) for u in w._units for loc in u.locals}
        mark_replaced(
            (
                (name, p)
                for u in w._units
                for name, p in zip(u.names, u.params, strict=True)
                if id(p) not in w._local_ids
            ),
            f"sl.distribute(strategy='zero{w.stage}')",
        )
        position = {name: i for i, name in enumerate(order)}
        w._module_units = {}
        last_use: dict[int, float] = {}
        for pos, (mname, mod) in enumerate(w.module.named_modules(remove_duplicate=False)):
            units = sorted(
                {
                    u.index: u
                    for p in mod.parameters(recurse=False)
                    if (u := w._unit_of.get(id(p))) is not None
                }.values(),
                key=lambda u: u.index,
            )
            if not units:
                continue
            where = position.get(mname, len(position) + pos)
            for u in units:
                last_use[u.index] = max(last_use.get(u.index, -1), where)
            if mod not in w._module_units:
                w._module_units[mod] = units
                for u in units:
                    u.expected_uses += 1
        # Backward gathers units in the reverse order of their last use in forward.
        w._bw_order = sorted(w._units, key=lambda u: (-last_use[u.index], -u.index))
        w._bw_pos = {u.index: i for i, u in enumerate(w._bw_order)}
        w._rs_order = [u for u in reversed(w._units) if u.trainable]
        if w.stage == 3:
            for u in w._units:
                u.free()

    def plan(self) -> str:
        """The units: ``N layers -> U units, G all-gathers per step``, then one row per unit.

        Units kept whole for an optimizer are marked with their rank, and the optimizer and
        its reason are named.
        """
        w = self._w
        head = f"ShardedDataParallel stage {w.stage} on {w.group.world_size} ranks"
        text = f"{head}: {w._plan.table(w.stage)}"
        for name, why in w._whole_reasons.items():
            text += (
                f"\n  {name} steps whole parameters ({why}): each of its units is held, "
                "stepped and broadcast by one rank"
            )
        return text

    def _gather_master(self, u: Unit) -> torch.Tensor:
        """Every rank's master shard of ``u``, concatenated (a fresh tensor)."""
        return self._gather_flat(u, u.shard, u.wdtype)

    def _gather_flat(self, u: Unit, mine: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The full flat buffer of ``u`` from each rank's shard-sized part ``mine`` (a collective).

        ``None`` counts as zeros. A whole unit's comes from its owner.
        """
        w = self._w
        out = torch.zeros(u.padded, dtype=dtype, device=w._device)
        if u.owner is not None:
            if u.rank == u.owner and mine is not None:
                out[: u.numel].copy_(mine.reshape(-1))
            w.group.broadcast(out, src=u.owner)
            return out
        part = torch.zeros(u.shard_numel, dtype=dtype, device=w._device)
        if mine is not None:
            part.copy_(mine.reshape(-1))
        w.group.all_gather(out, part)
        return out

    def _optimizer_has_state(self) -> bool:
        w = self._w
        opt = w._optimizer
        return opt is not None and any(opt.state.values())

    @torch.no_grad()
    def _reform(self, trace: list[str]) -> None:
        """Re-forms the units in rank 0's execution order if that changes them.

        Runs at the end of the first synchronised backward, before any optimizer step (no
        optimizer state exists yet). Local parameter objects are kept, so an optimizer built
        over them stays valid; parameters and the reduced gradients move to the new layout,
        one old unit materialised at a time.
        """
        w = self._w
        names = [w._module_names[m] for m in w._module_units]
        index = {n: i for i, n in enumerate(names)}
        mine = [index[n] for n in dict.fromkeys(trace) if n in index]
        mine += [i for i in range(len(names)) if i not in set(mine)]
        order_t = torch.tensor(mine, dtype=torch.int64, device=w._device)
        if w._replicate is not None:  # every replica lays its units out the same way
            w._replicate.broadcast(order_t, src=0)
        w.group.broadcast(order_t, src=0)
        order = [names[i] for i in order_t.tolist()]
        self._relayout(order, w._whole)

    @torch.no_grad()
    def _relayout(self, order: list[str], whole: frozenset[str]) -> None:
        """Re-plans the units for ``order`` and ``whole`` and moves everything to them.

        Values and reduced gradients move one old unit at a time; nothing happens when the
        plan is the same. A collective: every rank calls it with the same arguments.
        """
        w = self._w
        plan = plan_units(
            w.module,
            w._plan.threshold,
            order,
            dtypes=w._dtypes,
            whole=whole,
            world_size=w.group.world_size,
            blocks=w._plan.blocks,
        )
        w._whole = whole
        if [(u.params, u.owner) for u in plan.units] == [
            (u.params, u.owner) for u in w._plan.units
        ]:
            return
        old_units, old_unit_of, old_slot = w._units, w._unit_of, w._slot
        old_locals = {
            id(p): loc for u in old_units for p, loc in zip(u.params, u.locals, strict=True)
        }
        cache: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

        def materialise(u: Unit) -> tuple[torch.Tensor, torch.Tensor | None]:
            if u.index not in cache:
                cache.clear()
                cache[u.index] = (self._gather_master(u), self._full_grads(u))
            return cache[u.index]

        grads: dict[int, torch.Tensor] = {}
        for spec in plan.units:  # point every parameter at its master values, unit by unit
            for name in spec.params:
                p = w._by_name[name]
                old = old_unit_of[id(p)]
                o, n = old.offsets[old_slot[id(p)]], p.numel()
                values, grad = materialise(old)
                # A host-kept model waits in host memory for its new layout (it may not fit).
                value = values[o : o + n].to(self._param_home, copy=True)
                p.data = value.view(p.shape)
                if grad is not None and p.requires_grad:
                    grads[id(p)] = grad[o : o + n].clone()
        cache.clear()
        self._install(plan, order)
        for u in w._units:
            fresh = u.locals
            u.locals = [old_locals[id(p)] for p in u.params]
            for loc, new in zip(u.locals, fresh, strict=True):
                loc.data = new.data
        w._local_ids = {id(loc) for loc in old_locals.values()}
        for u in w._units:
            if not any(id(p) in grads for p in u.params):
                u.publish_grads()  # drops gradients shown for the old layout, if any
                continue
            keep_full = w.stage == 1 and u.owner is None
            full = torch.zeros(u.padded, dtype=u.rdtype if keep_full else u.wdtype)
            full = full.to(w._device)
            for p, o in zip(u.params, u.offsets, strict=True):
                if id(p) in grads:
                    full[o : o + p.numel()].copy_(grads[id(p)])
            if keep_full:
                u.grad_full = full
                u.grad_filled = [True] * len(u.params)
                owned = full[u.lo : u.hi]
                u.shard_grad = owned if u.rdtype == u.wdtype else owned.to(u.wdtype)
            else:
                u.shard_grad = full[u.lo : u.hi].clone() if u.hi > u.lo else None
            u.publish_grads()

    def adopt_symmetric(self) -> None:
        """Moves the units' long-lived buffers to symmetric memory, once per layout.

        The schedule calls it before it issues the layout's first collective (a gather or a
        reduction): every rank reaches that point in the same order, so the allocation (a
        collective of the gather and reduce groups) matches up.
        """
        w = self._w
        if not w._symmetric_due:
            return
        w._symmetric_due = False
        required = w._symmetric_choice is True  # automatic: ordinary where a rank has no room
        sizes = [u.symmetric_sizes(w.stage) for u in w._units]
        arenas = (
            SymmetricArena(SymmetricArena.bytes_for([s for g, _ in sizes for s in g]),
                           group=w._gather_group, required=required),
            SymmetricArena(SymmetricArena.bytes_for([s for _, r in sizes for s in r]),
                           group=w._reduce_group, required=required),
        )  # fmt: skip
        w.symmetric = arenas[0].symmetric
        if not w.symmetric:
            return
        for u in w._units:
            u.rehome(w.stage, arenas)
        if w.stage == 1 or not required:
            return  # ZeRO-2/3 gradient buffers from a pool only when asked (symmetric=True)
        # ZeRO-2/3 gradients: a pool with room for the buffer filling, the reductions in
        # flight (schedule: one) and one more of the largest unit; past that, ordinary ones.
        # Units of more than _GRAD_POOL_LARGEST bytes of gradients keep ordinary ones: the
        # pool stays in memory between steps, and their reductions are long enough already.
        eligible = [
            u
            for u in w._units
            if u.symmetric_sizes(w.stage)[0] and u.padded * u.grad_itemsize <= _GRAD_POOL_LARGEST
        ]
        largest = max((u.padded * u.grad_itemsize for u in eligible), default=0)
        pool = SymmetricPool(_GRAD_POOL_BUFFERS * _aligned(largest), group=w._reduce_group,
                             required=required)  # fmt: skip
        for u in eligible:
            u.grad_pool = pool

    @property
    def _param_home(self) -> torch.device:
        """Where parameters wait between two layouts: the host for a host-kept model."""
        w = self._w
        return torch.device("cpu") if w._host_model else w._device

    @torch.no_grad()
    def _reinstall(self, whole: frozenset[str]) -> None:
        """Lays the units out afresh for this group, in registration order, parameters zero.

        The plan a fresh wrapper gets (``whole`` as its optimizer needs), laid out without
        reading the old units (``regroup``: their group is dead, and stage 3 has freed their
        gathered storage) and without communicating. The local parameter objects are kept (an
        optimizer holds them); gradients are dropped.
        """
        w = self._w
        plan = plan_units(
            w.module,
            w._plan.threshold,
            dtypes=w._dtypes,
            whole=whole,
            world_size=w.group.world_size,
            blocks=w._plan.blocks,
        )
        old_locals = {
            id(p): loc for u in w._units for p, loc in zip(u.params, u.locals, strict=True)
        }
        for name, p in w._by_name.items():
            p.grad = None
            # The original dtype, as a fresh wrapper's model has it (not the compute dtype).
            p.data = torch.zeros(p.shape, dtype=w._dtypes[name], device=self._param_home)
        for loc in old_locals.values():
            loc.grad = None  # shaped for the old layout
        w._whole = whole
        self._install(plan, [])
        for u in w._units:  # as in _relayout: an optimizer holds the old local objects
            fresh = u.locals
            u.locals = [old_locals[id(p)] for p in u.params]
            for loc, new in zip(u.locals, fresh, strict=True):
                loc.data = new.data
        w._local_ids = {id(loc) for loc in old_locals.values()}

    def _full_grads(self, u: Unit) -> torch.Tensor | None:
        """``u``'s reduced gradients, full length (stage 1 keeps them; else all-gathered).

        A whole unit's are its owner's, at every stage.
        """
        w = self._w
        if not u.trainable:
            return None
        if w.stage == 1 and u.owner is None:
            return u.grad_full
        return self._gather_flat(u, u.shard_grad, u.wdtype)
