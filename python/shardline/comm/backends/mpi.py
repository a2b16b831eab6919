"""The mpi backend: MPI collectives through mpi4py, on CPU tensors' own memory.

For jobs launched by ``mpirun``/``srun --mpi`` where a user prefers the site's MPI. Needs the
optional extra ``pip install shardline[mpi]`` (mpi4py) and an MPI library. The ranks are
MPI's: ``MPI.COMM_WORLD`` must agree with the rendezvous rank and world size.

Every op is MPI's nonblocking form (``Iallreduce``, ``Iallgather``, ...) on a numpy view of
the tensor (zero copy). Data movement sends raw bytes (``MPI.BYTE``), so every dtype moves,
bfloat16 included. Reductions need an MPI type: float16 and bfloat16, which MPI lacks, are
reduced in a float32 copy and rounded once; bool is reduced as uint8 (sum/max are "or",
prod/min are "and"); avg is a sum divided afterwards.

[Note: progress] MPI implementations make nonblocking collectives progress inside MPI calls,
so ``wait`` polls ``Testall`` (sleeping at most 1 ms between polls) until the op is done or
the deadline passes; a passed deadline raises ``CollectiveTimeoutError``.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from shardline.comm.backends._common import BOOL_OPS
from shardline.comm.backends._deferred import Deferred
from shardline.comm.work import Counts, seconds
from shardline.errors import (
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    ShardlineError,
)

__all__ = ["MpiBackend", "create", "mpi_module", "mpi_rank_and_size"]

_INT_MAX = 2**31 - 1
# torch dtype -> name of the MPI datatype reductions use (bool, float16, bfloat16 are mapped).
_REDUCE_TYPES = {
    torch.float32: "FLOAT",
    torch.float64: "DOUBLE",
    torch.int8: "INT8_T",
    torch.uint8: "UINT8_T",
    torch.int32: "INT32_T",
    torch.int64: "INT64_T",
}
_UPCAST = (torch.float16, torch.bfloat16)
_MPI_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN", "prod": "PROD"}


def mpi_module() -> Any:
    """Imports ``mpi4py.MPI`` (which initialises MPI), or explains how to get it.

    Raises:
        ShardlineError: mpi4py is not installed or finds no MPI library.
    """
    try:
        from mpi4py import MPI  # noqa: PLC0415
    except (ImportError, RuntimeError, OSError) as exc:
        raise ShardlineError(
            f"backend='mpi' needs mpi4py and an MPI library ({exc}); install them with "
            "`pip install shardline[mpi]` plus Open MPI or MPICH (e.g. `apt-get install "
            "libopenmpi-dev openmpi-bin`), and launch with mpirun; or use backend='native'"
        ) from exc
    return MPI


def mpi_rank_and_size() -> tuple[int, int]:
    """``MPI.COMM_WORLD``'s rank and size (initialising MPI)."""
    comm = mpi_module().COMM_WORLD
    return int(comm.Get_rank()), int(comm.Get_size())


def _bytes(t: torch.Tensor) -> Any:
    """A numpy view of ``t``'s bytes (zero copy; any dtype)."""
    flat = t.reshape(-1)
    return (flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)).numpy()


