"""Sharded data parallel: ZeRO stages 1, 2 and 3 (FSDP) around a plain model.

``ShardedDataParallel`` groups the model's parameters into *units* automatically
(``grouping.plan_units``: small layers merged up to a threshold, large ones never merged with
each other) and gives every unit a flat buffer sharded across the ranks (``_units.Unit``). The
optimizer steps this rank's shards: ``model.parameters()`` yields one 1-D local parameter per
original parameter, named like it, so ``torch.optim.AdamW(model.parameters())`` keeps 1/N of
the optimizer state.

- **Stage 1**: gathered parameters and full gradients stay on every rank; each unit's gradients
  are all-reduced when complete (so accumulation across backward passes is exactly DDP's);
  after an optimizer step (a global step hook sees it) the units are all-gathered again before
  the next forward.
- **Stage 2**: as stage 1, but each unit's gradients are reduce-scattered as soon as the unit is
  complete, and only this rank's gradient shard is kept.
- **Stage 3**: parameters are sharded too. A unit is all-gathered just before the first module
  that uses it runs (the next unit is prefetched meanwhile) and freed after its last use. Every
  tensor autograd saves inside a unit's modules is tagged (saved-tensor hooks), so in backward
  the unit is gathered again when a saved tensor first needs it, and freed once its gradients
  are in and all its saved tensors were used (frozen and unused units included). Modules that
  activation checkpointing runs again in backward gather their units the same way.

No hangs when ranks run different modules: collectives never depend on which modules ran.
Every forward all-gathers every unit once, in unit order, on a dedicated group; every
synchronised backward gathers every unit once in a fixed order (the reverse of their last use)
and reduces every unit once in reverse unit order on another group. A unit a rank does not use
is gathered and dropped; its gradient contribution is zero. One case is not covered: a module
run a *different number of times* on different ranks in one forward (stage 3 re-gathers a unit
used again after it was freed, and only the ranks that use it issue that all-gather), as with
FSDP.

Not supported yet: CPU offload, deferred (meta-device) initialisation, hybrid sharding, buffers
kept in sync after construction (BatchNorm statistics stay per rank, as in FSDP), optimizers
that look across a whole tensor (LAMB, Adafactor: each rank holds 1-D pieces).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_post_hook

from shardline.comm.group import ProcessGroup
from shardline.comm.work import Work
from shardline.errors import InvalidArgumentError, ShardlineError
from shardline.parallel._common import (
    broadcast_coalesced,
    check_same_model,
    default_group,
    remove_hooks_when_collected,
    weak_method,
)
from shardline.parallel._units import Unit
from shardline.parallel.grouping import UnitPlan, default_unit_mb, owned_parameters, plan_units
from shardline.parallel.precision import MixedPrecision

__all__ = ["ShardedDataParallel", "ShardedTensor"]

_log = logging.getLogger("shardline")

_MIB = 1 << 20
# The engine writes gathered parameters into memory autograd saved; the bytes are the ones that
# were saved, so the version counter must not move (torch's FSDP does the same).
_preserve_version = torch.autograd.grad_mode._unsafe_preserve_version_counter
_MAX_INFLIGHT = 1  # gradient reductions in flight before backward waits for the oldest


def groups_by_name(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    """The optimizer's param groups with parameter names (``names[id(p)]``) for parameters."""
    groups = []
    for g in optimizer.param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = [names[id(p)] for p in g["params"] if id(p) in names]
        groups.append(entry)
    return groups


class ShardedTensor:
    """This rank's part of a parameter (or of its optimizer state): a flat element range.

    Attributes:
        local: The 1-D local values (elements ``offset .. offset + local.numel()`` of the
            parameter flattened in row-major order).
        global_shape: The parameter's full shape.
        offset: Where ``local`` starts in the flattened parameter.
    """

    __slots__ = ("global_shape", "local", "offset")

    def __init__(self, local: torch.Tensor, global_shape: torch.Size, offset: int) -> None:
        self.local = local
        self.global_shape = global_shape
        self.offset = offset

    def __repr__(self) -> str:
        return (
            f"ShardedTensor(shape={tuple(self.global_shape)}, offset={self.offset}, "
            f"numel={self.local.numel()}, dtype={self.local.dtype})"
        )


