"""The gloo backend: torch's ``ProcessGroupGloo``, built directly (no global state).

It is the reference the native engine is tested and benchmarked against. Because it is
constructed from a store, rank and size, it also runs with ranks as threads of one process.
Where gloo lacks something (avg, bool reductions, unequal all_gather, reduce_scatter on old
torch), this module composes it from what gloo has, at the cost of a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardline.comm.backends._common import (
    as_bytes,
    gather_args,
    pad_unequal,
    reduce_args,
    scatter_args,
)
from shardline.comm.backends._deferred import Deferred
from shardline.comm.rendezvous.store import StoreClient, store_barrier
from shardline.comm.work import Counts, seconds

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["GlooBackend", "create"]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


class GlooBackend:
    """Checked tensors in, torch gloo collectives out."""

    name = "gloo"
    transport = "gloo"

    def __init__(self, store: Store, rank: int, world_size: int, *, name: str, timeout: float):
        self._store = store
        self._timeout = timeout
        self.group_name = name
        self.rank = rank
        self.world_size = world_size
        prefix = f"shardline/{name}/gloo"
        prefixed = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        client = StoreClient(store, rank=rank, task=f"creating group {name!r}")
        # gloo's own setup blocks where nothing can stop it: meet here first, so a rank that
        # failed before stops the others within a second, not at the deadline.
        store_barrier(client, f"{prefix}-ready", world_size, timeout, "meeting before gloo setup")
        with client.step("connecting gloo's pairs through the store", store_only=True):
            # torch's stubs do not list ProcessGroup methods; they exist at runtime.
            self._pg: Any = dist.ProcessGroupGloo(
                prefixed, rank, world_size, timedelta(seconds=timeout)
            )

    def _reduce_args(self, t: torch.Tensor, op: str) -> tuple[torch.Tensor, Any]:
        return reduce_args(t, op, _OPS)

    def _avg(self, t: torch.Tensor, op: str) -> Callable[[], None] | None:
        if op != "avg":
            return None

        def divide() -> None:
            t.div_(self.world_size)

        return divide

    def all_reduce(self, t: torch.Tensor, op: str, *, async_op: bool = True) -> Deferred:
        buf, rop = self._reduce_args(t, op)
        return Deferred([self._pg.allreduce([buf], _opt(rop))], after=self._avg(t, op))

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op: str, *, async_op: bool = True
    ) -> Deferred:
        tmp = inp.clone()
        handle = self.all_reduce(tmp, op)
        n = out.numel()

        def take() -> None:
            handle.wait()
            out.reshape(-1).copy_(tmp.reshape(-1)[self.rank * n : (self.rank + 1) * n])

        return Deferred(after=take)

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, counts: Counts, *, async_op: bool = True
    ) -> Deferred:
        if counts is None:
            return Deferred([self._pg._allgather_base(as_bytes(out), as_bytes(inp))])
        padded, gathered, unpad = pad_unequal(out, inp, counts, self.world_size)
        work = self._pg._allgather_base(as_bytes(gathered), as_bytes(padded))
        return Deferred([work], after=unpad)

    def broadcast(self, t: torch.Tensor, root: int, *, async_op: bool = True) -> Deferred:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return Deferred([self._pg.broadcast([as_bytes(t)], opts)])

    def reduce(self, t: torch.Tensor, op: str, root: int, *, async_op: bool = True) -> Deferred:
        buf, rop = self._reduce_args(t, op)
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = root, rop
        after = self._avg(t, op) if self.rank == root else None
        return Deferred([self._pg.reduce([buf], opts)], after=after)

    def gather(
        self, out: torch.Tensor | None, inp: torch.Tensor, root: int, *, async_op: bool = True
    ) -> Deferred:
        return Deferred([self._pg.gather(*gather_args(out, inp, root, self.world_size))])

    def scatter(
        self, out: torch.Tensor, inp: torch.Tensor | None, root: int, *, async_op: bool = True
    ) -> Deferred:
        return Deferred([self._pg.scatter(*scatter_args(out, inp, root, self.world_size))])

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = True
    ) -> Deferred:
        return Deferred(
            [self._pg.alltoall_base(as_bytes(out), as_bytes(inp), [], [], dist.AllToAllOptions())]
        )

    def barrier(self, *, async_op: bool = True) -> Deferred:
        return Deferred([self._pg.barrier()])

    def send(self, t: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = True) -> Deferred:
        return Deferred([self._pg.send([as_bytes(t)], dst, tag)])

    def recv(
        self, t: torch.Tensor, src: int | None, *, tag: int = 0, async_op: bool = True
    ) -> Deferred:
        if src is None:
            work = self._pg.recv_anysource([as_bytes(t)], tag)
            return Deferred([work], source=lambda works: int(works[0]._source_rank()))
        return Deferred([self._pg.recv([as_bytes(t)], src, tag)], source=lambda _: src)

    def subgroup(
        self,
        name: str,
        ranks: Sequence[int],
        *,
        overlap_compute: bool = False,
        timeout: float | None = None,
    ) -> GlooBackend:
        del overlap_compute  # a hint for GPU backends; CPU collectives take no SMs
        return GlooBackend(
            self._store,
            list(ranks).index(self.rank),
            len(ranks),
            name=name,
            timeout=self._timeout if timeout is None else timeout,
        )

    def abort(self, reason: str) -> None:
        self._pg.abort()

    def close(self) -> None:
        self._pg.shutdown()


def _opt(rop: Any) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = rop
    return opts


def create(store: Store, rank: int, world_size: int, *, name: str, timeout: float) -> GlooBackend:
    """A gloo backend for one group; every rank of it calls this with the same ``name``."""
    return GlooBackend(store, rank, world_size, name=name, timeout=seconds(timeout) or 300.0)