class MpiBackend:
    """Checked CPU tensors in, MPI nonblocking collectives out."""

    name = "mpi"
    transport = "mpi"

    def __init__(self, mpi: Any, comm: Any, *, name: str, timeout: float) -> None:
        self.MPI = mpi
        self._comm = comm
        self.group_name = name
        self.timeout = timeout
        self.rank = int(comm.Get_rank())
        self.world_size = int(comm.Get_size())
        self.aborted: str | None = None
        self._closed = False
        self._test_lock = threading.Lock()

    # -- plumbing ----------------------------------------------------------------------------

    def _start(
        self,
        what: str,
        start: Callable[[], list[Any]],
        after: Callable[[], None] | None = None,
        keep: tuple[object, ...] = (),
    ) -> Deferred:
        """Starts an op; its handle polls the requests (see [Note: progress])."""
        if self.aborted is not None:
            raise CommunicatorClosedError(
                f"{what} on rank {self.rank} (mpi): the group was aborted ({self.aborted}); "
                "create a new one"
            )
        try:
            requests = start()
        except self.MPI.Exception as exc:
            raise ShardlineError(f"{what} on rank {self.rank} (mpi) failed: {exc}") from exc
        # [Note: ownership] numpy views and temporaries stay alive until the op is done.
        return Deferred(
            requests, wait=partial(self._poll, what), test=self._test, after=after, keep=keep
        )

    def _test(self, requests: Sequence[Any]) -> bool:
        with self._test_lock:
            return bool(self.MPI.Request.Testall(requests))

    def _poll(self, what: str, requests: Sequence[Any], timeout: float | None) -> None:
        """Tests ``requests`` until done, the group is aborted or the deadline passes."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        pause = 0.0
        while not self._test(requests):
            if self.aborted is not None:
                raise CommunicatorClosedError(
                    f"{what} on rank {self.rank} (mpi): the group was aborted ({self.aborted}); "
                    "create a new one"
                )
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"{what} on rank {self.rank} (mpi) did not finish within {limit:.1f} s; "
                    "check that every rank runs the same collectives in the same order "
                    "(SHARDLINE_TIMEOUT sets the deadline)"
                )
            time.sleep(pause)
            pause = min(pause * 2 or 1e-5, 1e-3)

    def _count(self, what: str, n: int) -> int:
        if n > _INT_MAX:
            raise InvalidArgumentError(
                f"{what} on rank {self.rank} (mpi): {n} elements exceed MPI's count limit "
                f"({_INT_MAX}); split the tensor into smaller collectives"
            )
        return n

    def _typed(
        self, what: str, t: torch.Tensor, op: str
    ) -> tuple[torch.Tensor, Any, Any, Callable[[], None] | None]:
        """The buffer to reduce, its MPI type and op, and what copies a float32 copy back."""
        flat = t.reshape(-1)
        name = op
        if flat.dtype == torch.bool:
            flat, name = flat.view(torch.uint8), BOOL_OPS[op]
        back: Callable[[], None] | None = None
        if flat.dtype in _UPCAST:
            wide = flat.float()

            def narrow(src: torch.Tensor = wide, dst: torch.Tensor = flat) -> None:
                dst.copy_(src)

            flat, back = wide, narrow
        self._count(what, flat.numel())
        mpi_type = getattr(self.MPI, _REDUCE_TYPES[flat.dtype])
        return flat, mpi_type, getattr(self.MPI, _MPI_OPS[name]), back

    def _finish(
        self, buf: torch.Tensor, op: str, back: Callable[[], None] | None, *, here: bool = True
    ) -> Callable[[], None] | None:
        """Divides for avg and copies an upcast result back, on ranks that hold the result."""
        if not here or (back is None and op != "avg"):
            return None

        def finish() -> None:
            if op == "avg":
                buf.div_(self.world_size)
            if back is not None:
                back()

        return finish

    def _raw(self, what: str, t: torch.Tensor) -> list[Any]:
        """``[bytes, MPI.BYTE]``: mpi4py derives the counts (per rank, for gather-like ops)."""
        self._count(what, t.numel() * t.element_size())
        return [_bytes(t), self.MPI.BYTE]

    # -- collectives -------------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor, op: str, *, async_op: bool = True) -> Deferred:
        buf, typ, mop, back = self._typed("all_reduce", t, op)
        arr = buf.numpy()
        return self._start(
            "all_reduce",
            lambda: [self._comm.Iallreduce(self.MPI.IN_PLACE, [arr, typ], mop)],
            self._finish(buf, op, back),
            (buf, arr),
        )

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op: str, *, async_op: bool = True
    ) -> Deferred:
        ibuf, typ, mop, _ = self._typed("reduce_scatter", inp, op)
        obuf, _, _, back = self._typed("reduce_scatter", out, op)
        src, dst = ibuf.numpy(), obuf.numpy()
        return self._start(
            "reduce_scatter",
            lambda: [self._comm.Ireduce_scatter_block([src, typ], [dst, typ], mop)],
            self._finish(obuf, op, back),
            (ibuf, obuf, src, dst),
        )

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, counts: Counts, *, async_op: bool = True
    ) -> Deferred:
        send = self._raw("all_gather", inp)
        if counts is None:
            recv = self._raw("all_gather", out)
            return self._start(
                "all_gather", lambda: [self._comm.Iallgather(send, recv)], keep=(send, recv)
            )
        size = inp.element_size()
        sizes = [self._count("all_gather", c * size) for c in counts]
        displs = [sum(sizes[:r]) for r in range(len(sizes))]
        self._count("all_gather", sum(sizes))
        recvv = [_bytes(out), sizes, displs, self.MPI.BYTE]
        return self._start(
            "all_gather", lambda: [self._comm.Iallgatherv(send, recvv)], keep=(send, recvv)
        )

    def broadcast(self, t: torch.Tensor, root: int, *, async_op: bool = True) -> Deferred:
        buf = self._raw("broadcast", t)
        return self._start("broadcast", lambda: [self._comm.Ibcast(buf, root)], keep=(buf,))

    def reduce(self, t: torch.Tensor, op: str, root: int, *, async_op: bool = True) -> Deferred:
        buf, typ, mop, back = self._typed("reduce", t, op)
        arr = buf.numpy()
        here = self.rank == root
        send = self.MPI.IN_PLACE if here else [arr, typ]
        recv = [arr, typ] if here else None
        return self._start(
            "reduce",
            lambda: [self._comm.Ireduce(send, recv, mop, root)],
            self._finish(buf, op, back, here=here),
            (buf, arr),
        )

    def gather(
        self, out: torch.Tensor | None, inp: torch.Tensor, root: int, *, async_op: bool = True
    ) -> Deferred:
        send = self._raw("gather", inp)
        recv = None if out is None else self._raw("gather", out)
        return self._start(
            "gather", lambda: [self._comm.Igather(send, recv, root)], keep=(send, recv)
        )

    def scatter(
        self, out: torch.Tensor, inp: torch.Tensor | None, root: int, *, async_op: bool = True
    ) -> Deferred:
        send = None if inp is None else self._raw("scatter", inp)
        recv = self._raw("scatter", out)
        return self._start(
            "scatter", lambda: [self._comm.Iscatter(send, recv, root)], keep=(send, recv)
        )

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = True
    ) -> Deferred:
        send, recv = self._raw("all_to_all", inp), self._raw("all_to_all", out)
        return self._start(
            "all_to_all", lambda: [self._comm.Ialltoall(send, recv)], keep=(send, recv)
        )

    def barrier(self, *, async_op: bool = True) -> Deferred:
        return self._start("barrier", lambda: [self._comm.Ibarrier()])

    def send(self, t: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = True) -> Deferred:
        buf = self._raw("send", t)
        tag = self._tag("send", tag)
        return self._start("send", lambda: [self._comm.Isend(buf, dst, tag)], keep=(buf,))

    def recv(
        self, t: torch.Tensor, src: int | None, *, tag: int = 0, async_op: bool = True
    ) -> Deferred:
        if src is None:
            raise InvalidArgumentError(
                f"recv on rank {self.rank} (mpi): this backend receives from a named rank; "
                "pass src, or use backend 'native' or 'gloo' to receive from any source"
            )
        buf = self._raw("recv", t)
        tag = self._tag("recv", tag)
        return self._start("recv", lambda: [self._comm.Irecv(buf, src, tag)], keep=(buf,))

    def _tag(self, what: str, tag: int) -> int:
        """``tag`` if MPI can carry it (up to ``MPI.TAG_UB``, at least 32767)."""
        bound = int(self._comm.Get_attr(self.MPI.TAG_UB) or 32767)
        if tag > bound:
            raise InvalidArgumentError(
                f"{what} on rank {self.rank} (mpi): tag {tag} is above this MPI's largest "
                f"tag, {bound}; use a smaller tag"
            )
        return tag

    # -- groups ------------------------------------------------------------------------------

    def subgroup(
        self,
        name: str,
        ranks: Sequence[int],
        *,
        overlap_compute: bool = False,
        timeout: float | None = None,
    ) -> MpiBackend:
        del overlap_compute  # a hint for GPU backends; CPU collectives take no SMs
        # MPI_Comm_create_group is collective over the members only, as new_group needs.
        members = self._comm.Get_group().Incl(list(ranks))
        tag = zlib.crc32(name.encode()) & 0x7FFF
        comm = self._comm.Create_group(members, tag)
        members.Free()
        limit = self.timeout if timeout is None else timeout
        return MpiBackend(self.MPI, comm, name=name, timeout=limit)

    def abort(self, reason: str) -> None:
        # MPI cannot fail a peer's pending op short of MPI_Abort, which ends the whole job:
        # fail this rank's ops; peers fail at their own deadline.
        self.aborted = reason

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._comm.Free()


def create(store: object, rank: int, world_size: int, *, name: str, timeout: float) -> MpiBackend:
    """The mpi backend for a root group (sub-groups come from ``MpiBackend.subgroup``).

    Args:
        store: Unused (MPI has its own rendezvous); accepted for a uniform signature.
        rank: The rendezvous rank; must equal ``MPI.COMM_WORLD``'s.
        world_size: The rendezvous world size; must equal ``MPI.COMM_WORLD``'s.
        name: Group name, for messages.
        timeout: Deadline of every blocking wait, in seconds.

    Raises:
        ShardlineError: mpi4py or MPI is missing, or MPI's ranks differ from the rendezvous.
    """
    del store
    mpi = mpi_module()
    world = mpi.COMM_WORLD
    # Every MPI rank checks every rank's pair, so all fail together instead of some hanging.
    pairs = world.allgather((rank, world_size))
    wrong = [
        f"MPI rank {r} has rank {pr} of {pw}"
        for r, (pr, pw) in enumerate(pairs)
        if (pr, pw) != (r, len(pairs))
    ]
    if wrong:
        raise ShardlineError(
            f"backend='mpi' on MPI rank {world.Get_rank()} of {world.Get_size()}: the "
            f"rendezvous disagrees with MPI ({'; '.join(wrong)}); launch every rank with "
            "mpirun/srun and leave RANK and WORLD_SIZE unset, or set them to MPI's "
            "(OMPI_COMM_WORLD_RANK, PMI_RANK)"
        )
    # A private communicator, so user code on COMM_WORLD never matches our messages.
    return MpiBackend(mpi, world.Dup(), name=name, timeout=seconds(timeout) or 300.0)
