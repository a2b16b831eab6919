"""Data parallel training: replicas that all-reduce gradients in buckets while backward runs.

``DistributedDataParallel`` wraps a plain ``nn.Module``. It broadcasts rank 0's parameters and
buffers at construction, then on every backward:

1. each parameter's post-accumulate-grad hook copies its gradient, divided by the world size,
   into a flat bucket; when every gradient of a bucket has arrived, the bucket's all-reduce is
   started asynchronously (buckets always start in index order, so every rank issues the same
   collectives in the same order) while autograd carries on; on CPU the last bucket, complete
   only as backward ends, is left to step 2, which reduces it on its own thread;
2. at the end of backward (an autograd final callback) parameters whose hook did not fire are
   treated as unused on this rank: their bucket slot carries their current gradient or zeros, a
   one-byte-per-parameter "used" mask is max-reduced, and the call waits for every bucket before
   writing the averaged gradients back. Gradients of parameters that no rank used are left as
   they were (``None`` stays ``None``), as with torch's ``find_unused_parameters=True``, but
   without a flag and without traversing the graph.

The first synchronised iteration records the order gradients become ready; afterwards the
buckets are rebuilt in rank 0's order so that bucket ``k`` is complete before bucket ``k + 1``.

Uneven inputs: inside ``with model.join():`` a rank that runs out of batches keeps shadowing the
others' collectives with zero gradients until every rank is done, then all ranks take the model
of the last rank to finish (torch's ``Join`` semantics; gradients stay divided by the initial
world size).

Elastic training: ``regroup(group)`` moves the wrapper onto a new group in place, as a fresh
wrapper on that group would start (see its docstring).

Steps a caller drives (a pipeline stage running micro-batches on the inner module):
``accumulate()``, the micro-batches, then ``reduce_grads()`` once (``ddp_accumulate``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable

from shardline.comm import traffic
from shardline.comm.coalesced import broadcast_coalesced
from shardline.comm.group import ProcessGroup
from shardline.comm.symmetric import wants_symmetric
from shardline.comm.world import default_group
from shardline.compression.codec import Compressor, Entry
from shardline.compression.hooks import CommHook, allreduce_hook, resolve_hook
from shardline.errors import InvalidArgumentError, ShardlineError
from shardline.parallel import contract
from shardline.parallel._common import (
    ModelParallel,
    check_same_model,
    clip_to_global_norm_,
    remove_hooks_when_collected,
    weak_method,
)
from shardline.parallel.data.compressed import (
    charged,
    comm_stats,
    resolve_compression,
    split_state,
    state_entries,
)
from shardline.parallel.data.ddp_accumulate import CallerSteps
from shardline.parallel.data.ddp_buckets import (
    Bucket,
    StepState,
    build_buckets,
    fill_slot,
    move_bucket_grads,
    symmetric_buckets,
)
from shardline.parallel.data.ddp_join import JoinUneven
from shardline.parallel.joining import is_joining

__all__ = ["DistributedDataParallel"]

_MIB = 1 << 20


class DistributedDataParallel(CallerSteps, JoinUneven, ModelParallel, nn.Module):
    """Replicates ``module`` on every rank of ``group`` and averages gradients in backward.

    Args:
        module: The model (its parameters on CPU for the native and gloo backends, on this
            rank's GPU for nccl).
        group: The ranks that hold replicas; the default group of ``shardline.init()`` when
            ``None``.
        bucket_cap_mb: Size of a gradient bucket in MiB (torch's default, 25).
        first_bucket_mb: Size of the first bucket, small so that communication starts early.
        broadcast_buffers: Broadcast buffers (BatchNorm statistics) from rank 0 before every
            forward that will be followed by a synchronised backward.
        comm_hook: How a bucket is reduced: ``None`` (all-reduce in the gradient dtype),
            ``"fp16"`` or ``"bf16"`` (compressed on the wire), or a callable (see
            ``shardline.compression.hooks``).
        init_sync: Broadcast rank 0's parameters and buffers now.
        gradient_as_bucket_view: Make each ``param.grad`` a view into its bucket as soon as
            backward copies it there, instead of copying the result back (one pass less per
            step; autograd's tensor freed at once). A ``.grad`` tensor kept across steps is
            overwritten by the next synchronised backward; clone it to keep it, or pass ``False``.
        in_place_mb: Gradients of at least this many MiB (under the default hook) are
            reduced where autograd left them, with the division by the world size fused into
            the reduction: no copy into a bucket and none back. ``float("inf")`` packs all.
            Not with symmetric buckets, which hold every gradient.
        symmetric: Buckets in symmetric memory (``shardline.symmetric_empty``), whose
            all-reduce reads every rank's bucket where it is, with no copy through the
            engine's slots. ``None``: on CPU where the group has it (the native engine, one
            host) unless ``SHARDLINE_SYMMETRIC=0``, ordinary where a rank has no room (with a
            warning); ``False``: ordinary tensors; ``True``: always (an error where it cannot
            be). ``self.symmetric`` says which it is.
        compression: A gradient compressor (``sl.compression.PowerSGD(rank=4)``,
            ``sl.compression.Int8()``, ...) or its name (``"powersgd"``, ``"int8"``, ``"fp8"``,
            ``"topk"``, ``"onebit"``): each bucket is reduced compressed, with error feedback;
            its state is saved in checkpoints per rank. Not together with ``comm_hook``.

    Raises:
        InvalidArgumentError: parameters differ across ranks (names the ranks), sparse or
            mixed-device parameters, or bad arguments.

    ``state_dict()`` and ``load_state_dict()`` are the wrapped module's (no ``module.``
    prefix), so checkpoints load into the plain model.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        group: ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        broadcast_buffers: bool = True,
        comm_hook: str | CommHook | None = None,
        init_sync: bool = True,
        gradient_as_bucket_view: bool = True,
        in_place_mb: float = 1.0,
        compression: str | Compressor | None = None,
        symmetric: bool | None = None,
    ) -> None:
        super().__init__()
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise InvalidArgumentError(
                f"bucket_cap_mb ({bucket_cap_mb}) and first_bucket_mb ({first_bucket_mb}) "
                "must be positive"
            )
        self.module = module
        self.group = group if group is not None else default_group()
        self.bucket_cap_bytes = int(bucket_cap_mb * _MIB)
        self.first_bucket_bytes = int(min(first_bucket_mb, bucket_cap_mb) * _MIB)
        self.broadcast_buffers = broadcast_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.in_place_bytes = in_place_mb * _MIB  # float: inf disables the in-place path
        self._compression = resolve_compression(compression, comm_hook)
        self._hook = resolve_hook(comm_hook)
        self._synced_steps = 0  # synchronised backwards, for comm_stats()
        self._traffic = traffic.Traffic()  # what this wrapper issued (the group is shared)

        seen: set[int] = set()
        named: list[tuple[str, nn.Parameter]] = []
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buffers_list = [b for b in module.buffers() if b.numel() > 0]
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self._symmetric_choice = symmetric
        # On CPU the final callback reduces the last bucket itself (see _launch_ready).
        self._wait_last = self._device.type == "cpu"
        self.symmetric = wants_symmetric(self.group, self._device, symmetric, "DDP")
        for name, p in named:
            if p.is_sparse:
                raise InvalidArgumentError(
                    f"DistributedDataParallel: parameter {name!r} is sparse; sparse gradients "
                    "are not supported, use a dense parameter"
                )
        # A process joining a running elastic job skips the start-up collectives: the ranks
        # already there move with regroup(), which runs none; the values come with the restore.
        joining = is_joining()
        if not joining:
            self._check_same_model()

        self._require_sync = True
        self._sync_next_backward = True  # decided by each forward
        self._buffers_due = True  # broadcast buffers before the next forward
        self._awaiting_backward = False  # join(): a synchronised forward awaits its backward
        self._step: StepState | None = None
        self._used_since_sync = [False] * len(self._params)
        self._rebuilt = False
        self._join_active = False
        self._join_src: int | None = None
        self._held = False  # accumulate() .. reduce_grads() (ddp_accumulate)
        self._buckets: list[Bucket] = []
        self._slot: list[tuple[int, int]] = []  # param index -> (bucket, slot)
        self._build_buckets(list(reversed(range(len(self._params)))))
        self._handles = [
            p.register_post_accumulate_grad_hook(weak_method(self, "_on_grad_ready", i))  # type: ignore[no-untyped-call]
            for i, p in enumerate(self._params)
        ]
        remove_hooks_when_collected(self, self._handles)
        if init_sync and not joining:
            self._broadcast_tensors(self._params_data() + self._buffers_list, src=0)

    # -- public --------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module, after syncing buffers (and, inside ``join()``, ranks).

        As in torch's DDP, whether the next backward reduces gradients is decided here (grad
        mode on and not inside ``no_sync()``), and buffers are broadcast before a forward
        that follows such a synchronised forward (and before the first one).
        """
        self._check_no_stale_step()
        will_sync = torch.is_grad_enabled() and self._require_sync
        if self._join_active:
            if self._awaiting_backward:
                self.group.abort(f"rank {self.group.rank}: forward before backward in join()")
                raise ShardlineError(
                    f"DistributedDataParallel.join() on rank {self.group.rank}: a forward ran "
                    "before the backward of the previous forward with gradients; inside join() "
                    "the other ranks mirror each such forward's backward, so it must come "
                    "next (evaluate outside join() or under torch.no_grad() after the "
                    "backward); the group was aborted"
                )
            self._join_src = self._join_round(active=True, sync=will_sync)
            self._awaiting_backward = will_sync
        if self._buffers_due and self.broadcast_buffers and self._buffers_list:
            self._broadcast_tensors(self._buffers_list, src=self._src())
        self._buffers_due = will_sync
        self._sync_next_backward = will_sync
        return self.module(*args, **kwargs)

    def _check_no_stale_step(self) -> None:
        """A backward that raised midway leaves this rank's collectives out of step: abort."""
        step = self._step
        if step is None:
            return
        self._step = None
        self._used_since_sync = [False] * len(self._params)
        started = step.next_bucket
        reason = (
            f"rank {self.group.rank}: the previous backward through DistributedDataParallel "
            f"did not finish ({started} of {len(self._buckets)} gradient buckets started; an "
            "exception inside backward?)"
        )
        self.group.abort(reason)
        raise ShardlineError(
            f"{reason}. The ranks' collectives no longer line up, so the group was aborted "
            "(every rank raises instead of waiting); restart the job or resume from a "
            "checkpoint"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulates gradients locally; the first backward after the block reduces them all.

        ``with model.no_sync(): loss(a).backward()`` then ``loss(b).backward()`` gives the same
        gradients as one backward over ``a`` and ``b`` together.
        """
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the averaged gradients; returns the norm.

        Every replica holds the same gradients, so nothing is communicated unless the module
        is split by tensor parallelism (then the norm is summed over its group).
        """
        named = [
            (n, p.grad)
            for n, p in zip(self._names, self._params, strict=True)
            if p.grad is not None
        ]
        grads = [g for _, g in named]
        return clip_to_global_norm_(
            grads, grads, self._norm_groups(None), max_norm, norm_type, self._device,
            copies=self._copies_of([n for n, _ in named]),
        )  # fmt: skip

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's ``state_dict`` (keys without a ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads into the wrapped module (keys without a ``module.`` prefix)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- the strategy contract: every rank holds the inner module's state ---------------------

    def layout(self) -> dict[str, Any]:
        """How this wrapper lays state out (recorded in checkpoints, for people to read)."""
        inner = contract.layout(self.module)
        mesh = {"dp": self.group.world_size, **inner.get("mesh", {})}
        return {**inner, "strategy": "ddp", "mesh": mesh}

    def sharded_state_dict(self) -> dict[str, Any]:
        """The wrapped module's (replicated unless it splits its own state).

        With ``compression``, the compressor's per-rank state is added as ``Local`` values.
        """
        own = state_entries(self._compression, self._compressed_buffers(), self._device)
        return {**contract.sharded_state_dict(self.module), **own}

    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        """Takes ``sharded_state_dict()``'s shape back into the wrapped module."""
        contract.load_sharded_state_dict(self.module, split_state(sd, self._compression))

    @property
    def compression(self) -> Compressor | None:
        """The gradient compressor, or ``None``."""
        return self._compression

    def comm_stats(self) -> dict[str, Any]:
        """Bytes this rank sent and received for the model so far.

        In total, per op kind and per synchronised step (``shardline.comm.traffic`` says how
        they are counted), and the compressor in use.
        """
        return comm_stats([self._traffic.snapshot()], self._compression, self._synced_steps)

    def sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state by the wrapped module's parameter names."""
        return contract.sharded_optim_state_dict(self.module, optimizer)

    def load_sharded_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]
    ) -> None:
        """Takes ``sharded_optim_state_dict()``'s shape back into ``optimizer``."""
        contract.load_sharded_optim_state_dict(self.module, optimizer, sd)

    @property
    def bucket_layout(self) -> list[list[str]]:
        """Names of the parameters in each bucket, in the order buckets are reduced."""
        return [[self._names[i] for i in b.params] for b in self._buckets]

    def regroup(self, group: ProcessGroup) -> None:
        """Moves the wrapper onto ``group`` in place (elastic training: ranks were lost or added).

        Nothing is communicated, on the old group (it is dead) or on ``group``; what a failed
        backward left in flight on the old group is dropped, and so are the gradients. The
        wrapper, the module and its parameters stay the same objects, so an optimizer over
        them stays valid; their values are kept, and the caller restores model and optimizer
        state afterwards (as ``sl.checkpoint.load(..., group=group)`` does).

        Afterwards the wrapper is as a fresh one on ``group`` with the same options in a
        process joining a running elastic job (which skips the start-up collectives,
        ``shardline.parallel.joining``): buckets in reverse registration order,
        rebuilt after the first synchronised backward in the order the new rank 0 saw
        gradients; buffers broadcast before the first forward. So survivors and joiners
        issue the same collectives. (Gradients are divided by ``group.world_size``, read at
        each backward.)

        Args:
            group: The new group (any world size; this process's rank in it may differ).

        Raises:
            InvalidArgumentError: a backward is running, it is called inside ``join()``, or the
                module is split by tensor parallelism (not supported by elastic regroup yet).
        """
        if torch._C._current_graph_task_id() != -1:
            raise InvalidArgumentError(
                "DistributedDataParallel.regroup() was called while a backward is running; call "
                "it between steps (after the backward, or after it raised)"
            )
        if self._join_active:
            raise InvalidArgumentError(
                "DistributedDataParallel.regroup() was called inside join(); leave the join() "
                "block first (an exception out of it leaves it)"
            )
        inner = contract.strategies_inside(self.module)
        if self._model_group is not None or inner:
            what = type(next(iter(inner.values()))).__name__ if inner else "tensor parallelism"
            raise InvalidArgumentError(
                f"DistributedDataParallel.regroup(): a module split by {what} inside DDP is not "
                "supported by elastic regroup yet; use DDP or ZeRO over a plain module"
            )
        self.group = group
        # symmetric=True gives way where the new group has none: the job goes on
        self.symmetric = wants_symmetric(
            group, self._device, None if self._symmetric_choice is not False else False, "DDP"
        )
        # Everything per step goes back to what the constructor sets: a stale step of a
        # backward that failed on the old group would otherwise abort the new one at the next
        # forward, and the bucket order rank 0 of the old group saw is not the new rank 0's.
        self._require_sync = self._sync_next_backward = True
        self._buffers_due = True  # the constructor broadcasts buffers before the first forward
        self._awaiting_backward, self._step, self._join_src = False, None, None
        self._held = False
        self._used_since_sync = [False] * len(self._params)
        for p in self._params:
            p.grad = None  # may view an old bucket, or hold the failed step's sum
        self._rebuilt = False
        self._build_buckets(list(reversed(range(len(self._params)))))

    def remove_hooks(self) -> None:
        """Detaches the gradient hooks (the module trains locally afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- setup ---------------------------------------------------------------------------------

    def _params_data(self) -> list[torch.Tensor]:
        return [p.data for p in self._params]

    def _src(self) -> int:
        return self._join_src if self._join_active and self._join_src is not None else 0

    def _check_same_model(self) -> None:
        check_same_model(self.group, self._names, self._params, "DistributedDataParallel")

    def _build_buckets(self, order: list[int]) -> None:
        """Packs parameters into per-dtype buckets following ``order`` (first ready first).

        Symmetric buckets come from one arena per build (a collective: every rank builds at
        the same points). Gradients that view the old buckets move into the new ones, so the
        old memory goes now, as torch's reducer does when it rebuilds.
        """
        alloc = None
        if self.symmetric:  # automatic: ordinary buckets where some rank has no room
            required = self._symmetric_choice is True
            self.symmetric, alloc = symmetric_buckets(self._params, self.group, required)
        old = self._buckets
        self._buckets, self._slot = build_buckets(
            self._params,
            order,
            self._in_place_ok,
            self.first_bucket_bytes,
            self.bucket_cap_bytes,
            self._device,
            alloc,
        )
        move_bucket_grads(self._params, old, self._buckets, self._slot)

    def _in_place_ok(self, p: torch.Tensor) -> bool:
        """Large contiguous float gradients under the default hook skip the bucket copy."""
        return (
            not self.symmetric
            and self._hook is allreduce_hook
            and self._compression is None
            and p.is_floating_point()
            and p.is_contiguous()
            and p.numel() * p.element_size() >= self.in_place_bytes
        )

    # -- backward --------------------------------------------------------------------------------

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        if self._held:  # accumulate(): the caller reduces (ddp_accumulate)
            return
        self._used_since_sync[i] = True
        if not self._sync_next_backward:
            return
        if self._step is None:
            self._begin_step()
        step = self._step
        assert step is not None
        if step.ready[i]:
            raise ShardlineError(
                f"DistributedDataParallel on rank {self.group.rank}: the gradient of "
                f"{self._names[i]!r} became ready twice in one backward (reentrant backward or "
                "a second backward on the same graph); use no_sync() for all but the last one"
            )
        self._fill_slot(i, param.grad)
        self._mark_ready(i)

    def _begin_step(self) -> None:
        for b in self._buckets:
            b.pending = len(b.params)
            b.finish = None
        self._step = StepState(ready=[False] * len(self._params))
        Variable._execution_engine.queue_callback(self._end_backward)

    def _fill_slot(self, i: int, grad: torch.Tensor | None, used: bool = True) -> None:
        b, s = self._slot[i]
        fill_slot(
            self._buckets[b], s, self._params[i], grad, 1.0 / self.group.world_size,
            used=used, as_view=self.gradient_as_bucket_view, name=self._names[i],
        )  # fmt: skip

    def _mark_ready(self, i: int) -> None:
        step = self._step
        assert step is not None
        step.ready[i] = True
        step.order.append(i)
        self._buckets[self._slot[i][0]].pending -= 1
        self._launch_ready(step)

    def _launch_ready(self, step: StepState, final: bool = False) -> None:
        """Starts the buckets that are complete, in index order.

        The last bucket is complete only when backward is: on CPU it is left to the final
        callback (``final``), which reduces it waiting, so the engine runs it on this thread
        with its comm threads rather than alone on its worker beside nothing to overlap.
        """
        last = len(self._buckets) - 1
        while step.next_bucket <= last:
            bucket = self._buckets[step.next_bucket]
            if bucket.pending > 0:
                return
            wait = step.next_bucket == last and self._wait_last
            if wait and not final:
                return
            bucket.finish = self._start(bucket, wait=wait)
            step.next_bucket += 1

    @charged
    def _start(self, bucket: Bucket, wait: bool = False) -> Callable[[], None]:
        """Starts reducing ``bucket`` (``wait``: now, where the hook allows); its finish."""
        plain = self._hook is allreduce_hook and self._compression is None
        if wait and plain:
            self.group.all_reduce(bucket.flat, "avg" if bucket.in_place else "sum")
            return lambda: None  # reduced already
        if bucket.in_place:
            # avg divides by the world size inside the reduction, as the bucket copy would.
            work = self.group.all_reduce(bucket.flat, "avg", async_op=True)
            assert work is not None
            return work.wait
        if self._compression is not None:
            return self._compression.reduce(
                self.group, bucket.flat, key=bucket.index, layout=self._entries(bucket)
            )
        return self._hook(self.group, bucket.flat)

    def _entries(self, bucket: Bucket) -> list[Entry]:
        return [
            Entry(self._names[i], off, tuple(self._params[i].shape))
            for i, off in zip(bucket.params, bucket.offsets, strict=True)
        ]

    def _compressed_buffers(self) -> list[tuple[int, list[Entry], int]]:
        """(key, layout, size) of each bucket the compressor reduces."""
        return [(b.index, self._entries(b), b.flat.numel()) for b in self._buckets]

    @charged
    def _end_backward(self) -> None:
        """Autograd's final callback: unused parameters, the used mask, wait, write back."""
        step = self._step
        assert step is not None
        try:
            for i, p in enumerate(self._params):
                if not step.ready[i]:
                    self._fill_slot(i, p.grad, used=False)
                    step.ready[i] = True
                    self._buckets[self._slot[i][0]].pending -= 1
            self._launch_ready(step, final=True)
            # Through pinned memory: a plain host-to-device copy would block this thread until
            # the GPU finished the backward, so the optimizer's kernels would be queued late.
            on_gpu = self._device.type == "cuda"
            used_t = torch.tensor(self._used_since_sync, dtype=torch.uint8, pin_memory=on_gpu)
            used_t = used_t.to(self._device, non_blocking=True)
            # Waited for here on CPU: handed to the engine's worker thread, it would wait for
            # that thread to get a core, which a busy host gives late.
            mask_work = self.group.all_reduce(used_t, "max", async_op=not self._wait_last)
            for bucket in self._buckets:
                assert bucket.finish is not None
                bucket.finish()
            if mask_work is not None:
                mask_work.wait()
            # A parameter this rank used was used by some rank: only parameters unused here
            # need the mask's verdict. Reading it costs a device sync on GPUs, so it is read
            # only then (the common case, every parameter used, never syncs).
            used = self._used_since_sync
            if not all(used):
                used = [bool(u) for u in used_t.tolist()]
            self.write_back(used)
            self._synced_steps += 1
            if self._compression is not None:
                self._compression.advance()
            if not self._rebuilt:
                self._rebuild(step.order)
        finally:
            self._step = None
            self._awaiting_backward = False
            self._used_since_sync = [False] * len(self._params)

    def _rebuild(self, order: list[int]) -> None:
        """After the first step: rebuild buckets in the order rank ``src`` saw gradients."""
        seen = set(order)
        full = order + [i for i in reversed(range(len(self._params))) if i not in seen]
        t = torch.tensor(full, dtype=torch.int64, device=self._device)
        self.group.broadcast(t, src=self._src())
        self._build_buckets(t.tolist())
        self._rebuilt = True

    # -- broadcast -------------------------------------------------------------------------------

    @charged
    def _broadcast_tensors(self, tensors: list[torch.Tensor], src: int) -> None:
        """Broadcasts tensors from ``src``, coalesced into flat chunks of about one bucket."""
        broadcast_coalesced(self.group, tensors, src, self.bucket_cap_bytes)
