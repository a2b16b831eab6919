"""The nccl backend: torch's ``ProcessGroupNCCL``, built directly, for CUDA tensors.

CUDA tensors never travel through shardline's own wire: this backend hands them to NCCL
through torch.distributed, constructed like the gloo backend from the job's store, this rank
and the group size (no global state). Each rank drives one GPU, ``device`` (by default
``cuda:LOCAL_RANK``), which it makes the current CUDA device.

[Note: stream semantics] as in torch.distributed, ``wait()`` without a timeout makes the
current CUDA stream wait for the collective; it does not block the CPU. Work queued on that
stream afterwards (including the steps this module adds, such as un-padding an unequal
all_gather) sees the result. ``wait(timeout)`` blocks the CPU until the op is done.

[Note: eager connect] the communicator is created when the group is (so a missing peer fails
at init, not in the first collective). send/recv then run on that communicator, in issue
order with the collectives, as on every other backend; torch logs a one-time note about this
serialisation (``TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false`` hides it).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from shardline import config
from shardline.comm.backends._common import (
    BOOL_OPS,
    as_bytes,
    gather_args,
    pad_unequal,
    scatter_args,
)
from shardline.comm.backends._deferred import DONE, Deferred, EventWaits, TracedDeferred
from shardline.comm.flight import RECORDER
from shardline.comm.rendezvous.store import StoreClient, store_barrier
from shardline.comm.trace import device as device_times
from shardline.comm.work import Counts, seconds
from shardline.errors import (
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    ShardlineError,
)

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["NcclBackend", "create", "default_device"]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


def default_device(local_rank: int | None = None) -> torch.device:
    """This rank's GPU: ``SHARDLINE_DEVICE=cuda:N`` if set, else ``cuda:<local_rank>``.

    Args:
        local_rank: The rank among this host's processes; ``LOCAL_RANK`` (else 0) if ``None``.

    Raises:
        ShardlineError: CUDA is unavailable, or the GPU index does not exist on this host.
    """
    if not torch.cuda.is_available():
        raise ShardlineError(
            "backend='nccl' needs CUDA, but torch.cuda.is_available() is False; use "
            "backend='native' for CPU tensors (or check CUDA_VISIBLE_DEVICES and the driver)"
        )
    spec = config.get("SHARDLINE_DEVICE") or ""
    if spec.startswith("cuda:"):
        index = _index(spec[len("cuda:") :], "SHARDLINE_DEVICE", spec)
        source = f"SHARDLINE_DEVICE={spec}"
    else:
        if local_rank is None:
            given = config.env_var("LOCAL_RANK", default="0") or "0"
            local_rank = _index(given, "LOCAL_RANK", None)
        index, source = local_rank, f"LOCAL_RANK={local_rank}"
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ShardlineError(
            f"{source} selects cuda:{index} but this host has {count} GPU(s) visible; run at "
            "most one process per GPU (nproc-per-node <= GPUs), or set SHARDLINE_DEVICE=cpu "
            "with backend='native' for CPU training"
        )
    return torch.device("cuda", index)


def _index(raw: str, name: str, spec: str | None) -> int:
    try:
        return int(raw)
    except ValueError:
        shown = spec if spec is not None else raw
        raise ShardlineError(f"{name}={shown!r} does not name a GPU index") from None


def _translate(exc: RuntimeError, what: str, rank: int) -> ShardlineError:
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return CollectiveTimeoutError(
            f"{what} on rank {rank} (nccl) timed out: {text}; check that every rank runs the "
            "same collectives in the same order (SHARDLINE_TIMEOUT sets the deadline)"
        )
    return CommunicatorClosedError(
        f"{what} on rank {rank} (nccl) failed: {text}; the NCCL communicator cannot be used "
        "again, create a new group (a peer may have died)"
    )


# How a traced asynchronous op's handle waits: on the event after the op (``_run_timed``).
_TRACED_WAITS = EventWaits(
    device_times.wait_done, device_times.done_reached, device_times.release_done
)


@functools.cache
def _translator(what: str, rank: int) -> Callable[[RuntimeError], ShardlineError]:
    """``_translate`` for ``what`` on ``rank``: one per op kind, not one per op."""
    return functools.partial(_translate, what=what, rank=rank)


def _with_async(opts: Any, async_op: bool) -> Any:
    """``opts`` told whether the caller waits for the op, as ``torch.distributed`` tells it.

    A blocking op (``asyncOp=False``) runs on the caller's current stream instead of NCCL's
    own: no event recorded and waited on around it, which made each of our small blocking
    collectives cost several microseconds of CPU more than torch's own call (measured with
    ``benches/probe_nccl_calls.py``). Torch builds without the field keep their default.
    """
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = async_op
    return opts


def _queued_async(async_op: bool) -> bool:
    """Whether torch queues the op on its own NCCL stream (``asyncOp``).

    An asynchronous op, unless it is timed on its GPU (``_timed``): it then runs as a blocking
    op on the group's own stream (``_run_timed``).
    """
    return async_op and (RECORDER.device_sink is None or not _timed())  # (no call untraced)


def _timed() -> bool:
    """Whether the op queued now is timed on its GPU.

    It is while a tracer takes GPU times, unless the current stream is being captured into a
    CUDA graph. Under capture the op runs as it would untraced: a graph has no place for our
    events and stream switches (they would be replayed with it), and nothing reads them.
    """
    return RECORDER.device_sink is not None and not torch._C._cuda_isCurrentStreamCapturing()


# Thread blocks per collective of a group whose collectives overlap compute (ZeRO's gathers
# and reductions): with fewer blocks the collectives take fewer SMs from the GEMMs beside
# them, and zero3 on two H100s ran slightly faster with 8 than with NCCL's choice.
OVERLAP_CTAS: int = config.setting("SHARDLINE_NCCL_OVERLAP_CTAS").parsed_default


def _max_ctas(overlap_compute: bool) -> int | None:
    """Thread blocks per collective at most (``None``: NCCL's choice).

    ``SHARDLINE_NCCL_MAX_CTAS`` caps every group of ours. Without it, groups created with
    ``overlap_compute`` take ``SHARDLINE_NCCL_OVERLAP_CTAS`` (default ``OVERLAP_CTAS``; 0 is
    NCCL's choice) and the others NCCL's choice.
    """
    every: int | None = config.get("SHARDLINE_NCCL_MAX_CTAS")
    overlap: int = config.get("SHARDLINE_NCCL_OVERLAP_CTAS")
    if every is not None:
        return every
    if not overlap_compute:
        return None
    return overlap or None


class NcclBackend:
    """Checked CUDA tensors in, torch NCCL collectives out."""

    name = "nccl"
    transport = "nccl"

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        *,
        name: str,
        timeout: float,
        device: torch.device,
        overlap_compute: bool = False,
    ) -> None:
        ctas = _max_ctas(overlap_compute)
        self._store = store
        self._timeout = timeout
        self.group_name = name
        self.rank = rank
        self.world_size = world_size
        self.device = device
        torch.cuda.set_device(device)
        self._gpu: int = device.index if device.index is not None else 0
        self._side: device_times.SideStream | None = None  # for traced asynchronous ops
        prefixed = dist.PrefixStore(f"shardline/{name}/nccl", store)  # type: ignore[attr-defined]
        opts: Any = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout)
        opts.is_high_priority_stream = False
        if ctas:
            # Fewer thread blocks per collective: less of the GPU taken from the compute that
            # collectives overlap with, at some bandwidth (NCCL's config.maxCTAs).
            opts.config.max_ctas = ctas
        client = StoreClient(store, rank=rank, task=f"creating group {name!r}")
        # NCCL's own setup blocks where nothing can stop it: meet here first, so a rank that
        # failed before (no GPU for it) stops the others within a second, not at the deadline.
        store_barrier(
            client, f"shardline/{name}/nccl-ready", world_size, timeout, "meeting before NCCL setup"
        )
        with client.step("setting up NCCL through the store", store_only=True):
            # torch's stubs do not list ProcessGroup methods; they exist at runtime.
            self._pg: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        # Options are read when an op is queued: one object per (kind, reduction, blocking)
        # serves every call.
        self._opts: dict[tuple[Any, ...], Any] = {}
        if hasattr(self._pg, "eager_connect_single_device"):
            # Connect now, so a missing peer fails here and not in the first collective.
            with client.step("connecting NCCL through the store", store_only=True):
                self._pg.eager_connect_single_device(device)

    def _run(
        self,
        what: str,
        fn: Callable[..., dist.Work | None],
        args: tuple[Any, ...],
        async_op: bool,
        after: Callable[[], None] | None = None,
        keep: tuple[object, ...] = (),
    ) -> Deferred:
        """Queues ``fn(*args)`` (one torch op); a blocking call waits and returns ``DONE``.

        The hot path of every collective: no closure is built, errors are translated. While
        it is timed on its GPU (``_timed``), ``_run_timed`` runs it instead.
        """
        if RECORDER.device_sink is not None and _timed():  # (no call when untraced)
            return self._run_timed(what, fn, args, async_op, after, keep)
        try:
            work = fn(*args)
            if not async_op and work is not None:  # asyncOp=False: on the current stream
                work.wait()
        except RuntimeError as exc:
            raise _translate(exc, what, self.rank) from exc
        if async_op:
            return Deferred(
                [work] if work is not None else (),  # None: run blocking (tracing stopped)
                after=after,
                translate=_translator(what, self.rank),
                keep=keep,
            )
        if after is not None:
            after()
        return DONE

    def _run_timed(
        self,
        what: str,
        fn: Callable[..., dist.Work | None],
        args: tuple[Any, ...],
        async_op: bool,
        after: Callable[[], None] | None,
        keep: tuple[object, ...],
    ) -> Deferred:
        """``_run`` between two events, the handle carrying the op's ``timing`` on the GPU.

        A blocking op runs on the current stream; an asynchronous one on the group's own
        stream, which waits for the current one first (see ``shardline.comm.trace.device``).
        Either is waited for on the stream it ran on, so the end event follows it; the
        caller's ``wait`` makes its own stream wait for an asynchronous op's end.
        """
        gpu = self._gpu
        if not async_op:
            start = device_times.begin(gpu)
            try:
                work = fn(*args)
                if work is not None:  # on NCCL's stream (send, recv): this stream waits for it
                    work.wait()
            except RuntimeError as exc:
                raise _translate(exc, what, self.rank) from exc
            end = device_times.begin(gpu)
            if after is not None:
                after()
            handle = Deferred()
            handle.timing = device_times.OpTiming(gpu, None, start, end, (), time.time())
            return handle
        side = self._side
        if side is None:
            side = self._side = device_times.SideStream(gpu)
        start, back = device_times.enter(side)
        try:
            work = fn(*args)
            if work is not None:
                work.wait()
            end, done = device_times.close(side)
        except RuntimeError as exc:
            raise _translate(exc, what, self.rank) from exc
        finally:
            device_times.leave(back)
        return TracedDeferred(
            ((gpu, done),),
            device_times.OpTiming(gpu, self.group_name, start, end, [], time.time()),
            after,
            _translator(what, self.rank),
            (*keep, args),  # torch keeps none of a blocking op's buffers
            _TRACED_WAITS,
        )

    def _options(self, kind: type, async_op: bool, op: str | None = None, root: int = -1) -> Any:
        """Torch's options object for one op, made once and kept (see ``_with_async``).

        Keyed by plain values (a reduction's name, not torch's ``ReduceOp``, whose hash is a
        slow call): looking it up is a few hundred nanoseconds. While a tracer takes GPU
        times, an asynchronous op is queued as a blocking one (on the group's own stream:
        ``_run_timed``).
        """
        async_op = _queued_async(async_op)
        key = (kind, async_op, op, root)
        opts = self._opts.get(key)
        if opts is None:
            opts = _with_async(kind(), async_op)
            if op is not None:
                opts.reduceOp = _OPS[op]
            if root >= 0:
                opts.rootRank = root
            self._opts[key] = opts
        return opts

    def _reduce_args(self, t: torch.Tensor, op: str) -> tuple[torch.Tensor, str]:
        """The flat buffer and the reduction's name for reducing ``t`` (bool as uint8)."""
        if t.dtype == torch.bool:
            return as_bytes(t), BOOL_OPS[op]
        return (t if t.dim() == 1 else t.reshape(-1)), op

    def all_reduce(self, t: torch.Tensor, op: str, *, async_op: bool = True) -> Deferred:
        buf, name = self._reduce_args(t, op)
        opts = self._options(dist.AllreduceOptions, async_op, name)
        return self._run("all_reduce", self._pg.allreduce, ([buf], opts), async_op)

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op: str, *, async_op: bool = True
    ) -> Deferred:
        obuf, name = self._reduce_args(out, op)
        ibuf, _ = self._reduce_args(inp, op)
        opts = self._options(dist.ReduceScatterOptions, async_op, name)
        return self._run(
            "reduce_scatter", self._pg._reduce_scatter_base, (obuf, ibuf, opts), async_op
        )

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, counts: Counts, *, async_op: bool = True
    ) -> Deferred:
        opts = self._options(AllgatherOptions, async_op)
        if counts is None:
            if out.dtype == torch.bool:  # NCCL moves every other dtype of ours as it is
                out, inp = as_bytes(out), as_bytes(inp)
            return self._run("all_gather", self._pg._allgather_base, (out, inp, opts), async_op)
        # Unequal sizes: gather equal, padded slots, then copy each rank's part out.
        padded, gathered, unpad = pad_unequal(out, inp, counts, self.world_size)
        args = (as_bytes(gathered), as_bytes(padded), opts)
        return self._run(
            "all_gather", self._pg._allgather_base, args, async_op, unpad, (padded, gathered)
        )

    def broadcast(self, t: torch.Tensor, root: int, *, async_op: bool = True) -> Deferred:
        opts = self._options(dist.BroadcastOptions, async_op, root=root)
        return self._run("broadcast", self._pg.broadcast, ([as_bytes(t)], opts), async_op)

    def reduce(self, t: torch.Tensor, op: str, root: int, *, async_op: bool = True) -> Deferred:
        buf, name = self._reduce_args(t, op)
        opts = self._options(dist.ReduceOptions, async_op, name, root)
        return self._run("reduce", self._pg.reduce, ([buf], opts), async_op)

    def gather(
        self, out: torch.Tensor | None, inp: torch.Tensor, root: int, *, async_op: bool = True
    ) -> Deferred:
        args = gather_args(out, inp, root, self.world_size)
        _with_async(args[2], _queued_async(async_op))
        return self._run("gather", self._pg.gather, args, async_op)

    def scatter(
        self, out: torch.Tensor, inp: torch.Tensor | None, root: int, *, async_op: bool = True
    ) -> Deferred:
        args = scatter_args(out, inp, root, self.world_size)
        _with_async(args[2], _queued_async(async_op))
        return self._run("scatter", self._pg.scatter, args, async_op)

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = True
    ) -> Deferred:
        opts = self._options(dist.AllToAllOptions, async_op)
        args: tuple[Any, ...] = (as_bytes(out), as_bytes(inp), [], [], opts)
        return self._run("all_to_all", self._pg.alltoall_base, args, async_op)

    def barrier(self, *, async_op: bool = True) -> Deferred:
        # What NCCL's own barrier does, on our device (torch's guesses the device and warns).
        token = torch.zeros(1, device=self.device)
        opts = self._options(dist.AllreduceOptions, async_op, "sum")
        return self._run("barrier", self._pg.allreduce, ([token], opts), async_op, keep=(token,))

    def send(self, t: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = True) -> Deferred:
        return self._run("send", self._pg.send, ([as_bytes(t)], dst, tag), async_op)

    def recv(
        self, t: torch.Tensor, src: int | None, *, tag: int = 0, async_op: bool = True
    ) -> Deferred:
        if src is None:
            raise InvalidArgumentError(
                f"recv on rank {self.rank} (nccl): NCCL cannot receive from any source; pass "
                "src, or receive on a CPU group (backend 'native' or 'gloo')"
            )
        return self._run("recv", self._pg.recv, ([as_bytes(t)], src, tag), async_op)

    def subgroup(
        self,
        name: str,
        ranks: Sequence[int],
        *,
        overlap_compute: bool = False,
        timeout: float | None = None,
    ) -> NcclBackend:
        return NcclBackend(
            self._store,
            list(ranks).index(self.rank),
            len(ranks),
            name=name,
            timeout=self._timeout if timeout is None else timeout,
            device=self.device,
            overlap_compute=overlap_compute,
        )

    def abort(self, reason: str) -> None:
        self._pg.abort()

    def close(self) -> None:
        self._pg.shutdown()


