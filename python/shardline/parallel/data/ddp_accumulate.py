"""DDP steps a caller drives: gradients accumulated over micro-batches, reduced once.

A pipeline stage runs its micro-batches' forwards and backwards on the inner module itself,
interleaved as its schedule says, and averages the replicas' gradients once, after its last
micro-batch. ``accumulate()`` starts such a step: the gradient hooks stand aside, and each
parameter's ``.grad`` becomes a view of its slot in a bucket (a gradient it holds is copied
there), so autograd adds every micro-batch's gradient into the buckets in place.
``reduce_grads()`` then reduces every bucket (all started before any is waited for, in
bucket order) and writes the averages back as after a synchronised backward: no gathering
copy of the gradients, none back. A parameter without a gradient counts as zeros.

``write_back`` (the end of both kinds of step): each used parameter's ``.grad`` becomes its
reduced bucket slot (or a copy of it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shardline.errors import ShardlineError
from shardline.parallel.data.ddp_buckets import Bucket

if TYPE_CHECKING:
    from shardline.comm.group import ProcessGroup
    from shardline.compression.codec import Compressor

__all__ = ["CallerSteps"]


class CallerSteps:
    """``accumulate`` and ``reduce_grads`` of ``DistributedDataParallel`` (see the module)."""

    group: ProcessGroup
    gradient_as_bucket_view: bool
    _params: list[torch.Tensor]
    _buckets: list[Bucket]
    _slot: list[tuple[int, int]]
    _synced_steps: int
    _compression: Compressor | None
    _held: bool  # accumulate() .. reduce_grads(): the hooks stand aside

    if TYPE_CHECKING:  # DistributedDataParallel's own

        def _fill_slot(self, i: int, grad: torch.Tensor | None, used: bool = True) -> None: ...
        def _start(self, bucket: Bucket) -> Callable[[], None]: ...

    def accumulate(self) -> None:
        """Starts a step whose micro-batches the caller runs on the inner module.

        Their gradients add up in the buckets until ``reduce_grads()``; nothing is
        communicated meanwhile.

        Raises:
            ShardlineError: a step started this way was not reduced yet.
        """
        if self._held:
            raise ShardlineError("DistributedDataParallel.accumulate() twice; reduce_grads() first")
        self._held = True
        if not self.gradient_as_bucket_view:
            return
        with torch.no_grad():
            for bucket in self._buckets:
                if bucket.in_place:
                    continue
                for s, i in enumerate(bucket.params):
                    p, view = self._params[i], bucket.view(s, self._params[i])
                    if p.grad is None:
                        view.zero_()
                    elif p.grad.data_ptr() != view.data_ptr():
                        view.copy_(p.grad)
                    p.grad = view

    def reduce_grads(self) -> None:
        """Ends the step: every bucket averaged over the group, the results in ``.grad``.

        Every rank of the group calls it, after the same steps.

        Raises:
            ShardlineError: no step was started by ``accumulate()``.
        """
        if not self._held:
            raise ShardlineError("reduce_grads() without accumulate() before it")
        self._held = False
        for bucket in self._buckets:
            for i in bucket.params:
                self._fill_slot(i, self._params[i].grad)
            bucket.finish = self._start(bucket)
        for bucket in self._buckets:
            assert bucket.finish is not None
            bucket.finish()
            bucket.finish = None
        self.write_back([True] * len(self._params))
        self._synced_steps += 1
        if self._compression is not None:
            self._compression.advance()

    def write_back(self, used: list[bool]) -> None:
        """Each parameter ``used`` by some rank gets its reduced gradient (see the module)."""
        for i, p in enumerate(self._params):
            if not used[i]:
                continue  # no rank used it: leave its gradient alone
            b, s = self._slot[i]
            bucket = self._buckets[b]
            if bucket.in_place:
                reduced = bucket.flat.view(p.shape)
                if p.grad is None or p.grad.data_ptr() != reduced.data_ptr():
                    p.grad = reduced
                bucket.flat = bucket.flat[:0]  # drop the reference
                continue
            view = bucket.view(s, p)
            if self.gradient_as_bucket_view:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view  # no copy back; autograd accumulates here next time
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)
