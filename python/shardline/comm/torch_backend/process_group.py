"""``ShardlineProcessGroup``: a ``torch.distributed.ProcessGroup`` over a native group.

torch's Python code calls its methods directly, and torch's pybind trampoline routes C++
callers (DDP's reducer, parameter checks, buffer broadcasts) to them. Every method checks
torch's arguments (one tensor per process, CPU tensors, supported ``ReduceOp``s),
starts the op on the engine with ``async_op=True`` and returns a ``ShardlineWork``. Only CPU
tensors are handled; CUDA tensors belong to NCCL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardline.comm.group import ProcessGroup
from shardline.comm.torch_backend import cpu_backend
from shardline.comm.torch_backend.monitored import monitored_barrier
from shardline.comm.torch_backend.sparse import sparse_all_reduce
from shardline.comm.torch_backend.work import ShardlineWork, _Op
from shardline.comm.work import Work
from shardline.errors import InvalidArgumentError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import ProcessGroup as _ProcessGroupBase
    from torch._C._distributed_c10d import Store
else:  # a torch without distributed support still imports shardline (see register())
    _ProcessGroupBase = getattr(dist, "ProcessGroup", object)

__all__ = ["BACKEND_NAME", "ShardlineProcessGroup"]

BACKEND_NAME = "shardline"

# torch.distributed.ReduceOp.RedOpType member name -> engine op name.
_REDUCE_OPS = {"SUM": "sum", "AVG": "avg", "MAX": "max", "MIN": "min", "PRODUCT": "prod"}


def _one(tensors: object, what: str) -> torch.Tensor:
    """The single tensor of a ``[tensor]`` argument (torch's one-tensor-per-process lists)."""
    if isinstance(tensors, torch.Tensor):
        return _cpu(tensors, what)
    if isinstance(tensors, list | tuple) and len(tensors) == 1:
        return _cpu(tensors[0], what)
    n = len(tensors) if isinstance(tensors, list | tuple) else type(tensors).__name__
    raise InvalidArgumentError(
        f"{what}: backend {BACKEND_NAME!r} takes one tensor per process, got {n}"
    )


def _cpu(t: object, what: str) -> torch.Tensor:
    """``t`` if it is a CPU tensor; a clear error for CUDA (NCCL's) and other devices."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        hint = (
            "CUDA tensors belong to the nccl backend: run them on a group created with "
            "backend='nccl' (e.g. torch.distributed.new_group(backend='nccl')), or call .cpu()"
            if t.device.type == "cuda"
            else "call .cpu() first"
        )
        raise InvalidArgumentError(
            f"{what}: backend {BACKEND_NAME!r} runs collectives on CPU tensors, got a tensor "
            f"on {t.device}; {hint}"
        )
    return t


def _cpus(tensors: Sequence[object], what: str) -> list[torch.Tensor]:
    return [_cpu(t, f"{what}[{i}]") for i, t in enumerate(tensors)]


def _reduce_op(opts: object, what: str) -> str:
    """Our op name for ``opts.reduceOp`` (or a bare ``ReduceOp``); clear error otherwise."""
    op = getattr(opts, "reduceOp", opts if opts is not None else dist.ReduceOp.SUM)
    kind = getattr(op, "op", op)  # ReduceOp wraps a RedOpType
    name = str(getattr(kind, "name", kind)).rsplit(".", 1)[-1].upper()
    if name not in _REDUCE_OPS:
        raise InvalidArgumentError(
            f"{what}: backend {BACKEND_NAME!r} does not support ReduceOp.{name}; use one of "
            f"{', '.join('ReduceOp.' + n for n in _REDUCE_OPS)}"
        )
    return _REDUCE_OPS[name]


def _root(opts: object, what: str) -> int:
    root = getattr(opts, "rootRank", 0)
    if getattr(opts, "rootTensor", 0) != 0:
        raise InvalidArgumentError(f"{what}: rootTensor must be 0 (one tensor per process)")
    return int(root)


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise InvalidArgumentError(
            f"{what}: tensor of shape {tuple(t.shape)} is not contiguous; call .contiguous()"
        )
    return t.view(-1)


class ShardlineProcessGroup(_ProcessGroupBase):
    """A ``torch.distributed.ProcessGroup`` whose collectives run on a native shardline group.

    torch creates it through the registered backend; use ``.group`` for shardline's own
    ``ProcessGroup`` (e.g. to hand to shardline's strategies). Ranks and root ranks are
    group-local, as torch passes them.
    """

    def __init__(
        self, group: ProcessGroup, *, store: Store | None = None, timeout: float | None = None
    ) -> None:
        """Wraps ``group``; ``store`` and ``timeout`` (seconds) are the ones torch gave it.

        ``timeout`` is ``group.timeout`` when ``None``.
        """
        super().__init__(group.rank, group.world_size)
        self.group = group
        self._group_name = group.name
        self._group_desc = "undefined"
        self._store = store
        self._timeout = group.timeout if timeout is None else timeout
        self._monitored_calls = 0
        cpu_backend.attach(self)

    # -- identity (torch's trampoline calls these by their C++ names) -------------------------

    def getBackendName(self) -> str:  # the C++ name torch's trampoline looks up
        """``"shardline"``."""
        return BACKEND_NAME

    def getGroupName(self) -> str:
        """The name torch gave this group."""
        return self._group_name

    def setGroupName(self, name: str) -> None:
        """Called by torch with the group's name."""
        self._group_name = name

    def getGroupDesc(self) -> str:
        """The description torch gave this group."""
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        """Called by torch with the group's description."""
        self._group_desc = desc

    def __repr__(self) -> str:
        return f"ShardlineProcessGroup({self.group!r})"

    def _get_backend(self, device: torch.device | str) -> ShardlineProcessGroup:  # type: ignore[override]
        """This group itself for CPU; torch's error for other devices.

        torch asks for a group's per-device backend in a few places (``batch_isend_irecv``
        probes ``supports_coalescing``, which we lack, and then sends one op at a time); a
        Python ProcessGroup has none registered, and torch expects the group itself then.
        """
        kind = torch.device(device).type
        if kind != "cpu":
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    # -- plumbing ------------------------------------------------------------------------------

    def _work(
        self,
        works: Sequence[Work | int | None],
        result: list[torch.Tensor],
        after: Callable[[], None] | None = None,
    ) -> ShardlineWork:
        ops = [w for w in works if isinstance(w, Work)]  # every op here is started async
        return ShardlineWork(_Op(ops, result, after))

    # -- collectives ---------------------------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> ShardlineWork:  # type: ignore[override]
        """All-reduces ``[tensor]`` in place (``opts.reduceOp``: SUM, AVG, MAX, MIN, PRODUCT).

        A sparse COO tensor is summed (SUM only, as with Gloo) and left coalesced.
        """
        t = _one(tensors, "allreduce")
        op = _reduce_op(opts, "allreduce")
        if t.layout == torch.sparse_coo:
            sparse_all_reduce(self.group, t, op)
            return self._work([], [t])
        return self._work([self.group.all_reduce(t, op, async_op=True)], [t])

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> ShardlineWork:
        """All-reduces every tensor of ``tensors`` in place, one engine op each."""
        ts = _cpus(tensors, "allreduce_coalesced")
        op = _reduce_op(opts, "allreduce_coalesced")
        return self._work([self.group.all_reduce(t, op, async_op=True) for t in ts], ts)

    def broadcast(self, tensors: Any, opts: Any = None) -> ShardlineWork:  # type: ignore[override]
        """Broadcasts ``[tensor]`` from ``opts.rootRank``."""
        t = _one(tensors, "broadcast")
        root = _root(opts, "broadcast")
        return self._work([self.group.broadcast(t, root, async_op=True)], [t])

    def reduce(self, tensors: Any, opts: Any = None) -> ShardlineWork:  # type: ignore[override]
        """Reduces ``[tensor]`` into ``opts.rootRank``'s tensor."""
        t = _one(tensors, "reduce")
        root, op = _root(opts, "reduce"), _reduce_op(opts, "reduce")
        return self._work([self.group.reduce(t, root, op, async_op=True)], [t])

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> ShardlineWork:
        """Gathers ``[input]`` from every rank into ``[[out_0, ..., out_{n-1}]]``."""
        inp = _one(input_tensors, "allgather(input)")
        outs = _cpus(_one_list(output_tensors, "allgather(output)"), "allgather(output)")
        return self._work([self.group.all_gather(outs, inp, async_op=True)], outs)

    def allgather_coalesced(
        self, output_lists: Any, input_list: Any, opts: Any = None
    ) -> ShardlineWork:
        """Gathers every input of ``input_list`` from every rank.

        ``output_lists[r][j]`` receives rank ``r``'s ``input_list[j]``: one list per rank, one
        tensor per input in it (torch's and Gloo's layout).
        """
        ins = _cpus(input_list, "allgather_coalesced(input)")
        w = self.group.world_size
        if (
            not isinstance(output_lists, list | tuple)
            or len(output_lists) != w
            or any(not isinstance(o, list | tuple) or len(o) != len(ins) for o in output_lists)
        ):
            got = (
                [len(o) if isinstance(o, list | tuple) else type(o).__name__ for o in output_lists]
                if isinstance(output_lists, list | tuple)
                else type(output_lists).__name__
            )
            raise InvalidArgumentError(
                f"allgather_coalesced on rank {self.group.rank}: output_tensor_lists must hold "
                f"{w} lists (one per rank) of {len(ins)} tensors (one per input); got list "
                f"lengths {got}"
            )
        outs = [_cpus(o, f"allgather_coalesced(output[{r}])") for r, o in enumerate(output_lists)]
        works = [
            self.group.all_gather([outs[r][j] for r in range(w)], inp, async_op=True)
            for j, inp in enumerate(ins)
        ]
        return self._work(works, [t for o in outs for t in o])

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> ShardlineWork:
        """Gathers every rank's ``input`` into ``output`` (``world_size`` times as long)."""
        out, inp = _cpu(output, "all_gather_into_tensor"), _cpu(input, "all_gather_into_tensor")
        return self._work([self.group.all_gather(out, inp, async_op=True)], [out])

    _allgather_base = all_gather_single  # torch < 2.12 calls this name

    def all_gather_single_coalesced(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> ShardlineWork:
        """``all_gather_single`` for each pair of ``outputs`` and ``inputs``."""
        outs, ins = _cpus(outputs, "all_gather(outputs)"), _cpus(inputs, "all_gather(inputs)")
        _same_len(outs, ins, "all_gather_into_tensor_coalesced")
        works = [self.group.all_gather(o, i, async_op=True) for o, i in zip(outs, ins, strict=True)]
        return self._work(works, outs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def reduce_scatter(  # type: ignore[override]
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> ShardlineWork:
        """Reduces ``[[in_0, ..., in_{n-1}]]`` across ranks; rank ``i`` gets ``in_i``'s sum."""
        out = _one(output_tensors, "reduce_scatter(output)")
        ins = _cpus(_one_list(input_tensors, "reduce_scatter(input)"), "reduce_scatter(input)")
        op = _reduce_op(opts, "reduce_scatter")
        return self._work([self.group.reduce_scatter(out, ins, op, async_op=True)], [out])

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> ShardlineWork:
        """Reduces ``input`` across ranks; rank ``i`` gets slice ``i`` in ``output``."""
        out, inp = _cpu(output, "reduce_scatter_tensor"), _cpu(input, "reduce_scatter_tensor")
        op = _reduce_op(opts, "reduce_scatter_tensor")
        return self._work([self.group.reduce_scatter(out, inp, op, async_op=True)], [out])

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # torch < 2.12

    def reduce_scatter_single_coalesced(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> ShardlineWork:
        """``reduce_scatter_single`` for each pair of ``outputs`` and ``inputs``."""
        outs = _cpus(outputs, "reduce_scatter(outputs)")
        ins = _cpus(inputs, "reduce_scatter(inputs)")
        _same_len(outs, ins, "reduce_scatter_tensor_coalesced")
        op = _reduce_op(opts, "reduce_scatter_tensor_coalesced")
        pairs = zip(outs, ins, strict=True)
        return self._work(
            [self.group.reduce_scatter(o, i, op, async_op=True) for o, i in pairs], outs
        )

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def gather(  # type: ignore[override]
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> ShardlineWork:
        """Gathers ``[input]`` into ``[[out_0, ..., out_{n-1}]]`` on ``opts.rootRank``."""
        inp = _one(input_tensors, "gather(input)")
        root = _root(opts, "gather")
        outs: list[torch.Tensor] | None = None
        if output_tensors:
            outs = _cpus(_one_list(output_tensors, "gather(output)"), "gather(output)")
        work = self.group.gather(inp, outs if self.group.rank == root else None, root, True)
        return self._work([work], outs or [])

    def scatter(  # type: ignore[override]
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> ShardlineWork:
        """Scatters ``[[in_0, ..., in_{n-1}]]`` from ``opts.rootRank`` into ``[output]``."""
        out = _one(output_tensors, "scatter(output)")
        root = _root(opts, "scatter")
        ins: list[torch.Tensor] | None = None
        if input_tensors:
            ins = _cpus(_one_list(input_tensors, "scatter(input)"), "scatter(input)")
        work = self.group.scatter(out, ins if self.group.rank == root else None, root, True)
        return self._work([work], [out])

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> ShardlineWork:
        """Sends rows ``input_split_sizes[j]`` of ``input`` to rank ``j`` (equal if empty).

        With split sizes, every rank must pass them (torch allows mixing ``[]`` and explicit
        sizes; here both sides must agree which form they use).
        """
        out, inp = _cpu(output, "all_to_all_single"), _cpu(input, "all_to_all_single")
        if not output_split_sizes and not input_split_sizes:
            return self._work([self.group.all_to_all(out, inp, async_op=True)], [out])
        w = self.group.world_size
        in_parts = _row_parts(inp, list(input_split_sizes), w, "all_to_all_single(input)")
        out_parts = _row_parts(out, list(output_split_sizes), w, "all_to_all_single(output)")
        return self._all_to_all_v(out_parts, in_parts, [out], "all_to_all_single")

    alltoall_base = all_to_all_single  # type: ignore[assignment]  # torch < 2.12

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> ShardlineWork:
        """Sends ``input_tensors[j]`` to rank ``j``, which receives it in ``output_tensors[i]``."""
        outs, ins = _cpus(output_tensors, "alltoall(output)"), _cpus(input_tensors, "alltoall")
        w = self.group.world_size
        if len(outs) != w or len(ins) != w:
            raise InvalidArgumentError(
                f"alltoall: expected {w} input and {w} output tensors (one per rank), got "
                f"{len(ins)} and {len(outs)}"
            )
        in_parts = [_flat(t, "alltoall(input)") for t in ins]
        out_parts = [_flat(t, "alltoall(output)") for t in outs]
        return self._all_to_all_v(out_parts, in_parts, outs, "alltoall")

    def barrier(self, opts: Any = None) -> ShardlineWork:
        """Completes once every rank of the group has entered the barrier."""
        return self._work([self.group.barrier(async_op=True)], [])

    def monitored_barrier(
        self, timeout: timedelta | float | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier whose rank 0 names the ranks that did not reach it within ``timeout``.

        See ``torch.distributed.monitored_barrier``; the reports go through the group's store
        (``monitored.py``), so a missing rank leaves nothing pending in the group.

        Raises:
            MonitoredBarrierError: A rank did not arrive in time.
        """
        if self._store is None:
            raise InvalidArgumentError(
                "monitored_barrier needs the store torch creates a group with; create the "
                "group with torch.distributed.init_process_group or new_group"
            )
        group_timeout = self._timeout
        if timeout is None:
            limit = group_timeout
        else:
            limit = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        call, self._monitored_calls = self._monitored_calls, self._monitored_calls + 1
        store = dist.PrefixStore(f"{BACKEND_NAME}-monitored/", self._store)  # type: ignore[attr-defined]
        monitored_barrier(
            store, self.group.rank, self.group.world_size, call, limit, group_timeout,
            wait_all_ranks,
        )  # fmt: skip

    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> ShardlineWork:
        """Sends ``[tensor]`` to group rank ``dstRank``, labelled ``tag``."""
        t = _one(tensors, "send")
        return self._work([self.group.send(t, int(dstRank), async_op=True, tag=tag)], [t])

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> ShardlineWork:
        """Receives into ``[tensor]`` the next message tagged ``tag`` from ``srcRank``."""
        t = _one(tensors, "recv")
        work = self.group.recv(t, int(srcRank), async_op=True, tag=tag)
        return self._work([work], [t])

    def recv_anysource(self, tensors: Any, tag: int = 0) -> ShardlineWork:
        """Receives into ``[tensor]`` the first message tagged ``tag`` from any rank.

        The Work's ``_source_rank()`` says which rank sent it.
        """
        t = _one(tensors, "recv")
        work = self.group.recv(t, None, async_op=True, tag=tag)
        return self._work([work], [t])

    # -- lifetime ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Waits for queued ops, then releases the engine (``destroy_process_group`` calls it)."""
        self.group.shutdown()

    def abort(self) -> None:
        """Fails every pending op here and on the peers."""
        self.group.abort("aborted through torch.distributed")

    # -- variable-size all-to-all ---------------------------------------------------------------

    def _all_to_all_v(
        self,
        out_parts: list[torch.Tensor],
        in_parts: list[torch.Tensor],
        result: list[torch.Tensor],
        what: str,
    ) -> ShardlineWork:
        """All-to-all of unequal 1-D parts: one padded engine all-to-all.

        Every rank first learns every rank's send and receive counts (a small all_gather), so
        all ranks check the counts agree and pick the same padding, then each part travels in a
        slot of the largest part's size.
        """
        g, w, r = self.group, self.group.world_size, self.group.rank
        dtype = in_parts[0].dtype if in_parts else out_parts[0].dtype
        mine = torch.tensor([p.numel() for p in in_parts] + [p.numel() for p in out_parts])
        counts = torch.empty(w, 2 * w, dtype=torch.int64)
        g.all_gather(counts, mine)
        sends, recvs = counts[:, :w], counts[:, w:]
        if not torch.equal(sends, recvs.t()):
            bad = (sends != recvs.t()).nonzero()[0].tolist()
            raise InvalidArgumentError(
                f"{what} on rank {r}: rank {bad[0]} sends {int(sends[bad[0], bad[1]])} elements "
                f"to rank {bad[1]}, which expects {int(recvs[bad[1], bad[0]])}; check the split "
                "sizes on both ranks"
            )
        slot = int(counts.max())
        if slot == 0:
            return self._work([], result)
        send = torch.zeros(w * slot, dtype=dtype)
        for j, p in enumerate(in_parts):
            send[j * slot : j * slot + p.numel()].copy_(p)
        recv = torch.empty(w * slot, dtype=dtype)

        def unpack() -> None:
            for i, p in enumerate(out_parts):
                p.copy_(recv[i * slot : i * slot + p.numel()])

        return self._work([g.all_to_all(recv, send, async_op=True)], result, unpack)


def _one_list(tensors: object, what: str) -> Sequence[object]:
    """The single list of a ``[[t_0, ..., t_{n-1}]]`` argument."""
    if (
        isinstance(tensors, list | tuple)
        and len(tensors) == 1
        and isinstance(tensors[0], list | tuple)
    ):
        return tensors[0]
    raise InvalidArgumentError(
        f"{what}: backend {BACKEND_NAME!r} takes one list of tensors per process"
    )


def _same_len(outs: Sequence[object], ins: Sequence[object], what: str) -> None:
    if len(outs) != len(ins):
        raise InvalidArgumentError(
            f"{what}: {len(outs)} outputs but {len(ins)} inputs; pass one output per input"
        )


def _row_parts(t: torch.Tensor, splits: list[int], w: int, what: str) -> list[torch.Tensor]:
    """Flat views of ``t``'s row blocks along dim 0 (``splits`` rows each; equal if empty)."""
    flat = _flat(t, what)
    rows = t.shape[0] if t.dim() else 1
    if not splits:
        if rows % w:
            raise InvalidArgumentError(
                f"{what}: {rows} rows do not split evenly among {w} ranks; pass split sizes"
            )
        splits = [rows // w] * w
    if len(splits) != w or any(s < 0 for s in splits) or sum(splits) != rows:
        raise InvalidArgumentError(
            f"{what}: split sizes {splits} must be {w} non-negative numbers summing to the "
            f"{rows} rows of dim 0"
        )
    per_row = t.numel() // rows if rows else 0
    parts, start = [], 0
    for s in splits:
        parts.append(flat[start : start + s * per_row])
        start += s * per_row
    return parts
