"""``ProcessGroup``: the collectives every strategy calls, on any backend.

A ProcessGroup checks arguments at the edge (device, layout, dtype, sizes) before anything is
sent, turns list-shaped arguments into flat buffers, keeps tensors alive while ops run, and
delegates to a backend (``native``, ``gloo``, ``mpi``; ``nccl`` for CUDA tensors) that only
sees flat, checked tensors on its device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from shardline import config
from shardline.comm import _shapes as shapes
from shardline.comm import failures, p2p, traffic
from shardline.comm._buffers import as_tensor, check_numel, check_same_dtype, parse_op
from shardline.comm.flight import RECORDER
from shardline.comm.work import Handle, Work
from shardline.errors import (
    CommunicatorClosedError,
    InvalidArgumentError,
    PeerLostError,
    ShardlineError,
)

if TYPE_CHECKING:
    from shardline.comm._buffers import TensorLike
    from shardline.comm.work import Backend

__all__ = ["ProcessGroup"]

TensorList = Sequence["TensorLike"]


class ProcessGroup:
    """A set of ranks that run collectives together.

    Create one with ``shardline.init()`` (the default group), ``init_process_group()`` or
    ``new_group()``. Every rank of the group must call the same collectives in the same order.
    The group's ``timeout`` bounds every blocking wait of its ranks: its collectives, and the
    waits of what runs on it (a checkpoint's commit, an async SGD round, ...).
    Inputs are contiguous CPU tensors or numpy arrays, used in place (zero copy); list-shaped
    outputs are filled from a flat buffer. On the ``nccl`` backend they are CUDA tensors on
    the group's ``device`` instead.

    Attributes:
        rank: This process's rank within the group.
        world_size: Number of ranks in the group.
        backend: ``"native"``, ``"gloo"``, ``"nccl"`` or ``"mpi"``.
        device: Where the group's tensors live: ``cuda:N`` for nccl, else ``cpu``.
        name: Unique name of the group (``"world"``, ``"world.0"``, ...).
        ranks: Ranks of the parent group that form this one (``None`` for a root group).
        global_ranks: The job's rank of each of this group's ranks.
        timeout: Seconds a blocking wait of this group may take (read-only; see ``timeout``).
    """

    def __init__(
        self,
        impl: Backend,
        *,
        ranks: Sequence[int] | None = None,
        global_ranks: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Wraps ``impl``, a backend's group that runs with deadline ``timeout`` (seconds).

        Args:
            impl: The backend's group.
            ranks: Ranks of the parent group that form this one (``None``: a root group).
            global_ranks: The job's rank of each rank; ``range(world_size)`` by default.
            timeout: The deadline ``impl`` was created with; ``SHARDLINE_TIMEOUT`` or 300 s
                when ``None``.

        Raises:
            InvalidArgumentError: ``timeout`` is not a positive number of seconds.
        """
        seconds = config.default_timeout() if timeout is None else float(timeout)
        if not seconds > 0:
            raise InvalidArgumentError(f"timeout must be positive, got {seconds} s")
        self._timeout = seconds
        self._impl = impl
        self._wait_blocking = not getattr(impl, "completes_blocking_ops", False)
        self.rank = impl.rank
        self.world_size = impl.world_size
        self.backend = impl.name
        # Only the nccl backend has a device (CUDA); None keeps the CPU checks' fast path.
        self._device: torch.device | None = getattr(impl, "device", None)
        self.device = self._device if self._device is not None else torch.device("cpu")
        self.name = getattr(impl, "group_name", "world")
        self.ranks = tuple(ranks) if ranks is not None else None
        self._pending: list[Work] = []  # keeps in-flight ops' tensors alive
        self._prune_at = 64
        self._children: list[ProcessGroup] = []
        self._num_subgroups = 0
        self._closed = False
        self._lock = threading.Lock()
        self._peer_lost: PeerLostError | None = None
        self.global_ranks = tuple(global_ranks or range(self.world_size))
        # Op numbers for the flight recorder: collectives per group, messages per peer.
        self._seq = 0
        self._messages: dict[tuple[str, int], int] = {}
        self._traffic = traffic.Traffic()
        RECORDER.groups[self.name] = list(self.global_ranks)

    def __repr__(self) -> str:
        return (
            f"ProcessGroup(name={self.name!r}, backend={self.backend!r}, rank={self.rank}, "
            f"world_size={self.world_size}, transport={self.transport!r})"
        )

    @property
    def timeout(self) -> float:
        """Seconds a blocking wait of this group may take, fixed when the group was created.

        ``init(timeout=...)`` or ``init_process_group(timeout=...)`` sets it (else
        ``SHARDLINE_TIMEOUT``, else 300 s); a sub-group inherits its parent's unless
        ``new_group`` is given one. It bounds the group's collectives and the waits of work
        that runs on the group: a checkpoint's commit, async SGD's rounds.
        """
        return self._timeout

    def engine(self) -> Any:
        """The native engine's communicator under this group (symmetric memory); else None."""
        return getattr(self._impl, "engine", None)

    @property
    def transport(self) -> str:
        """How ranks talk: ``"single"``, ``"shm"``, ``"tcp"``, ``"hierarchical"`` or ``"gloo"``."""
        return self._impl.transport

    # -- plumbing ----------------------------------------------------------------------------

    def _t(self, value: object, what: str) -> torch.Tensor:
        return as_tensor(value, what=what, rank=self.rank, device=self._device)

    def _check_rank(self, op: str, role: str, r: int) -> None:
        if not isinstance(r, int) or not 0 <= r < self.world_size:
            raise InvalidArgumentError(
                f"{op} on rank {self.rank}: {role}={r!r} is not a rank of this group "
                f"(world_size {self.world_size})"
            )

    def _submit(
        self,
        op: str,
        start: Callable[[bool], Handle],
        keepalive: tuple[object, ...],
        async_op: bool,
        finalize: Callable[[], None] | None = None,
        peer: int | None = None,
    ) -> Work | None:
        if self._closed:
            raise CommunicatorClosedError(
                f"{op} on rank {self.rank}: group {self.name!r} was shut down; create a new one"
            )
        record = self._record(op, keepalive, peer) if RECORDER.listening else None
        if not async_op:
            # Blocking calls run inline on the caller in the native engine (no thread
            # hand-off); the caller's frame keeps the tensors alive meanwhile.
            try:
                handle = start(False)
                if self._wait_blocking:
                    handle.wait()
            except ShardlineError as exc:
                out = self._failed(record, exc)
                if out is exc:
                    raise
                raise out from exc
            RECORDER.timed(record, handle)  # the op's GPU times, to a tracer that takes them
            RECORDER.finish(record)
            if finalize is not None:
                finalize()
            return None
        try:
            handle = start(True)
        except ShardlineError as exc:
            out = self._failed(record, exc)
            if out is exc:
                raise
            raise out from exc
        RECORDER.timed(record, handle)
        work = Work(handle, keepalive, finalize, self._failed, record)
        with self._lock:
            # Pruned only when the list has doubled: checking every Work on every call would
            # cost O(n^2) completion queries (CUDA event queries for nccl) per burst of ops.
            if len(self._pending) >= self._prune_at:
                self._pending = [w for w in self._pending if not w._done()]
                self._prune_at = max(64, 2 * len(self._pending))
            self._pending.append(work)
        return work

    def _record(
        self, op: str, keepalive: tuple[object, ...], peer: int | None
    ) -> list[object] | None:
        """The flight recorder's record of an op starting now (see ``comm.flight``).

        On every op's path: about 0.7 us (benches/bench_flight.py). Past this frame, ``_submit``'s
        and its caller's (an op of this group or of ``p2p``) lies the program's line.
        """
        if peer is None:
            seq = self._seq
            self._seq = seq + 1
        else:
            seq = self._messages.get((op, peer), 0)
            self._messages[(op, peer)] = seq + 1
        t = keepalive[-1] if keepalive else None  # the flat tensor, gather's/scatter's own part
        if isinstance(t, torch.Tensor):
            return RECORDER.start(self.name, seq, op, t.numel(), t.dtype, peer, 3)
        return RECORDER.start(self.name, seq, op, 0, None, peer, 3)

    def _failed(self, record: list[object] | None, exc: ShardlineError) -> ShardlineError:
        """An op of this group failed here: noted, then ``failures.explained``."""
        if isinstance(exc, PeerLostError) and self._peer_lost is None:
            self._peer_lost = exc
        return failures.explained(self, record, exc)

    def _lost_peer(self) -> PeerLostError | None:
        """The first ``PeerLostError`` an op of this group, or of a sub-group, raised here."""
        if self._peer_lost is not None:
            return self._peer_lost
        return next((e for c in self._children if (e := c._lost_peer()) is not None), None)

    # -- collectives -------------------------------------------------------------------------

    def all_reduce(
        self, tensor: TensorLike, op: object = "sum", async_op: bool = False
    ) -> Work | None:
        """Reduces ``tensor`` across ranks in place; every rank gets the result.

        Args:
            tensor: Contiguous CPU tensor or numpy array, overwritten with the result.
            op: ``"sum"``, ``"avg"`` (float dtypes), ``"max"``, ``"min"`` or ``"prod"``;
                on bool, sum/max are "or" and prod/min are "and".
            async_op: Return a ``Work`` instead of waiting.
        """
        t = self._t(tensor, "all_reduce(tensor)")
        name = parse_op(op, dtype=t.dtype, what="all_reduce", rank=self.rank)
        self._count("all_reduce", traffic.all_reduce(self.world_size, t.nbytes))
        return self._submit(
            "all_reduce",
            lambda a: self._impl.all_reduce(t, name, async_op=a),
            (tensor, t),
            async_op,
        )

    def reduce_scatter(
        self,
        output: TensorLike,
        input: TensorLike | TensorList,
        op: object = "sum",
        async_op: bool = False,
    ) -> Work | None:
        """Reduces ``input`` across ranks; rank ``i`` gets slice ``i`` of the result.

        Args:
            output: This rank's slice, ``n`` elements.
            input: ``world_size * n`` elements (flat), or a list of ``world_size`` tensors of
                ``n`` elements (copied into one buffer first).
            op: Reduction, as for ``all_reduce``.
            async_op: Return a ``Work`` instead of waiting.
        """
        out = self._t(output, "reduce_scatter(output)")
        inp = shapes.flat_input(self, input, "reduce_scatter", out.numel(), out)
        check_same_dtype("reduce_scatter", self.rank, out, inp)
        check_numel(
            "reduce_scatter(input)",
            self.rank,
            self.world_size * out.numel(),
            inp,
            lambda: f"world_size {self.world_size} x output's {out.numel()}",
        )
        name = parse_op(op, dtype=out.dtype, what="reduce_scatter", rank=self.rank)
        self._count("reduce_scatter", traffic.reduce_scatter(self.world_size, inp.nbytes))
        return self._submit(
            "reduce_scatter",
            lambda a: self._impl.reduce_scatter(out, inp, name, async_op=a),
            (output, input, out, inp),
            async_op,
        )

    def all_gather(
        self, output: TensorLike | TensorList, input: TensorLike, async_op: bool = False
    ) -> Work | None:
        """Gathers every rank's ``input`` on every rank.

        Args:
            output: A flat tensor of ``world_size * input.numel()`` elements (rank-major), or a
                list of ``world_size`` tensors; list entries may differ in size (unequal
                all_gather), entry ``i`` holding rank ``i``'s input.
            input: This rank's contribution.
            async_op: Return a ``Work`` instead of waiting.
        """
        inp = self._t(input, "all_gather(input)")
        if isinstance(output, list | tuple):
            outs = shapes.tensor_list(self, output, "all_gather(output)", inp, self.world_size)
            counts = [o.numel() for o in outs]
            check_numel(
                f"all_gather(output[{self.rank}])",
                self.rank,
                inp.numel(),
                outs[self.rank],
                "this rank's entry must match its input",
            )
            flat = torch.empty(sum(counts), dtype=inp.dtype, device=inp.device)
            equal = len(set(counts)) == 1
            self._count(
                "all_gather",
                traffic.all_gather(self.world_size, inp.nbytes, flat.nbytes),
            )
            return self._submit(
                "all_gather",
                lambda a: self._impl.all_gather(flat, inp, None if equal else counts, async_op=a),
                (output, input, inp, flat),
                async_op,
                shapes.scatter_into(flat, outs),
            )
        out = self._t(output, "all_gather(output)")
        check_same_dtype("all_gather", self.rank, inp, out)
        check_numel(
            "all_gather(output)",
            self.rank,
            self.world_size * inp.numel(),
            out,
            lambda: f"world_size {self.world_size} x input's {inp.numel()}",
        )
        self._count("all_gather", traffic.all_gather(self.world_size, inp.nbytes, out.nbytes))
        return self._submit(
            "all_gather",
            lambda a: self._impl.all_gather(out, inp, None, async_op=a),
            (output, input, out, inp),
            async_op,
        )

    def broadcast(self, tensor: TensorLike, src: int = 0, async_op: bool = False) -> Work | None:
        """Copies rank ``src``'s ``tensor`` into ``tensor`` on every rank."""
        t = self._t(tensor, "broadcast(tensor)")
        self._check_rank("broadcast", "src", src)
        self._count("broadcast", self._rooted(t, src == self.rank, to_root=False, parts=False))
        return self._submit(
            "broadcast", lambda a: self._impl.broadcast(t, src, async_op=a), (tensor, t), async_op
        )

    def reduce(
        self, tensor: TensorLike, dst: int = 0, op: object = "sum", async_op: bool = False
    ) -> Work | None:
        """Reduces ``tensor`` across ranks into rank ``dst``'s ``tensor``.

        Other ranks' tensors are inputs only; their contents afterwards are unspecified.
        """
        t = self._t(tensor, "reduce(tensor)")
        self._check_rank("reduce", "dst", dst)
        name = parse_op(op, dtype=t.dtype, what="reduce", rank=self.rank)
        self._count("reduce", self._rooted(t, dst == self.rank, to_root=True, parts=False))
        return self._submit(
            "reduce", lambda a: self._impl.reduce(t, name, dst, async_op=a), (tensor, t), async_op
        )

    def gather(
        self,
        tensor: TensorLike,
        gather_list: TensorLike | TensorList | None = None,
        dst: int = 0,
        async_op: bool = False,
    ) -> Work | None:
        """Gathers every rank's ``tensor`` on rank ``dst``.

        Args:
            tensor: This rank's contribution.
            gather_list: On ``dst``: a list of ``world_size`` tensors like ``tensor``, or one
                flat tensor of ``world_size * tensor.numel()`` elements. Ignored elsewhere.
            dst: The receiving rank.
            async_op: Return a ``Work`` instead of waiting.
        """
        inp = self._t(tensor, "gather(tensor)")
        self._check_rank("gather", "dst", dst)
        out, finalize = None, None
        keep: list[object] = [tensor, inp]
        if self.rank == dst:
            if gather_list is None:
                raise InvalidArgumentError(
                    f"gather on rank {self.rank}: the destination rank must pass gather_list"
                )
            out, finalize = shapes.flat_output(self, gather_list, "gather", inp)
            keep[1:] = [gather_list, out, inp]  # this rank's own part last: what is recorded
        self._count("gather", self._rooted(inp, dst == self.rank, to_root=True, parts=True))
        return self._submit(
            "gather",
            lambda a: self._impl.gather(out, inp, dst, async_op=a),
            tuple(keep),
            async_op,
            finalize,
        )

    def scatter(
        self,
        tensor: TensorLike,
        scatter_list: TensorLike | TensorList | None = None,
        src: int = 0,
        async_op: bool = False,
    ) -> Work | None:
        """Rank ``src`` sends entry ``i`` of ``scatter_list`` to rank ``i``'s ``tensor``.

        Args:
            tensor: Output on every rank.
            scatter_list: On ``src``: a list of ``world_size`` tensors like ``tensor`` (copied
                into one buffer), or a flat tensor of ``world_size * tensor.numel()``.
            src: The sending rank.
            async_op: Return a ``Work`` instead of waiting.
        """
        out = self._t(tensor, "scatter(tensor)")
        self._check_rank("scatter", "src", src)
        inp = None
        keep: list[object] = [tensor, out]
        if self.rank == src:
            if scatter_list is None:
                raise InvalidArgumentError(
                    f"scatter on rank {self.rank}: the source rank must pass scatter_list"
                )
            inp = shapes.flat_input(self, scatter_list, "scatter", out.numel(), out)
            check_same_dtype("scatter", self.rank, out, inp)
            check_numel(
                "scatter(scatter_list)",
                self.rank,
                self.world_size * out.numel(),
                inp,
                f"world_size {self.world_size} x tensor's {out.numel()}",
            )
            keep[1:] = [scatter_list, inp, out]  # this rank's own part last: what is recorded
        self._count("scatter", self._rooted(out, src == self.rank, to_root=False, parts=True))
        return self._submit(
            "scatter",
            lambda a: self._impl.scatter(out, inp, src, async_op=a),
            tuple(keep),
            async_op,
        )

    def all_to_all(
        self, output: TensorLike, input: TensorLike, async_op: bool = False
    ) -> Work | None:
        """Sends slice ``j`` of ``input`` to rank ``j``, which stores it as its slice ``i``.

        Both are flat-equivalent tensors of ``world_size * n`` elements (equal splits).
        """
        out = self._t(output, "all_to_all(output)")
        inp = self._t(input, "all_to_all(input)")
        check_same_dtype("all_to_all", self.rank, inp, out)
        check_numel("all_to_all(output)", self.rank, inp.numel(), out, "the input's size")
        if inp.numel() % self.world_size:
            raise InvalidArgumentError(
                f"all_to_all on rank {self.rank}: {inp.numel()} elements do not split evenly "
                f"among {self.world_size} ranks; pad the input to a multiple of world_size"
            )
        self._count("all_to_all", traffic.all_to_all(self.world_size, inp.nbytes))
        return self._submit(
            "all_to_all",
            lambda a: self._impl.all_to_all(out, inp, async_op=a),
            (output, input, out, inp),
            async_op,
        )

    def barrier(self, async_op: bool = False) -> Work | None:
        """Returns once every rank of the group has called ``barrier``."""
        return self._submit("barrier", lambda a: self._impl.barrier(async_op=a), (), async_op)

    def send(
        self, tensor: TensorLike, dst: int, async_op: bool = False, *, tag: int = 0
    ) -> Work | None:
        """Sends ``tensor`` to rank ``dst``, which receives it with ``recv`` (same size).

        Messages between two ranks arrive in the order sent; ``tag`` labels a message, and a
        ``recv`` takes the first one with its tag, so differently tagged messages may be
        received in any order (as with Gloo and MPI).
        """
        return p2p.send(self, tensor, dst, async_op, tag)

    def recv(
        self, tensor: TensorLike, src: int | None = None, async_op: bool = False, *, tag: int = 0
    ) -> Work | int:
        """Receives into ``tensor`` the next message tagged ``tag`` from rank ``src``.

        With ``src=None``, takes the first such message from whichever rank sends one
        (native and gloo backends).

        Returns:
            The rank the message came from; with ``async_op``, a ``Work`` whose ``source``
            says it once the receive is done.
        """
        return p2p.recv(self, tensor, src, async_op, tag)

    # -- traffic -----------------------------------------------------------------------------

    def traffic(self, *, subgroups: bool = False) -> dict[str, dict[str, int]]:
        """Calls and bytes ``sent`` / ``received`` by this rank, per op kind, so far.

        Bytes are what a bandwidth-optimal algorithm moves through this rank's link (see
        ``shardline.comm.traffic``). ``subgroups=True`` adds the sub-groups' counts.
        """
        own = self._traffic.snapshot()
        if not subgroups:
            return own
        return traffic.merge(own, *(c.traffic(subgroups=True) for c in self._children))

    def reset_traffic(self) -> None:
        """Starts this group's counts (not its sub-groups') from zero."""
        self._traffic.reset()

    def _count(self, op: str, moved: tuple[float, float]) -> None:
        self._traffic.add(op, *moved)
        extra = traffic.charge()
        if extra is not None:
            extra.add(op, *moved)

    def _rooted(
        self, t: torch.Tensor, root: bool, *, to_root: bool, parts: bool
    ) -> tuple[float, float]:
        return traffic.rooted(self.world_size, t.nbytes, root=root, to_root=to_root, parts=parts)

    # -- groups ------------------------------------------------------------------------------

    def new_group(
        self,
        ranks: Sequence[int],
        *,
        overlap_compute: bool = False,
        timeout: timedelta | float | None = None,
    ) -> ProcessGroup | None:
        """Creates a sub-group of ``ranks`` (ranks of this group).

        Every rank of this group must call ``new_group`` with the same ranks, in the same order
        as its other ``new_group`` calls (torch.distributed semantics); ranks outside the
        sub-group get ``None``. The sub-group's rank ``i`` is the ``i``-th smallest member.
        ``overlap_compute`` says the group's collectives will run beside compute: on NCCL they
        then take fewer thread blocks (``SHARDLINE_NCCL_OVERLAP_CTAS``, default 8), so fewer
        SMs are taken from the kernels they overlap; CPU backends ignore it.

        The sub-group's ``timeout`` is this group's unless ``timeout`` (seconds or a
        ``timedelta``) is given.
        """
        seconds = self._timeout if timeout is None else _seconds(timeout, self.rank)
        members = sorted({int(r) for r in ranks})
        if len(members) != len(list(ranks)) or not members:
            raise InvalidArgumentError(
                f"new_group on rank {self.rank}: ranks {list(ranks)} must be distinct and non-empty"
            )
        for r in members:
            self._check_rank("new_group", "rank", r)
        name, self._num_subgroups = f"{self.name}.{self._num_subgroups}", self._num_subgroups + 1
        if self.rank not in members:
            failures.left_out(self, name, members)  # for a timeout's error on this group
            return None
        if timeout is None:  # the backend's sub-group keeps its parent's deadline
            impl = self._impl.subgroup(name, members, overlap_compute=overlap_compute)
        else:
            impl = self._impl.subgroup(
                name, members, overlap_compute=overlap_compute, timeout=seconds
            )
        child = ProcessGroup(
            impl,
            ranks=members,
            global_ranks=[self.global_ranks[r] for r in members],
            timeout=seconds,
        )
        self._children.append(child)
        return child

    def abort(self, reason: str = "aborted by the user") -> None:
        """Fails every pending and future op of this group, here and on its peers."""
        self._impl.abort(reason)

    def shutdown(self) -> None:
        """Waits for queued ops, then releases the transport; later calls raise.

        Sub-groups created from this group are shut down first. Idempotent.
        """
        if self._closed:
            return
        for child in self._children:
            child.shutdown()
        self._closed = True
        self._impl.close()
        self._pending.clear()


def _seconds(timeout: timedelta | float, rank: int) -> float:
    """``timeout`` in seconds; ``InvalidArgumentError`` unless it is positive."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise InvalidArgumentError(
            f"new_group on rank {rank}: timeout must be positive, got {seconds} s"
        )
    return seconds