def create(
    store: Store,
    rank: int,
    world_size: int,
    *,
    name: str,
    timeout: float,
    device: torch.device | str | int | None = None,
) -> NcclBackend:
    """An NCCL backend for one group; every rank of it calls this with the same ``name``.

    Args:
        store: The job's store.
        rank: This rank within the group.
        world_size: Number of ranks in the group.
        name: Unique group name; namespaces the store keys.
        timeout: Deadline of every blocking wait, in seconds (NCCL's watchdog timeout).
        device: This rank's GPU (``"cuda:1"``, ``1`` or a ``torch.device``); ``None`` picks
            ``default_device()``.

    Raises:
        ShardlineError: NCCL or CUDA is unavailable, or the device is not a visible GPU.
    """
    if not dist.is_nccl_available():
        raise ShardlineError(
            "backend='nccl' needs a torch build with NCCL (a CUDA build of torch on Linux); "
            "use backend='native' or 'gloo'"
        )
    if device is None:
        dev = default_device()
    else:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise ShardlineError(f"backend='nccl' needs a CUDA device, got device={device!r}")
        if str(dev) == "cuda":  # no index: the current device
            dev = torch.device("cuda", torch.cuda.current_device())
    return NcclBackend(
        store, rank, world_size, name=name, timeout=seconds(timeout) or 300.0, device=dev
    )