class ShardedDataParallel(nn.Module):
    """ZeRO stage 1, 2 or 3 around ``module`` (see the module docstring).

    Args:
        module: The plain model, on its device (CPU for native/gloo, this rank's GPU for nccl).
        stage: 1, 2 or 3.
        group: The ranks to shard across; the default group when ``None``.
        unit_mb: Merge small layers into units of at least this many MiB; ``None``: 1 MiB on
            CPU, 32 MiB on CUDA (``grouping.default_unit_mb``).
        prefetch: Units to all-gather ahead of the one in use (stage 3).
        mixed_precision: Compute and reduce dtypes, fp32 master weights.
        init_sync: Broadcast rank 0's parameters and buffers first.
        reorder: After the first backward, re-form the units in the order modules ran (rank
            0's order) when that differs from registration order. It happens before the first
            optimizer step and moves parameters and gradients one unit at a time.

    ``state_dict()`` returns full tensors under the plain model's names on every rank (a
    collective: every rank must call it); ``sharded_state_dict()`` returns this rank's shards.

    Raises:
        InvalidArgumentError: a bad stage, different models on different ranks, parameters on
            several devices, or a module owning parameters of several dtypes.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int = 3,
        group: ProcessGroup | None = None,
        unit_mb: float | None = None,
        prefetch: int = 1,
        mixed_precision: MixedPrecision | None = None,
        init_sync: bool = True,
        reorder: bool = True,
    ) -> None:
        super().__init__()
        if stage not in (1, 2, 3):
            raise InvalidArgumentError(f"ShardedDataParallel: stage must be 1, 2 or 3, not {stage}")
        if (unit_mb is not None and unit_mb < 0) or prefetch < 0:
            raise InvalidArgumentError(
                f"ShardedDataParallel: unit_mb ({unit_mb}) and prefetch ({prefetch}) must be >= 0"
            )
        self.module = module
        self.stage = stage
        self.group = group if group is not None else default_group()
        self.prefetch = int(prefetch)
        self.mixed_precision = mixed_precision or MixedPrecision()
        owned = owned_parameters(module)
        named = [np for params in owned.values() for np in params]
        if not named:
            raise InvalidArgumentError("ShardedDataParallel: the model has no parameters")
        check_same_model(
            self.group, [n for n, _ in named], [p for _, p in named], "ShardedDataParallel"
        )
        self._device = named[0][1].device
        if init_sync:
            broadcast_coalesced(
                self.group,
                [p.data for _, p in named] + [b for b in module.buffers() if b.numel() > 0],
                0,
                25 * _MIB,
            )
        # Two more communicators, so all-gathers and reductions each keep their own order;
        # their collectives overlap forward and backward compute.
        ranks = list(range(self.group.world_size))
        gather_group = self.group.new_group(ranks, overlap_compute=True)
        reduce_group = self.group.new_group(ranks, overlap_compute=True)
        assert gather_group is not None and reduce_group is not None
        self._gather_group: ProcessGroup = gather_group
        self._reduce_group: ProcessGroup = reduce_group

        self._by_name = dict(named)
        self._dtypes = {n: p.dtype for n, p in named}
        self._module_names = {
            mod: mname for mname, mod in module.named_modules(remove_duplicate=False)
        }
        self._handles: list[Any] = []
        self._units: list[Unit] = []
        if unit_mb is None:
            unit_mb = default_unit_mb(self._device)
        self._install(plan_units(module, int(unit_mb * _MIB)), [])
        pre_forward = weak_method(self, "_pre_forward")
        post_forward = weak_method(self, "_post_forward")
        for mod in self._module_units:
            self._handles.append(mod.register_forward_pre_hook(pre_forward))
            self._handles.append(mod.register_forward_hook(post_forward))
        grad_hook = weak_method(self, "_grad_hook")
        for _, p in named:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(grad_hook))  # type: ignore[no-untyped-call]
        if self.group.rank == 0:
            _log.info("%s", self.plan())
        self._trace: list[str] | None = []  # module names in the order the first forward ran
        self._traced = False
        self._reorder = reorder
        self._optimizer: torch.optim.Optimizer | None = None
        # per-forward / per-backward state
        self._require_sync = True
        self._sync_backward = True
        self._needs_gather = False  # stages 1/2: an optimizer stepped the shards
        self._fwd_next = 0
        self._bw_next = 0
        self._rs_next = 0
        self._callback_queued = False
        self._inflight: list[tuple[Unit, Work, torch.Tensor]] = []
        self._in_forward = False
        self._unit_stack: list[list[Unit]] = []  # units of the modules running now
        self._drop: list[Unit] = []  # gathered in backward only to keep ranks in step
        self._releasable: list[Unit] = []  # done in backward, freed at the next event
        self._graph_done = True
        me = weakref.ref(self)

        def after_step(opt: torch.optim.Optimizer, *_: Any) -> None:
            wrapper = me()
            if wrapper is not None:
                wrapper._after_step(opt)

        self._handles.append(register_optimizer_step_post_hook(after_step))
        remove_hooks_when_collected(self, self._handles)

    def _install(self, plan: UnitPlan, order: list[str]) -> None:
        """Builds the units of ``plan`` and everything derived from them.

        The parameters' current values (``.data``) are laid out; ``order`` (module names as
        they ran) fixes the backward order of units, registration order when empty.
        """
        mp = self.mixed_precision
        self._plan = plan
        self._units = []
        for spec in plan.units:
            unit = Unit(
                index=spec.index,
                names=list(spec.params),
                params=[self._by_name[n] for n in spec.params],
                world_size=self.group.world_size,
                rank=self.group.rank,
                cdtype=mp.compute_dtype(spec.dtype),
                wdtype=mp.master_dtype(spec.dtype),
                rdtype=mp.reduction_dtype(spec.dtype),
                modules=list(spec.modules),
            )
            unit.build(self._device, shard_is_view=self.stage < 3 and unit.cdtype == unit.wdtype)
            self._units.append(unit)
        self._unit_of = {id(p): u for u in self._units for p in u.params}
        self._slot = {id(p): i for u in self._units for i, p in enumerate(u.params)}
        self._local_ids = {id(loc) for u in self._units for loc in u.locals}
        position = {name: i for i, name in enumerate(order)}
        self._module_units: dict[nn.Module, list[Unit]] = {}
        last_use: dict[int, float] = {}
        for pos, (mname, mod) in enumerate(self.module.named_modules(remove_duplicate=False)):
            units = sorted(
                {
                    u.index: u
                    for p in mod.parameters(recurse=False)
                    if (u := self._unit_of.get(id(p))) is not None
                }.values(),
                key=lambda u: u.index,
            )
            if not units:
                continue
            where = position.get(mname, len(position) + pos)
            for u in units:
                last_use[u.index] = max(last_use.get(u.index, -1), where)
            if mod not in self._module_units:
                self._module_units[mod] = units
                for u in units:
                    u.expected_uses += 1
        # Backward gathers units in the reverse order of their last use in forward.
        self._bw_order = sorted(self._units, key=lambda u: (-last_use[u.index], -u.index))
        self._bw_pos = {u.index: i for i, u in enumerate(self._bw_order)}
        self._rs_order = [u for u in reversed(self._units) if u.trainable]
        if self.stage == 3:
            for u in self._units:
                u.free()

    # -- public --------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module, gathering units as its modules need them."""
        self._begin_forward()
        cdt = self.mixed_precision.param_dtype
        if cdt is not None:
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(cdt) if t.is_floating_point() else t, (args, kwargs)
            )
        saved: contextlib.AbstractContextManager[Any] = (
            torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            if self.stage == 3 and torch.is_grad_enabled()
            else contextlib.nullcontext()
        )
        try:
            with saved:
                out = self.module(*args, **kwargs)
        finally:
            self._in_forward = False
            self._unit_stack.clear()
        self._end_forward()
        return out

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's local (sharded) parameters: what an optimizer should step."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Local parameters under the plain model's names (tied parameters once)."""
        for u in self._units:
            for name, loc in zip(u.names, u.locals, strict=True):
                yield (f"{prefix}.{name}" if prefix else name), loc

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full-size local gradients without communicating.

        The first synchronised backward after it reduces the sum. Costs one full gradient
        buffer per unit while it lasts (stage 1 keeps it anyway); without ``no_sync``,
        accumulation keeps gradients sharded and communicates every backward.
        """
        prev, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = prev

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the local gradients and any gradients accumulated under ``no_sync``."""
        for u in self._units:
            for loc in u.locals:
                loc.grad = None
            u.grad_full = None if self.stage > 1 else u.grad_full
            u.grad_filled = [False] * len(u.params)
            u.held_grads.clear()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients to a global norm across all ranks; returns that norm."""
        grads = [u.shard_grad for u in self._units if u.shard_grad is not None]
        norm_type = float(norm_type)
        dev = self._device
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() for g in grads]).max() if grads else None
            total = (local if local is not None else torch.zeros((), device=dev)).float()
            total = total.reshape(1).clone()
            self.group.all_reduce(total, op="max")
        else:
            parts = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
            local = (
                torch.stack(parts).pow(norm_type).sum() if parts else torch.zeros((), device=dev)
            )
            total = local.reshape(1).clone()
            self.group.all_reduce(total, op="sum")
            total = total.pow(1.0 / norm_type)
        norm = total[0]
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    def plan(self) -> str:
        """The units: ``N layers -> U units, G all-gathers per step``, then one row per unit."""
        head = f"ShardedDataParallel stage {self.stage} on {self.group.world_size} ranks"
        return f"{head}: {self._plan.table(self.stage)}"

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds now for parameters, master copies and gradients."""
        out = {"params": 0, "master": 0, "grads": 0}
        for u in self._units:
            for k, v in u.nbytes().items():
                out[k] += v
        return out

    # -- state dicts -----------------------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Full tensors under the plain model's names (collective: call it on every rank)."""
        full: dict[int, torch.Tensor] = {}
        for u in self._units:
            values = self._gather_master(u)
            for p, name, o in zip(u.params, u.names, u.offsets, strict=True):
                full[id(p)] = values[o : o + p.numel()].view(p.shape).to(self._dtypes[name])
        out: dict[str, Any] = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            out[key] = full[id(value)] if id(value) in full else value.detach()
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads full tensors (as from the plain model's ``state_dict``) into the shards."""
        expected = self.module.state_dict(keep_vars=True)
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        bad = [
            f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
            for k, v in expected.items()
            if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)
        ]
        if bad or (strict and (missing or unexpected)):
            raise InvalidArgumentError(
                "load_state_dict: "
                + "; ".join(
                    part
                    for part in (
                        f"missing keys {missing}" if missing else "",
                        f"unexpected keys {unexpected}" if unexpected else "",
                        f"shape mismatches {bad}" if bad else "",
                    )
                    if part
                )
            )
        for key, value in expected.items():
            if key not in state_dict:
                continue
            src = state_dict[key]
            u = self._unit_of.get(id(value))
            if u is None:
                value.copy_(src)
                continue
            i = next(j for j, p in enumerate(u.params) if p is value)
            a, b = u.local_ranges[i]
            flat = src.detach().reshape(-1).to(u.wdtype)
            u.locals[i].data.copy_(flat[a:b])
            if u.gathered and self.stage < 3:
                o = u.offsets[i]
                u.full[o : o + value.numel()].copy_(flat)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards (``ShardedTensor``) and buffers, under the plain model's names."""
        out: dict[str, Any] = {}
        shards: dict[int, ShardedTensor] = {}
        for u in self._units:
            for p, loc, (a, _b) in zip(u.params, u.locals, u.local_ranges, strict=True):
                shards[id(p)] = ShardedTensor(loc.detach(), p.shape, a)
        for key, value in self.module.state_dict(keep_vars=True).items():
            out[key] = shards[id(value)] if id(value) in shards else value.detach()
        return out

    def sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's optimizer state by parameter name, without communication.

        Elementwise state (Adam's moments) comes as ``ShardedTensor`` (the same element range
        as the parameter's shard); other values (``step``) as they are. ``param_groups`` list
        parameter names instead of indices.
        """
        state: dict[str, dict[str, Any]] = {}
        names: dict[int, str] = {}
        for u in self._units:
            for p, name, loc, (a, _b) in zip(
                u.params, u.names, u.locals, u.local_ranges, strict=True
            ):
                names[id(loc)] = name
                entries = optimizer.state.get(loc)
                if not entries:
                    continue
                state[name] = {
                    k: ShardedTensor(v.detach(), p.shape, a)
                    if torch.is_tensor(v) and v.dim() == 1 and v.shape == loc.shape
                    else v
                    for k, v in entries.items()
                }
        return {"state": state, "param_groups": groups_by_name(optimizer, names)}

    def refresh(self) -> None:
        """Re-gathers parameters from the shards before the next forward.

        Call it after writing into the local shards directly (a checkpoint loader does);
        ``load_state_dict`` and optimizer steps do it for you. Stage 3 always gathers.
        """
        if self.stage < 3:
            self._needs_gather = True

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state with full tensors, keyed by parameter name (collective)."""
        local_name = {
            id(loc): name for u in self._units for name, loc in zip(u.names, u.locals, strict=True)
        }
        state: dict[str, dict[str, Any]] = {}
        for u in self._units:
            keys = sorted(
                {
                    k
                    for loc in u.locals
                    for k, v in optimizer.state.get(loc, {}).items()
                    if torch.is_tensor(v) and v.shape == loc.shape and v.dim() == 1
                }
            )
            for k in keys:
                values = self._gather_state(u, optimizer, k)
                for p, name, o, loc in zip(u.params, u.names, u.offsets, u.locals, strict=True):
                    if loc in optimizer.state:
                        state.setdefault(name, {})[k] = values[o : o + p.numel()].view(p.shape)
            for name, loc in zip(u.names, u.locals, strict=True):
                for k, v in optimizer.state.get(loc, {}).items():
                    if k not in keys:
                        state.setdefault(name, {})[k] = v.clone() if torch.is_tensor(v) else v
        return {"state": state, "param_groups": groups_by_name(optimizer, local_name)}

    @torch.no_grad()
    def load_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> None:
        """Loads ``optim_state_dict()`` output (full tensors by name) into this rank's shards.

        The unit layout is fixed from here on (no re-forming after the first backward).
        """
        self._trace = None
        by_name = {name: (u, i) for u in self._units for i, name in enumerate(u.names)}
        unknown = [n for n in state_dict["state"] if n not in by_name]
        if unknown:
            raise InvalidArgumentError(
                f"load_optim_state_dict: state for parameters the model does not have: {unknown}"
            )
        for name, entries in state_dict["state"].items():
            u, i = by_name[name]
            loc, (a, b) = u.locals[i], u.local_ranges[i]
            new: dict[str, Any] = {}
            for k, v in entries.items():
                if torch.is_tensor(v) and v.shape == u.params[i].shape and v.dim() > 0:
                    new[k] = v.reshape(-1)[a:b].to(device=loc.device, dtype=loc.dtype).clone()
                else:
                    new[k] = v.clone() if torch.is_tensor(v) else v
            optimizer.state[loc] = new
        for g, saved in zip(optimizer.param_groups, state_dict["param_groups"], strict=False):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Points an optimizer built over the plain model's parameters at the local shards.

        Param groups and their hyperparameters are kept; the same optimizer object is returned.

        Raises:
            InvalidArgumentError: the optimizer holds foreign tensors or already has state.
        """
        local_of = {
            id(p): loc for u in self._units for p, loc in zip(u.params, u.locals, strict=True)
        }
        if any(optimizer.state.values()):
            raise InvalidArgumentError(
                "distribute(): the optimizer already has state; wrap the model before the first "
                "optimizer step (load optimizer checkpoints with model.load_optim_state_dict)"
            )
        for g in optimizer.param_groups:
            foreign = [p for p in g["params"] if id(p) not in local_of]
            if foreign:
                raise InvalidArgumentError(
                    f"distribute(): the optimizer holds {len(foreign)} tensors that are not "
                    "parameters of the model; build the optimizer from model.parameters()"
                )
            g["params"] = [local_of[id(p)] for p in g["params"]]
        optimizer.state.clear()
        self._optimizer = optimizer
        return optimizer

    def remove_hooks(self) -> None:
        """Detaches every hook (the wrapper stops working)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- gathering -------------------------------------------------------------------------------

    def _gather(self, u: Unit) -> None:
        """Starts the all-gather of ``u``'s parameters into ``u.full``.

        Always issues one collective: callers follow a schedule every rank follows, so
        skipping one here would pair this rank's next all-gather with another unit's.
        """
        self._wait(u)
        u.alloc()
        src = u.gather_source()
        with _preserve_version(u.full):
            work = self._gather_group.all_gather(u.full, src, async_op=True)
        assert work is not None
        u.gather_work, u.gather_input = work, src

    def _wait(self, u: Unit) -> None:
        if u.gather_work is not None:
            with _preserve_version(u.full):
                u.gather_work.wait()
            u.gather_work = u.gather_input = None
            u.gathered = True

    def _release(self, u: Unit) -> None:
        self._wait(u)
        u.free()

    def _gather_master(self, u: Unit) -> torch.Tensor:
        """Every rank's master shard of ``u``, concatenated (a fresh tensor)."""
        out = torch.empty(u.padded, dtype=u.wdtype, device=self._device)
        self.group.all_gather(out, u.shard.detach().clone() if u.shard_is_view else u.shard)
        return out

    def _gather_state(self, u: Unit, optimizer: torch.optim.Optimizer, key: str) -> torch.Tensor:
        lo = u.rank * u.shard_numel
        flat: torch.Tensor | None = None
        for loc, o, (a, b) in zip(u.locals, u.offsets, u.local_ranges, strict=True):
            v = optimizer.state.get(loc, {}).get(key)
            if v is None or b <= a:
                continue
            if flat is None:
                flat = torch.zeros(u.shard_numel, dtype=v.dtype, device=self._device)
            flat[o + a - lo : o + b - lo].copy_(v)
        if flat is None:
            flat = torch.zeros(u.shard_numel, dtype=u.wdtype, device=self._device)
        out = torch.empty(u.padded, dtype=flat.dtype, device=self._device)
        self.group.all_gather(out, flat)
        return out

    # -- forward ---------------------------------------------------------------------------------

    def _begin_forward(self) -> None:
        self._in_forward = True
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
                if u.gathered or u.gather_work is not None:
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
            if not u.gathered and u.gather_work is None:  # freed, then used again
                self._gather(u)
        self._wait(u)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() != -1:  # recomputed in backward (checkpointing)
            if self.stage == 3:
                self._flush_releases()
                self._pre_backward(self._module_units[module])
            return
        if not self._in_forward:
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
        if torch._C._current_graph_task_id() != -1 or not self._in_forward:
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
            u.bw_issued = u is keep
        self._bw_next = 0

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Stages 1/2: an optimizer stepped; if it holds our shards, re-gather before forward."""
        if self.stage < 3 and not self._needs_gather:
            self._needs_gather = any(
                id(p) in self._local_ids for g in optimizer.param_groups for p in g["params"]
            )

    # -- backward --------------------------------------------------------------------------------

    def _queue_final(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_backward)
            for u in self._units:
                u.grads_pending = sum(p.requires_grad for p in u.params)
                u.launched = False
                u.touched = False
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
        if v.bw_issued:
            return
        self._gather(v)
        v.bw_issued = True
        if v.fwd_uses == 0:  # this rank ran none of its modules: drop it once gathered
            self._drop.append(v)

    def _pre_backward(self, units: list[Unit]) -> None:
        self._queue_final()
        for u in units:
            self._issue_backward_gathers(u, self.prefetch)
            if not u.gathered and u.gather_work is None:
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
            and (u.gathered or u.gather_work is not None)
            and u not in self._releasable
        ):
            self._releasable.append(u)

    def _flush_releases(self) -> None:
        while self._releasable:
            self._release(self._releasable.pop())

    def _grad_hook(self, param: torch.Tensor) -> None:
        self._queue_final()
        self._flush_releases()
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        u, i = self._unit_of[id(param)], self._slot[id(param)]
        if u.launched:
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

    def _touch(self, u: Unit) -> None:
        """First gradient (or the final flush) of ``u`` in this backward."""
        if u.touched:
            return
        u.touched = True
        if u.shown and self._stale(u):
            u.grad_filled = [False] * len(u.params)  # the optimizer dropped them
            u.held_grads.clear()
        u.shown = False

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
        u.launched = True
        assert u.grad_full is not None
        if self.stage == 1:
            work = self._reduce_group.all_reduce(u.grad_full, op="avg", async_op=True)
            out = u.grad_full
        else:
            u.fresh = u.shard_grad is None or not u.locals_have_grads()
            if u.fresh and u.shard_grad is not None and u.rdtype == u.wdtype:
                out = u.shard_grad
            else:
                out = torch.empty(u.shard_numel, dtype=u.rdtype, device=self._device)
            work = self._reduce_group.reduce_scatter(out, u.grad_full, op="avg", async_op=True)
        assert work is not None
        self._inflight.append((u, work, out))
        # A host-blocking wait here could close a cycle with a rank that has yet to reach a
        # gather this rank has not issued (ranks running modules in different orders); CUDA
        # waits only order streams.
        blocking = self._device.type == "cuda" or self._bw_next >= len(self._bw_order)
        while len(self._inflight) > _MAX_INFLIGHT and (
            blocking or self._inflight[0][1].is_completed()
        ):
            self._finish(*self._inflight.pop(0))

    def _finish(self, u: Unit, work: Work, out: torch.Tensor) -> None:
        work.wait()
        if self.stage == 1:
            lo = u.rank * u.shard_numel
            owned = out[lo : lo + u.shard_numel]
            if u.rdtype == u.wdtype:
                u.shard_grad = owned
            else:
                u.shard_grad = owned.to(u.wdtype)
            return
        if out is not u.shard_grad:
            if u.fresh or u.shard_grad is None:
                u.shard_grad = out if out.dtype == u.wdtype else out.to(u.wdtype)
            else:
                u.shard_grad.add_(out)
        u.grad_full = None
        u.grad_filled = []

    def _end_backward(self) -> None:
        self._callback_queued = False
        try:
            if self.stage == 3:
                self._issue_backward_gathers(None, 0)
            if self._sync_backward:
                for u in self._rs_order[self._rs_next :]:
                    self._launch(u)
                self._rs_next = len(self._rs_order)
                while self._inflight:
                    self._finish(*self._inflight.pop(0))
                for u in self._units:
                    u.publish_grads()
            else:
                for u in self._units:
                    u.mark_accumulating()
            for u in self._units:
                if self.stage == 3:
                    self._release(u)
                    u.bw_issued = False
                u.unpacked = 0
            self._graph_done = True  # a new forward starts counting saved tensors afresh
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

    # -- re-forming units --------------------------------------------------------------------------

    def _optimizer_has_state(self) -> bool:
        opt = self._optimizer
        return opt is not None and any(opt.state.values())

    @torch.no_grad()
    def _reform(self, trace: list[str]) -> None:
        """Re-forms the units in rank 0's execution order if that changes them.

        Runs at the end of the first synchronised backward, before any optimizer step (no
        optimizer state exists yet). Local parameter objects are kept, so an optimizer built
        over them stays valid; parameters and the reduced gradients move to the new layout,
        one old unit materialised at a time.
        """
        names = [self._module_names[m] for m in self._module_units]
        index = {n: i for i, n in enumerate(names)}
        mine = [index[n] for n in dict.fromkeys(trace) if n in index]
        mine += [i for i in range(len(names)) if i not in set(mine)]
        order_t = torch.tensor(mine, dtype=torch.int64, device=self._device)
        self.group.broadcast(order_t, src=0)
        order = [names[i] for i in order_t.tolist()]
        plan = plan_units(self.module, self._plan.threshold, order, dtypes=self._dtypes)
        if [u.params for u in plan.units] == [u.params for u in self._plan.units]:
            return
        old_units, old_unit_of, old_slot = self._units, self._unit_of, self._slot
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
                p = self._by_name[name]
                old = old_unit_of[id(p)]
                o, n = old.offsets[old_slot[id(p)]], p.numel()
                values, grad = materialise(old)
                p.data = values[o : o + n].clone().view(p.shape)
                if grad is not None and p.requires_grad:
                    grads[id(p)] = grad[o : o + n].clone()
        cache.clear()
        self._install(plan, order)
        for u in self._units:
            fresh = u.locals
            u.locals = [old_locals[id(p)] for p in u.params]
            for loc, new in zip(u.locals, fresh, strict=True):
                loc.data = new.data
        self._local_ids = {id(loc) for loc in old_locals.values()}
        for u in self._units:
            if not any(id(p) in grads for p in u.params):
                continue
            full = torch.zeros(u.padded, dtype=u.rdtype if self.stage == 1 else u.wdtype)
            full = full.to(self._device)
            for p, o in zip(u.params, u.offsets, strict=True):
                if id(p) in grads:
                    full[o : o + p.numel()].copy_(grads[id(p)])
            lo = u.rank * u.shard_numel
            if self.stage == 1:
                u.grad_full = full
                u.grad_filled = [True] * len(u.params)
                owned = full[lo : lo + u.shard_numel]
                u.shard_grad = owned if u.rdtype == u.wdtype else owned.to(u.wdtype)
            else:
                u.shard_grad = full[lo : lo + u.shard_numel].clone()
            u.publish_grads()

    def _full_grads(self, u: Unit) -> torch.Tensor | None:
        """``u``'s reduced gradients, full length (stage 1 keeps them; else all-gathered)."""
        if not u.trainable:
            return None
        if self.stage == 1:
            return u.grad_full
        shard = u.shard_grad
        if shard is None:
            shard = torch.zeros(u.shard_numel, dtype=u.wdtype, device=self._device)
        out = torch.empty(u.padded, dtype=shard.dtype, device=self._device)
        self.group.all_gather(out, shard)
        return out
