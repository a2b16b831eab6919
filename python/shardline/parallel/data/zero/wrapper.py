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

Optimizers: elementwise ones (SGD, Adam, AdamW, Adagrad, ...) step 1-D shards; ones that look
at whole parameters (Adafactor, Muon, or registered with ``register_optimizer``) get their
parameters whole, each on one rank; L-BFGS and SparseAdam are refused (``optimizers``).

Elastic training: ``regroup(group)`` moves the wrapper onto a new group in place, laid out as a
fresh wrapper on that group (see its docstring).

Not supported yet: deferred (meta-device) initialisation, buffers kept in sync after
construction (BatchNorm statistics stay per rank, as in FSDP).
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
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from shardline.comm.coalesced import broadcast_coalesced
from shardline.comm.group import ProcessGroup
from shardline.comm.world import default_group
from shardline.compression.codec import Compressor
from shardline.errors import InvalidArgumentError, ShardlineError
from shardline.parallel._common import (
    ModelParallel,
    check_same_model,
    clip_to_global_norm_,
    remove_hooks_when_collected,
    weak_method,
)
from shardline.parallel.data.compressed import comm_stats, resolve_compression
from shardline.parallel.data.zero.base import TrainingState, ZeroBase
from shardline.parallel.data.zero.binding import OptimizerBinding
from shardline.parallel.data.zero.grouping import (
    check_units,
    default_unit_mb,
    default_units,
    owned_parameters,
    plan_units,
    unit_blocks,
)
from shardline.parallel.data.zero.held import HeldSteps
from shardline.parallel.data.zero.layout import UnitLayout, move_buffers
from shardline.parallel.data.zero.schedule import GatherReduceSchedule
from shardline.parallel.data.zero.state_dicts import StateDicts
from shardline.parallel.data.zero.units import Unit
from shardline.parallel.joining import is_joining
from shardline.parallel.placement import placements_of
from shardline.parallel.precision import MixedPrecision

__all__ = ["ShardedDataParallel"]

_log = logging.getLogger("shardline")

_MIB = 1 << 20


