"""ZeRO-1, -2 and -3 of a pipeline rank's stages over its data-parallel replicas.

The pipeline runs its stages on whole parameters and accumulates whole gradients over the
micro-batches of a step, as with DDP; what ZeRO shards is everything around that. This rank's
parameters are laid end to end in one flat buffer per dtype (a *bucket*), padded to a multiple
of the replicas ``d``; replica ``r`` owns elements ``[r c, (r+1) c)`` (``c`` = padded / d).

- **The optimizer** steps this rank's part only: ``parameters()`` yields one 1-D local
  parameter per original one (the elements of it this replica owns, possibly none), named like
  it, so ``AdamW(model.parameters())`` keeps 1/d of the optimizer state. After its step the
  parameters are all-gathered from the parts before they are used again.
- **Gradients**, once per step after the last micro-batch (tied weights summed first): ZeRO-1
  all-reduces the bucket and keeps this rank's part; ZeRO-2 and -3 reduce-scatter it. Whole
  gradients are dropped then, so between steps each rank holds 1/d of them.
- **Parameters**: ZeRO-1 and -2 keep them whole. ZeRO-3 frees the whole bucket after the step's
  reduction and all-gathers it when the next step (or ``forward``) starts: whole for the
  step's micro-batches, sharded between steps (what torchtitan does for FSDP under a pipeline,
  ``reshard_after_forward=False``, to avoid one all-gather per micro-batch).

Under mixed precision (``param_dtype`` lower than the parameters'), the whole parameters are
that dtype: the parts stay the fp32 masters, each step gathers the whole bucket in bf16 (half
the bytes), and each micro-batch's gradient is added into one fp32 buffer by a hook, as FSDP
accumulates in its ``reduce_dtype``. Without it, the parameters' ``.grad`` are views of that
buffer. Either way the step reduces the buffer as it is, with no whole-size copy.

For the strategy contract, each parameter is a ``Shard`` holding one ``FlatRange``: the
elements this replica owns (where tensor parallelism made the parameter a slice, the boxes of
the whole tensor those elements fill: ``parallel.placement``); Adam's moments follow it.
Buffers (BatchNorm statistics) stay whole, as in the plain pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from shardline.comm.group import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel._common import (
    clip_to_global_norm_,
    remove_hooks_when_collected,
    weak_method,
)
from shardline.parallel.contract import Shard
from shardline.parallel.placement import Placement, place

__all__ = ["ZERO_STAGES", "StageShards"]

ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


class _Bucket:
    """Parameters of one dtype, end to end in one flat buffer, and this replica's part.

    ``compute`` (a lower float dtype, mixed precision) makes the whole parameters that
    dtype: the part stays the master copy in the parameters' own dtype, gradients accumulate
    in it (``grads_in_place``).
    """

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        d: int,
        r: int,
        device: torch.device,
        compute: torch.dtype | None = None,
    ) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.master = self.params[0].dtype  # the part's, the gradients' and the optimizer's
        low = compute is not None and compute.itemsize < self.master.itemsize
        self.dtype = compute if low and compute is not None else self.master  # whole params
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.chunk = -(-total // d)
        self.lo, self.hi = r * self.chunk, (r + 1) * self.chunk
        values = torch.zeros(self.chunk * d, dtype=self.master, device=device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets, strict=True):
                values[off : off + p.numel()].copy_(p.detach().reshape(-1))
        # This replica's part: the master copy the optimizer steps.
        self.part = values[self.lo : self.hi].clone()
        self.full = values if self.dtype == self.master else values.to(self.dtype)
        self.values = self.full  # where the master values are whole (master_values)
        del values
        self._view_params(self.full)
        self.ranges: list[tuple[int, int]] = []  # per parameter, in its flattened coordinates
        self.locals: list[nn.Parameter] = []
        for p, off in zip(self.params, self.offsets, strict=True):
            a = min(max(self.lo - off, 0), p.numel())
            b = max(min(self.hi - off, p.numel()), a)
            self.ranges.append((a, b))
            view = self.part[off + a - self.lo : off + b - self.lo]
            self.locals.append(nn.Parameter(view, requires_grad=p.requires_grad))
        self.grad: torch.Tensor | None = None  # the step's whole gradients (grads_in_place)
        self.views: list[torch.Tensor] = []
        if self.low:  # each micro-batch's low-precision gradient, added to the master's dtype
            hook = [weak_method(self, "_fold", i) for i in range(len(self.params))]
            handles = [
                p.register_post_accumulate_grad_hook(hook[i])  # type: ignore[no-untyped-call]
                for i, p in enumerate(self.params)
                if p.requires_grad
            ]
            remove_hooks_when_collected(self, handles)

    @property
    def low(self) -> bool:
        """Whole parameters in a lower precision than the master part."""
        return self.dtype != self.master

    def _view_params(self, flat: torch.Tensor) -> None:
        """The parameters become views of ``flat`` (their dtype is its)."""
        for p, off in zip(self.params, self.offsets, strict=True):
            p.data = flat[off : off + p.numel()].view(p.shape)

    def free(self) -> None:
        """Drops the whole parameters' memory (they keep their shapes; ZeRO-3)."""
        self.full.untyped_storage().resize_(0)

    def gather(self, dp: ProcessGroup) -> None:
        """Whole parameters again, from every replica's part (cast to their dtype first)."""
        storage = self.full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.full.numel() * self.full.element_size())
        dp.all_gather(self.full, self.part.to(self.dtype))

    @contextmanager
    def master_values(self, dp: ProcessGroup) -> Iterator[None]:
        """Inside, the parameters hold the master values, whole, in ``values``.

        That is ``full`` itself, or (low precision) a copy gathered in the master's dtype,
        which the parameters view until the end.
        """
        if not self.low:
            yield
            return
        self.values = torch.empty(self.full.numel(), dtype=self.master, device=self.part.device)
        dp.all_gather(self.values, self.part)
        self._view_params(self.values)
        try:
            yield
        finally:
            self._view_params(self.full)
            self.values = self.full

    def grads_in_place(self) -> None:
        """The coming step's whole gradients accumulate in one flat buffer (master dtype).

        ``reduce`` then sends it as it is, with no whole-size copy beside it. Each
        parameter's ``.grad`` is a view of it (backward adds into a defined ``.grad`` in
        place); with low-precision parameters a hook adds each micro-batch's gradient into it
        instead (``_fold``), as FSDP accumulates in its ``reduce_dtype``.
        """
        self.grad = torch.zeros(self.full.numel(), dtype=self.master, device=self.part.device)
        self.views = []
        with torch.no_grad():
            for i, (p, off) in enumerate(zip(self.params, self.offsets, strict=True)):
                view = self.grad[off : off + p.numel()].view(p.shape)
                self.views.append(view)
                if self.low:
                    self._fold(i, p)  # left by a step that did not end: kept
                elif p.requires_grad:
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view

    def _fold(self, i: int, p: torch.Tensor) -> None:
        """Adds parameter ``i``'s ``.grad`` into the flat buffer unless it is a view of it."""
        g = p.grad
        if g is None or self.grad is None or g is self.views[i]:
            return
        with torch.no_grad():
            self.views[i].add_(g)
        p.grad = None

    def whole_grad(self, p: torch.Tensor) -> torch.Tensor:
        """The step's whole gradient of ``p`` (of this bucket) so far, in the master's dtype.

        The flat buffer's view, which collectives may change in place.
        """
        i = next(k for k, q in enumerate(self.params) if q is p)
        if self.grad is None:  # outside a step
            self.grads_in_place()
        self._fold(i, p)
        return self.views[i]

    def reduce(self, dp: ProcessGroup, stage: int) -> None:
        """Averages the step's whole gradients over the replicas into this replica's part."""
        if self.grad is None:
            self.grads_in_place()
        for i, p in enumerate(self.params):
            self._fold(i, p)
            p.grad = None
        flat, self.grad, self.views = self.grad, None, []
        assert flat is not None
        if stage == 1:
            dp.all_reduce(flat, op="avg")
            part = flat[self.lo : self.hi].clone()
        else:
            part = torch.empty(self.chunk, dtype=self.master, device=flat.device)
            dp.reduce_scatter(part, flat, op="avg")
        del flat
        for loc, off, (a, b) in zip(self.locals, self.offsets, self.ranges, strict=True):
            if not loc.requires_grad:
                continue
            g = part[off + a - self.lo : off + b - self.lo]
            if loc.grad is None:
                loc.grad = g
            else:  # accumulation over steps without zero_grad, as with plain gradients
                loc.grad.add_(g)


