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

from shardline.comm.work import seconds

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
# [Note: bool] bool is reduced as uint8: sum/max are "or", prod/min are "and".
_BOOL_OPS = {"sum": "max", "max": "max", "prod": "min", "min": "min"}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class _GlooHandle:
    """Adapts a torch ``Work`` (or several) to our Handle; runs ``after`` once on success."""

    def __init__(self, works: list[dist.Work], after: Callable[[], None] | None = None) -> None:
        self._works = works
        self._after = after

    def wait(self, timeout: float | None = None) -> None:
        for w in self._works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timedelta(seconds=timeout))
        if self._after is not None:
            after, self._after = self._after, None
            after()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


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
        # torch's stubs do not list ProcessGroup methods; they exist at runtime.
        self._pg: Any = dist.ProcessGroupGloo(
            prefixed, rank, world_size, timedelta(seconds=timeout)
        )

    def _reduce_args(self, t: torch.Tensor, op: str) -> tuple[torch.Tensor, Any]:
        if t.dtype == torch.bool:
            return _bytes(t), _OPS[_BOOL_OPS[op]]
        return t.reshape(-1), _OPS[op]

    def _avg(self, t: torch.Tensor, op: str) -> Callable[[], None] | None:
        if op != "avg":
            return None

        def divide() -> None:
            t.div_(self.world_size)

        return divide

    def all_reduce(self, t: torch.Tensor, op: str, *, async_op: bool = True) -> _GlooHandle:
        buf, rop = self._reduce_args(t, op)
        return _GlooHandle([self._pg.allreduce([buf], _opt(rop))], self._avg(t, op))

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op: str, *, async_op: bool = True
    ) -> _GlooHandle:
        tmp = inp.clone()
        handle = self.all_reduce(tmp, op)
        n = out.numel()

        def take() -> None:
            handle.wait()
            out.reshape(-1).copy_(tmp.reshape(-1)[self.rank * n : (self.rank + 1) * n])

        return _GlooHandle([], take)

    def all_gather(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        counts: Sequence[int] | None,
        *,
        async_op: bool = True,
    ) -> _GlooHandle:
        if counts is None:
            return _GlooHandle([self._pg._allgather_base(_bytes(out), _bytes(inp))])
        width = max(counts)
        padded = torch.zeros(width, dtype=inp.dtype)
        padded[: inp.numel()] = inp.reshape(-1)
        gathered = torch.empty(width * self.world_size, dtype=inp.dtype)
        work = self._pg._allgather_base(_bytes(gathered), _bytes(padded))

        def unpad() -> None:
            start, flat = 0, out.reshape(-1)
            for r, c in enumerate(counts):
                flat[start : start + c] = gathered[r * width : r * width + c]
                start += c

        return _GlooHandle([work], unpad)

    def broadcast(self, t: torch.Tensor, root: int, *, async_op: bool = True) -> _GlooHandle:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return _GlooHandle([self._pg.broadcast([_bytes(t)], opts)])

    def reduce(self, t: torch.Tensor, op: str, root: int, *, async_op: bool = True) -> _GlooHandle:
        buf, rop = self._reduce_args(t, op)
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = root, rop
        after = self._avg(t, op) if self.rank == root else None
        return _GlooHandle([self._pg.reduce([buf], opts)], after)

    def gather(
        self, out: torch.Tensor | None, inp: torch.Tensor, root: int, *, async_op: bool = True
    ) -> _GlooHandle:
        opts = dist.GatherOptions()
        opts.rootRank = root
        outs = [] if out is None else [_split(_bytes(out), self.world_size)]
        return _GlooHandle([self._pg.gather(outs, [_bytes(inp)], opts)])

    def scatter(
        self, out: torch.Tensor, inp: torch.Tensor | None, root: int, *, async_op: bool = True
    ) -> _GlooHandle:
        opts = dist.ScatterOptions()
        opts.rootRank = root
        ins = [] if inp is None else [_split(_bytes(inp), self.world_size)]
        return _GlooHandle([self._pg.scatter([_bytes(out)], ins, opts)])

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = True
    ) -> _GlooHandle:
        return _GlooHandle(
            [self._pg.alltoall_base(_bytes(out), _bytes(inp), [], [], dist.AllToAllOptions())]
        )

    def barrier(self, *, async_op: bool = True) -> _GlooHandle:
        return _GlooHandle([self._pg.barrier()])

    def send(self, t: torch.Tensor, dst: int, *, async_op: bool = True) -> _GlooHandle:
        return _GlooHandle([self._pg.send([_bytes(t)], dst, 0)])

    def recv(self, t: torch.Tensor, src: int, *, async_op: bool = True) -> _GlooHandle:
        return _GlooHandle([self._pg.recv([_bytes(t)], src, 0)])

    def subgroup(self, name: str, ranks: Sequence[int]) -> GlooBackend:
        return GlooBackend(
            self._store, list(ranks).index(self.rank), len(ranks), name=name, timeout=self._timeout
        )

    def abort(self, reason: str) -> None:
        self._pg.abort()

    def close(self) -> None:
        self._pg.shutdown()


def _split(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    return list(flat.view(parts, flat.numel() // parts).unbind(0))


def _opt(rop: Any) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = rop
    return opts


def create(store: Store, rank: int, world_size: int, *, name: str, timeout: float) -> GlooBackend:
    """A gloo backend for one group; every rank of it calls this with the same ``name``."""
    return GlooBackend(store, rank, world_size, name=name, timeout=seconds(timeout) or 300.0)