class ShardedDataParallel(ZeroBase, ModelParallel):
    """ZeRO stage 1, 2 or 3 around ``module`` (see the module docstring).

    Args:
        module: The plain model, on its device (CPU for native/gloo, this rank's GPU for nccl).
        stage: 1, 2 or 3.
        group: The ranks to shard across; the default group when ``None``.
        unit_mb: Merge small layers into units of at least this many MiB; ``None``: 1 MiB on
            CPU, 32 MiB on CUDA, less for a model under 256 MiB (``grouping.default_unit_mb``).
        units: ``"size"``: units are layers merged up to ``unit_mb``, except that each block
            recomputing in backward is one unit; ``"blocks"``: also every repeated block of
            the model (``parallel.recompute.find_blocks``: FSDP2's ``fully_shard`` per
            block) is one unit when the blocks hold at least ``unit_mb`` each (smaller ones
            merge by size). ``None``: ``"blocks"`` on CUDA without offload, else ``"size"``
            (``grouping.default_units``).
        prefetch: Units to all-gather ahead of the one in use (stage 3).
        mixed_precision: Compute and reduce dtypes, fp32 master weights.
        init_sync: Broadcast rank 0's parameters and buffers first.
        reorder: After the first backward, re-form the units in the order modules ran (rank
            0's order) when that differs from registration order. It happens before the first
            optimizer step and moves parameters and gradients one unit at a time.
        replicate_group: HSDP: the ranks holding the same shards as this one in the other
            replicas (one per replica, each sharding over its own ``group``). Gradient parts
            are averaged over it after each reduction; the model starts as its rank 0's.
            ``sl.distribute(mesh={"dp_replicate": r, "dp_shard": s})`` passes it.
        compression: A gradient compressor (``sl.compression.PowerSGD(rank=4)``, ...) or its name:
            ZeRO-1's all-reduce and ZeRO-2/3's reduce-scatter run compressed, with error
            feedback (whose residual covers the whole unit: ``sl.estimate_memory`` counts it).
            Units kept whole for their optimizer are reduced uncompressed.
        offload: ``"optimizer"``: this rank's shards (fp32 master weights) and so the
            optimizer's state live in host memory, pinned under CUDA, and the optimizer steps
            there (``sl.optim.CPUAdamW`` steps them in Rust); reduced gradients are copied to
            the host as each unit's reduction finishes, and a device copy of the shards in the
            compute dtype serves the all-gathers. ``"cpu"``: no device copy either; the shards
            travel to the device for each all-gather. ``None``: everything on the device.
            With offload under nccl the model may be passed in host memory (one larger than
            the GPU): stage 3 then lays it out on the GPU one unit at a time, each freed before
            the next, and moves its buffers to the GPU; the inputs go to the GPU as usual.
        own_groups: All-gathers and reductions on two communicators of their own, so that they
            overlap compute in their own orders. ``False``: on ``group`` itself, for a caller
            that issues them between computations (a pipeline stage's ``unshard`` and
            ``reduce_grads``, once per step: ``held``).
        symmetric: The unit buffers that live as long as the wrapper in symmetric memory
            (``shardline.symmetric_empty``): stages 1 and 2 gather into it, stage 3 gathers
            from it (without mixed precision), stage 1 all-reduces its gradients in it; those
            collectives read every rank's data where it is, with no copy through the engine's
            slots. ``None``: on CPU
            where the groups have it (the native engine, one host) unless
            ``SHARDLINE_SYMMETRIC=0``, ordinary tensors where a rank has no room; ``False``:
            ordinary tensors; ``True``: always (an error where it cannot be), and ZeRO-2/3
            gradient buffers from a pool there too (three of the largest unit's, for units of
            up to 64 MiB of gradients, kept between steps). ``self.symmetric`` says which.

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
        replicate_group: ProcessGroup | None = None,
        compression: str | Compressor | None = None,
        offload: str | None = None,
        units: str | None = None,
        own_groups: bool = True,
        symmetric: bool | None = None,
    ) -> None:
        super().__init__()
        if stage not in (1, 2, 3):
            raise InvalidArgumentError(f"ShardedDataParallel: stage must be 1, 2 or 3, not {stage}")
        if offload not in (None, "optimizer", "cpu"):
            raise InvalidArgumentError(
                f"ShardedDataParallel: offload must be None, 'optimizer' or 'cpu', not {offload!r}"
            )
        check_units(units, "ShardedDataParallel")
        self.offload = offload
        if (unit_mb is not None and unit_mb < 0) or prefetch < 0:
            raise InvalidArgumentError(
                f"ShardedDataParallel: unit_mb ({unit_mb}) and prefetch ({prefetch}) must be >= 0"
            )
        self.module = module
        self.stage = stage
        self.group = group if group is not None else default_group()
        self.prefetch = int(prefetch)
        self.mixed_precision = mixed_precision or MixedPrecision()
        self._compression = resolve_compression(compression, None)
        self._synced_steps = 0
        owned = owned_parameters(module)
        named = [np for params in owned.values() for np in params]
        if not named:
            raise InvalidArgumentError("ShardedDataParallel: the model has no parameters")
        # A process joining a running elastic job skips the start-up collectives: the ranks
        # already there move with regroup(), which runs none, and the values come with the
        # restore that follows.
        joining = is_joining()
        self._device = named[0][1].device
        # A model kept in host memory with offload under nccl (one larger than the GPU): its
        # units are laid out on the GPU one at a time, each freed before the next (stage 3).
        self._host_model = (
            offload is not None and self._device.type == "cpu" and self.group.device.type == "cuda"
        )
        if self._host_model:
            self._device = self.group.device
            move_buffers(module, self._device)
        if not joining:
            check_same_model(
                self.group,
                [n for n, _ in named],
                [p for _, p in named],
                "ShardedDataParallel",
                device=self.group.device,
            )
        replicas = replicate_group is not None and replicate_group.world_size > 1
        self._replicate = replicate_group if replicas else None
        if init_sync and not joining:
            tensors = [p.data for _, p in named] + [b for b in module.buffers() if b.numel() > 0]
            for g in (self._replicate, self.group):  # the replicas' first, then the shards'
                if g is not None:
                    broadcast_coalesced(g, tensors, 0, 25 * _MIB)
        # Two more communicators, so all-gathers and reductions each keep their own order;
        # their collectives overlap forward and backward compute.
        self._own_groups = own_groups
        self._gather_group, self._reduce_group = self._new_groups(self.group)
        self._symmetric_choice = symmetric  # the layout decides ``symmetric`` from it

        # Parameters that are slices of bigger tensors (tensor parallelism inside): where they
        # lie, for checkpoints and full state dicts (read now, while they hold values).
        self._placements = placements_of(module)
        self._by_name = dict(named)
        self._dtypes = {n: p.dtype for n, p in named}
        self._module_names = {
            mod: mname for mname, mod in module.named_modules(remove_duplicate=False)
        }
        self._handles: list[Any] = []
        self._units: list[Unit] = []
        self._whole = frozenset()
        self._whole_reasons: dict[str, str] = {}  # optimizer class -> why it needs whole ones
        self._checked_optimizers = weakref.WeakSet()
        if unit_mb is None:
            unit_mb = default_unit_mb(self._device, sum(p.nbytes for _, p in named))
        threshold = int(unit_mb * _MIB)
        rule = units or default_units(self._device, offload)
        blocks = unit_blocks(module, rule, min_bytes=threshold)
        self._layout = UnitLayout(self)  # the units: laid out and re-formed (layout.py)
        self._layout._install(plan_units(module, threshold, blocks=blocks), [])
        # The gathers and reductions of each step: the hooks call the schedule (schedule.py).
        self._schedule = GatherReduceSchedule(self, self._layout)
        pre_forward = weak_method(self._schedule, "_pre_forward")
        post_forward = weak_method(self._schedule, "_post_forward")
        for mod in self._module_units:
            self._handles.append(mod.register_forward_pre_hook(pre_forward))
            self._handles.append(mod.register_forward_hook(post_forward))
        grad_hook = weak_method(self._schedule, "_grad_hook")
        for _, p in named:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(grad_hook))  # type: ignore[no-untyped-call]
        if self.group.rank == 0:
            _log.info("%s", self.plan())
        self._trace: list[str] | None = []  # module names in the order the first forward ran
        self._traced = False
        self._reorder = reorder
        self._optimizer: torch.optim.Optimizer | None = None
        self._schedule.reset()  # no step under way
        # The other parts, each with one role: state dicts (state_dicts.py), the steps a
        # caller drives (held.py), optimizers pointed at the shards (binding.py).
        self._state_dicts = StateDicts(self, self._layout)
        self._held_steps = HeldSteps(self, self._layout, self._schedule)
        self._binding = OptimizerBinding(self, self._layout)
        me = weakref.ref(self)

        def before_step(opt: torch.optim.Optimizer, *_: Any) -> None:
            wrapper = me()
            if wrapper is not None and opt not in wrapper._checked_optimizers:
                wrapper._binding.apply_layout(opt, stepping=True)

        def after_step(opt: torch.optim.Optimizer, *_: Any) -> None:
            wrapper = me()
            if wrapper is not None:
                wrapper._schedule._after_step(opt)

        self._handles.append(register_optimizer_step_pre_hook(before_step))
        self._handles.append(register_optimizer_step_post_hook(after_step))
        remove_hooks_when_collected(self, self._handles)

    # -- public --------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module, gathering units as its modules need them."""
        if self._held:
            raise ShardlineError(
                "ShardedDataParallel: forward() while unshard() holds the parameters; run the "
                "inner module, or call reduce_grads() / reshard() first"
            )
        self._schedule._begin_forward()
        cdt = self.mixed_precision.param_dtype
        if cdt is not None:
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(cdt) if t.is_floating_point() else t, (args, kwargs)
            )
        saved: contextlib.AbstractContextManager[Any] = (
            torch.autograd.graph.saved_tensors_hooks(self._schedule._pack, self._schedule._unpack)
            if self.stage == 3 and torch.is_grad_enabled()
            else contextlib.nullcontext()
        )
        try:
            with saved:
                out = self.module(*args, **kwargs)
        finally:
            self._state = TrainingState.IDLE
            self._unit_stack.clear()
        self._schedule._end_forward()
        return out

    # -- steps a caller drives (``held.HeldSteps``) ---------------------------------------------

    def unshard(self, *, accumulate: bool = False) -> None:
        """Makes every unit whole and keeps it so until ``reduce_grads()`` or ``reshard()``.

        ``accumulate``: the coming backwards' gradients add up whole, one buffer per unit.
        """
        self._held_steps.unshard(accumulate=accumulate)

    def fold_grads(self) -> None:
        """Adds gradients set by hand (not by autograd's accumulation) into the step's buffers."""
        self._held_steps.fold_grads()

    def whole_grad(self, p: torch.Tensor) -> torch.Tensor:
        """The step's whole gradient of the (whole) parameter ``p`` so far, in the reduce dtype."""
        return self._held_steps.whole_grad(p)

    def reduce_grads(self) -> None:
        """Ends an accumulating hold: one reduction per unit, this rank's parts kept."""
        self._held_steps.reduce_grads()

    def reshard(self) -> None:
        """Ends a hold: ZeRO-3 frees the whole parameters; the module hooks resume."""
        self._held_steps.reshard()

    def whole_parameters(
        self, *, writeback: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """Inside, the module's parameters are whole and hold the master values."""
        return self._held_steps.whole_parameters(writeback=writeback)

    # -- state dicts (``state_dicts.StateDicts``) ------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Full tensors under the plain model's names (collective: call it on every rank)."""
        return self._state_dicts.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads full tensors (as from the plain model's ``state_dict``) into the shards."""
        return self._state_dicts.load_state_dict(state_dict, strict, assign)

    def layout(self) -> dict[str, Any]:
        """How this wrapper lays state out (recorded in checkpoints, for people to read)."""
        return self._state_dicts.layout()

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards (one-range ``Shard``s) and buffers, under the plain model's names."""
        return self._state_dicts.sharded_state_dict()

    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        """Takes ``sharded_state_dict()``'s shape back; parameters are re-gathered before use."""
        self._state_dicts.load_sharded_state_dict(sd)

    def sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's optimizer state by parameter name, without communication."""
        return self._state_dicts.sharded_optim_state_dict(optimizer)

    def load_sharded_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]
    ) -> None:
        """Takes ``sharded_optim_state_dict()``'s shape back into ``optimizer`` (this rank's)."""
        self._state_dicts.load_sharded_optim_state_dict(optimizer, sd)

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state with full tensors, keyed by parameter name (collective)."""
        return self._state_dicts.optim_state_dict(optimizer)

    def load_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> None:
        """Loads ``optim_state_dict()`` output (full tensors by name) into this rank's shards."""
        self._state_dicts.load_optim_state_dict(optimizer, state_dict)

    def refresh(self) -> None:
        """Re-gathers parameters from the shards before the next forward (after direct writes)."""
        self._state_dicts.refresh()

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
        if self._model_group is None:
            return clip_to_global_norm_(grads, grads, self.group, max_norm, norm_type, self._device)
        # Tensor parallelism inside: each parameter's part, counted once over the mesh.
        named = [
            (name, loc.grad)
            for u in self._units
            for name, loc in zip(u.names, u.locals, strict=True)
            if loc.grad is not None and loc.grad.numel()
        ]
        return clip_to_global_norm_(
            [g for _, g in named], grads, self._norm_groups(self.group), max_norm, norm_type,
            self._device, copies=self._copies_of([n for n, _ in named]),
        )  # fmt: skip

    def plan(self) -> str:
        """The units: ``N layers -> U units, G all-gathers per step``, then one row per unit.

        Units kept whole for an optimizer are marked with their rank, and the optimizer and
        its reason are named.
        """
        return self._layout.plan()

    @property
    def compression(self) -> Compressor | None:
        """The gradient compressor, or ``None``."""
        return self._compression

    def comm_stats(self) -> dict[str, Any]:
        """Bytes this rank sent and received for the model so far.

        In total, per op kind and per synchronised step (``shardline.comm.traffic`` says how
        they are counted), over its gather, reduce and (HSDP) replica groups.
        """
        groups = [self._gather_group, self._reduce_group, self._replicate]
        counts = [g.traffic() for g in {id(g): g for g in groups if g is not None}.values()]
        return comm_stats(counts, self._compression, self._synced_steps)

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds now: parameters, master copies and gradients on its device.

        ``host``: what offload keeps in host memory (shards and their gradients). ``grads``
        counts the idle part of a ZeRO-2/3 gradient pool in symmetric memory too.
        """
        out = {"params": 0, "master": 0, "grads": 0, "host": 0}
        for u in self._units:
            for k, v in u.nbytes().items():
                out[k] += v
        pools = {id(u.grad_pool): u.grad_pool for u in self._units if u.grad_pool is not None}
        out["grads"] += sum(pool.idle() for pool in pools.values())
        return out

    def bind_optimizer(
        self, optimizer: torch.optim.Optimizer, *, shared: bool = False
    ) -> torch.optim.Optimizer:
        """Points an optimizer built over the plain model's parameters at the local shards.

        Param groups and their hyperparameters are kept; the same optimizer object is returned.
        State the optimizer made when it was built (Adagrad's) is cut to the shards; an
        optimizer that looks at whole parameters gets them whole (``optimizers``). ``shared``:
        the optimizer's other tensors are left as they are (other wrappers bind them: the
        chunks of a pipeline rank).

        Raises:
            InvalidArgumentError: the optimizer holds foreign tensors (unless ``shared``), has
                stepped already, or cannot be sharded by ZeRO (the message says what works).
        """
        return self._binding.bind_optimizer(optimizer, shared=shared)

    def regroup(self, group: ProcessGroup) -> None:
        """Moves the wrapper onto ``group`` in place (elastic training: ranks were lost or added).

        Nothing is communicated, on the old group and its all-gather and reduction sub-groups
        (they are dead; shutting the old group down closes them) or on ``group``; what a
        failed step left in flight on the old ones is dropped, and so are gradients. The only
        exchange is the creation of the two sub-groups on ``group`` (through the store, as the
        constructor does), so every rank of ``group`` calls ``regroup``, or the constructor,
        before it creates other sub-groups of ``group``. The wrapper and its local parameter
        objects stay the same, so an optimizer over ``model.parameters()`` stays valid; the
        state of the bound optimizer (and of any other that stepped these shards) for them is
        cleared. Parameter values are zero afterwards: restore model and optimizer state
        through the strategy contract (``sl.checkpoint.load(..., group=group)`` does) before
        training.

        The rule that keeps every rank's units identical: afterwards the wrapper is laid out
        as a fresh ``distribute(module, optimizer, strategy=..., group=group)`` is, with the
        same options, in a process joining a running elastic job (which skips the start-up
        collectives, ``shardline.parallel.joining``): units planned in
        registration order for the new world size (whole units of an optimizer needing whole
        parameters given to ranks by it), the order the old group's first backward re-formed
        them in dropped, and re-forming after the first synchronised backward armed again.
        Survivors and joiners therefore start alike and decide alike: restoring optimizer
        state (``load_sharded_optim_state_dict``, which ``sl.checkpoint.load`` calls) fixes
        the layout on every rank, so none re-forms; without it every rank re-forms in the
        new rank 0's order. (An optimizer that makes state when built, such as Adagrad, must
        have its state restored: a fresh one holds state and does not re-form, a cleared one
        would.)

        Args:
            group: The new group (any world size; this process's rank in it may differ).

        Raises:
            InvalidArgumentError: called during forward or backward, or for hybrid sharding
                (``replicate_group``) or tensor parallelism inside: not supported by elastic
                regroup yet.
        """
        if self._state is TrainingState.FORWARD or torch._C._current_graph_task_id() != -1:
            raise InvalidArgumentError(
                "ShardedDataParallel.regroup() was called during a forward or backward; call it "
                "between steps (after the backward, or after it raised)"
            )
        if self._replicate is not None:
            raise InvalidArgumentError(
                "ShardedDataParallel.regroup(): hybrid sharding (replicate_group, a dp_replicate "
                "mesh axis) is not supported by elastic regroup yet; use ZeRO over one group"
            )
        if self._model_group is not None or self._placements:
            raise InvalidArgumentError(
                "ShardedDataParallel.regroup(): tensor parallelism inside ZeRO is not supported "
                "by elastic regroup yet; use ZeRO over a plain module"
            )
        self.group = group
        self._gather_group, self._reduce_group = self._new_groups(group)
        # symmetric=True gives way where the new group has none: the job goes on
        self._symmetric_choice = None if self._symmetric_choice is not False else False
        self._layout._reinstall(self._binding.forget_shards())
        self._trace, self._traced = [], False
        self._schedule.reset()  # what a failed step left in flight is dropped
        if group.rank == 0:
            _log.info("%s", self.plan())

    def _new_groups(self, group: ProcessGroup) -> tuple[ProcessGroup, ProcessGroup]:
        """The all-gathers' and the reductions' communicators (``own_groups``), or ``group``."""
        if not self._own_groups:
            return group, group
        ranks = list(range(group.world_size))
        gather_group = group.new_group(ranks, overlap_compute=True)
        reduce_group = group.new_group(ranks, overlap_compute=True)
        assert gather_group is not None and reduce_group is not None
        return gather_group, reduce_group

    def remove_hooks(self) -> None:
        """Detaches every hook (the wrapper stops working)."""
        for h in self._handles:
            h.remove()
        self._handles = []