class StageShards:
    """ZeRO ``stage`` (1, 2 or 3) of ``module``'s parameters over ``dp``.

    ``module`` holds this rank's stages; its parameters become views into the buckets (see the
    module docstring). The pipeline calls ``gather()`` before a step or an inference,
    ``reduce()`` after a step's micro-batches.
    """

    def __init__(
        self,
        module: nn.Module,
        dp: ProcessGroup,
        stage: int,
        placements: Mapping[str, Placement] | None = None,
        compute: torch.dtype | None = None,
    ) -> None:
        self.dp, self.stage = dp, stage
        self.placements = dict(placements or {})  # tensor-parallel slices: where they lie
        named = list(nn.Module.named_parameters(module))
        if not named:
            raise InvalidArgumentError(
                f"pipeline: rank {dp.rank}'s stages have no parameters to shard with "
                f"ZeRO-{stage}; use dp='ddp' or put parameters in every stage"
            )
        device = named[0][1].device
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for name, p in named:
            by_dtype.setdefault(p.dtype, []).append((name, p))
        self.buckets = [
            _Bucket(ps, dp.world_size, dp.rank, device, compute) for ps in by_dtype.values()
        ]
        self._stale = stage == 3  # ZeRO-3: the whole parameters are freed until a step starts
        if stage == 3:
            for b in self.buckets:
                b.free()
        self._local_ids = {id(loc) for b in self.buckets for loc in b.locals}
        hook = weak_method(self, "_after_optimizer_step")
        handles = [register_optimizer_step_post_hook(hook)]
        remove_hooks_when_collected(self, handles)

    # -- what the pipeline calls -------------------------------------------------------------

    def named_locals(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
        """This replica's parts, under the parameters' names."""
        for b in self.buckets:
            for name, loc in zip(b.names, b.locals, strict=True):
                yield (f"{prefix}.{name}" if prefix else name), loc

    def gather(self, train: bool = False) -> None:
        """Makes the whole parameters current: a collective over the replicas when stale.

        They are after an optimizer step, a load, and while ZeRO-3 has released them. For a
        training step (``train``) the gradients then accumulate in place (``grads_in_place``).
        """
        if self._stale:
            for b in self.buckets:
                b.gather(self.dp)
            self._stale = False
        if train:
            for b in self.buckets:
                b.grads_in_place()

    def reduce(self) -> None:
        """After a step's micro-batches: gradients averaged into this replica's parts.

        ZeRO-3 then frees the whole parameters.
        """
        for b in self.buckets:
            b.reduce(self.dp, self.stage)
        if self.stage == 3:
            for b in self.buckets:
                b.free()
            self._stale = True

    def fold(self) -> None:
        """Adds gradients set by hand (the zero-bubble weight pass) into the step's buffer."""
        for b in self.buckets:
            for i, p in enumerate(b.params):
                b._fold(i, p)

    def whole_grad(self, p: torch.Tensor) -> torch.Tensor:
        """The step's whole gradient of parameter ``p`` so far, in the master's dtype.

        A view of the buffer ``reduce`` sends: summing tied copies into it in place counts.
        """
        return next(b for b in self.buckets if any(q is p for q in b.params)).whole_grad(p)

    @contextmanager
    def whole(self) -> Iterator[None]:
        """Whole parameters inside (a state dict's), with the master values.

        In the master's dtype under mixed precision; ZeRO-3 frees them again after.
        """
        freed = self.stage == 3 and self._stale
        self.gather()
        try:
            with ExitStack() as stack:
                for b in self.buckets:
                    stack.enter_context(b.master_values(self.dp))
                yield
        finally:
            if freed:
                for b in self.buckets:
                    b.free()
                self._stale = True

    def refresh_parts(self) -> None:
        """After whole parameters were loaded (inside ``whole``): the parts from them.

        A low-precision whole copy is gathered from the parts again before it is used.
        """
        with torch.no_grad():
            for b in self.buckets:
                b.part.copy_(b.values[b.lo : b.hi])
                self._stale = self._stale or b.low

    def memory_stats(self) -> dict[str, int]:
        """Bytes held now, by kind.

        Whole parameters (``params``, 0 while ZeRO-3 has freed them), this replica's parts
        (``master``) and gradients, whole (the step's buffer, and any ``.grad`` outside it)
        and parts (``grads``).
        """
        out = {"params": 0, "master": 0, "grads": 0}
        for b in self.buckets:
            out["params"] += b.full.untyped_storage().nbytes()
            out["master"] += b.part.untyped_storage().nbytes()
            out["grads"] += 0 if b.grad is None else b.grad.nbytes
            views: list[torch.Tensor | None] = list(b.views) or [None] * len(b.params)
            for p, loc, view in zip(b.params, b.locals, views, strict=True):
                whole = None if p.grad is view else p.grad  # a view is counted with the buffer
                for g in (whole, loc.grad):
                    out["grads"] += 0 if g is None else g.numel() * g.element_size()
        return out

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if any(id(p) in self._local_ids for g in optimizer.param_groups for p in g["params"]):
            self._stale = True

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Points an optimizer built over the whole model's parameters at this rank's parts.

        Parameters of other stages are dropped from it (their groups kept). State it holds
        already (Adagrad's from construction, or a step's) is cut to the parts: elementwise
        tensors shaped like their parameter are sliced, other values kept.
        """
        built = {id(p): dict(entries) for p, entries in optimizer.state.items() if entries}
        local_of = {
            id(p): loc for b in self.buckets for p, loc in zip(b.params, b.locals, strict=True)
        }
        for g in optimizer.param_groups:
            g["params"] = [local_of[id(p)] for p in g["params"] if id(p) in local_of]
        optimizer.state.clear()
        for b in self.buckets:
            for p, loc, (lo, hi) in zip(b.params, b.locals, b.ranges, strict=True):
                entries = built.get(id(p))
                if entries is None:
                    continue
                optimizer.state[loc] = {
                    k: v.detach().reshape(-1)[lo:hi].clone()
                    if torch.is_tensor(v) and v.dim() > 0 and v.shape == p.shape
                    else v
                    for k, v in entries.items()
                }

    def clip_grad_norm_(
        self,
        groups: list[ProcessGroup],
        skip: set[str],
        max_norm: float,
        norm_type: float,
        copies: Mapping[str, int] | None = None,
    ) -> torch.Tensor:
        """Clips the parts' gradients to the whole model's norm; returns it.

        Summed over ``groups`` (the pipeline's, then the model's own when tensor parallelism
        splits it) and the replicas. Parameters named in ``skip`` (tied copies counted on
        another rank) are not counted; ``copies[name]`` ranks of the model's group hold equal
        copies of a parameter.
        """
        named = [(n, g) for n, loc in self.named_locals() if (g := loc.grad) is not None]
        grads = [g for _, g in named if g.numel()]
        counted = [(n, g) for n, g in named if g.numel() and n not in skip]
        device = self.buckets[0].part.device
        return clip_to_global_norm_(
            [g for _, g in counted], grads, [*groups, self.dp], max_norm, norm_type, device,
            copies=None if copies is None else [copies.get(n, 1) for n, _ in counted],
        )  # fmt: skip

    # -- the strategy contract -----------------------------------------------------------------

    def sharded_params(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Shard]:
        """Each parameter named in ``shapes`` as a ``Shard`` of this replica's part.

        See the module docstring; no piece where the part is empty.
        """
        out: dict[str, Shard] = {}
        for b in self.buckets:
            for name, p, loc, (a, _) in zip(b.names, b.params, b.locals, b.ranges, strict=True):
                if name not in shapes:
                    continue
                out[name] = (
                    self._placed(name, loc.detach(), a, p, shapes[name])
                    if loc.numel()
                    else Shard(shapes[name], [])
                )
        return out

    def _placed(
        self, name: str, flat: torch.Tensor, start: int, p: torch.Tensor, shape: tuple[int, ...]
    ) -> Shard:
        """Elements ``start ..`` of ``p`` as a ``Shard`` of the whole tensor ``shape``.

        A flat range, or boxes where ``p`` is a tensor-parallel slice (``parallel.placement``).
        """
        placement = self.placements.get(name)
        if placement is None:
            return Shard.flat(flat, shape, start)
        return place(placement, flat, start, p.shape)

    def load_params(self, sd: Mapping[str, Any]) -> None:
        """Takes this replica's parts from ``sd`` (as ``sharded_params`` gives them)."""
        ours = self.sharded_params({n: v.global_shape for n, v in sd.items()})
        with torch.no_grad():
            for name, value in sd.items():
                mine = ours.get(name)
                if mine is None or not isinstance(value, Shard):
                    continue
                # Our own pieces (sharded_params') share the part's memory: nothing to copy.
                for dst, src in zip(mine.pieces, value.pieces, strict=True):
                    if dst.tensor.data_ptr() != src.tensor.data_ptr():
                        dst.tensor.copy_(src.tensor)
        self._stale = True

    def sharded_optim_state(
        self, optimizer: torch.optim.Optimizer, shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, dict[str, Any]]:
        """Each part's optimizer state by parameter name.

        Elementwise tensors as the part's ``FlatRange`` of the whole tensor, scalars (``step``)
        whole.
        """
        state: dict[str, dict[str, Any]] = {}
        for b in self.buckets:
            for name, p, loc, (a, _) in zip(b.names, b.params, b.locals, b.ranges, strict=True):
                entries = optimizer.state.get(loc)
                if not entries or not loc.numel():
                    continue
                out: dict[str, Any] = {}
                for k, v in entries.items():
                    if torch.is_tensor(v) and v.dim() > 0 and v.shape == loc.shape:
                        out[k] = self._placed(name, v.detach(), a, p, shapes[name])
                    elif torch.is_tensor(v):
                        out[k] = Shard.flat(v.detach(), v.shape, 0)
                    else:
                        out[k] = v
                state[name] = out
        return state
