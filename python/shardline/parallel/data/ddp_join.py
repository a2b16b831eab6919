"""DDP's ``join()``: ranks with different numbers of batches, without deadlocking.

A mixin of ``DistributedDataParallel``: a rank that has left its loop answers the others'
collectives with zero gradients until every rank has left, then every rank takes the
parameters and buffers of the last rank still training (torch's ``Join`` protocol).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from shardline.errors import InvalidArgumentError

if TYPE_CHECKING:
    from shardline.comm.group import ProcessGroup

__all__ = ["JoinUneven"]


class JoinUneven:
    """``join()`` and the rounds it runs (see the module docstring)."""

    group: ProcessGroup
    _join_active: bool
    _join_src: int | None
    _awaiting_backward: bool
    _buffers_due: bool
    broadcast_buffers: bool
    _buffers_list: list[torch.Tensor]
    _buckets: list[Any]
    _params: list[torch.Tensor]
    _device: torch.device
    _rebuilt: bool

    if TYPE_CHECKING:  # DistributedDataParallel's own

        def _broadcast_tensors(self, tensors: list[torch.Tensor], src: int) -> None: ...
        def _params_data(self) -> list[torch.Tensor]: ...
        def _start(self, bucket: Any) -> Any: ...
        def _rebuild(self, order: list[int]) -> None: ...

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """Lets ranks run different numbers of batches without deadlocking each other.

        Wrap the training loop: ``with model.join(): for batch in my_batches: ...``. When a
        rank leaves the loop it keeps answering the other ranks' collectives with zero
        gradients until every rank has left; then every rank takes the parameters and buffers
        of the last rank that was still training. If the loop raises, the group is aborted so
        that the other ranks raise too instead of waiting.
        """
        if self._join_active:
            raise InvalidArgumentError("DistributedDataParallel.join() is already active")
        self._join_active = True
        self._join_src = None
        self._awaiting_backward = False
        try:
            try:
                yield
            except BaseException as e:
                self.group.abort(
                    f"rank {self.group.rank} raised {type(e).__name__} inside "
                    "DistributedDataParallel.join()"
                )
                raise
            try:
                self._shadow_until_all_joined()
            except BaseException as e:
                self.group.abort(
                    f"rank {self.group.rank} failed while shadowing the other ranks in "
                    f"DistributedDataParallel.join(): {type(e).__name__}: {e}"
                )
                raise
        finally:
            self._join_active = False
            self._join_src = None
            self._awaiting_backward = False

    def _shadow_until_all_joined(self) -> None:
        """Joined rank: mirror each round of the active ranks, then take the final model."""
        while True:
            src = self._join_round(active=False, sync=False)
            if src is None:
                break
            self._join_src, sync = src
            if self._buffers_due and self.broadcast_buffers and self._buffers_list:
                self._broadcast_tensors(self._buffers_list, src=self._join_src)
            self._buffers_due = sync
            if sync:
                self._shadow_backward()
        if self._join_src is not None:
            self._broadcast_tensors(self._params_data() + self._buffers_list, src=self._join_src)

    def _join_round(self, *, active: bool, sync: bool) -> Any:
        """One round of the join protocol: who is still training, and will they sync?

        Active ranks call it from ``forward`` and get the rank to take buffers from; joined
        ranks call it in their shadow loop and get ``(src, sync)`` or ``None`` once all left.
        """
        flag = torch.tensor(
            [self.group.rank if active else -1, 1 if (active and sync) else 0],
            dtype=torch.int64,
            device=self._device,
        )
        self.group.all_reduce(flag, "max")
        src, any_sync = int(flag[0]), bool(flag[1])
        if active:
            return src
        return None if src < 0 else (src, any_sync)

    def _shadow_backward(self) -> None:
        """Mirrors one synchronised backward of the active ranks with zero gradients."""
        finishes = []
        for b in self._buckets:
            if b.in_place:
                p = self._params[b.params[0]]
                b.flat = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            else:
                b.flat.zero_()
            finishes.append(self._start(b))
        used = torch.zeros(len(self._params), dtype=torch.uint8, device=self._device)
        mask_work = self.group.all_reduce(used, "max", async_op=True)
        for f in finishes:
            f()
        assert mask_work is not None
        mask_work.wait()
        if not self._rebuilt:
            self._rebuild([])
