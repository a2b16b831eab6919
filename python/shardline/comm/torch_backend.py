"""The ``torch.distributed`` backend ``"shardline"``: PyTorch's collectives and DDP on our engine.

After ``import shardline``::

    torch.distributed.init_process_group("shardline")          # env://, or store=, rank=, ...
    model = torch.nn.parallel.DistributedDataParallel(model)    # all-reduces run on the engine

``register()`` hands torch a creator (``torch.distributed.Backend.register_backend``) that torch
calls once per group, for the default group and for every ``new_group(..., backend=
"shardline")``, with a store prefixed by the group's name and the group-local rank and size.
The creator builds a native ``shardline.comm.ProcessGroup`` through that store (under one more
``shardline/`` prefix; host identity from ``host_identity()``, job secret by ``job_secret``'s
rules) and wraps it in ``ShardlineProcessGroup``, a Python subclass of
``torch.distributed.ProcessGroup``: torch's Python code calls its methods directly, and torch's
pybind trampoline routes C++ callers (DDP's reducer, parameter checks, buffer broadcasts) to
them. Only CPU tensors are handled; CUDA tensors belong to NCCL.

[Note: completion] Every op is started on the engine with ``async_op=True`` and returned as a
``ShardlineWork`` (a ``torch.distributed.Work``). ``wait()`` waits for the native op in the
calling thread (blocking collectives cost no thread hand-off). ``get_future()`` returns a
``torch.futures.Future`` holding the op's output tensors that completes when the op finishes
whether or not anybody calls ``wait()``: DDP's reducer calls ``allreduce`` then
``get_future()`` and only ever waits on the future (from the autograd thread, without the GIL).
The first ``get_future()`` hands the op to ``_Completer``, a pool of daemon threads in which a
thread waits for the native op (GIL released), writes list outputs, then completes the future;
completing runs the future's ``then`` callbacks in that thread. The pool keeps the invariant
that every handed-over op has a thread of its own that runs no callback meanwhile (a thread
that is idle and not yet promised to another op, else a new one), so a callback that blocks,
even on another op's future, cannot keep a later op's future from completing. Every wait is
bounded by the engine's deadline, so every future completes, with a result or the op's error.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardline.comm.group import ProcessGroup
from shardline.comm.rendezvous import host_identity, timeout_seconds
from shardline.errors import CollectiveTimeoutError, InvalidArgumentError, ShardlineError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import ProcessGroup as _ProcessGroupBase
    from torch._C._distributed_c10d import Store
    from torch._C._distributed_c10d import Work as _WorkBase

    from shardline.comm.work import Work
else:  # a torch without distributed support still imports shardline (see register())
    _ProcessGroupBase = getattr(dist, "ProcessGroup", object)
    _WorkBase = getattr(dist, "_Work", object)

__all__ = ["BACKEND_NAME", "ShardlineProcessGroup", "ShardlineWork", "is_registered", "register"]

BACKEND_NAME = "shardline"
# torch's default timeout for CPU groups; passing it means "none given", so the engine's own
# default applies (SHARDLINE_TIMEOUT, else 300 s) instead of torch's 30 minutes.
_TORCH_DEFAULT_TIMEOUT = getattr(
    getattr(dist, "constants", None), "default_pg_timeout", timedelta(minutes=30)
)
_IDLE_S = 30.0  # a completer thread with nothing to do for this long exits

_registered = False
_register_lock = threading.Lock()

# torch.distributed.ReduceOp.RedOpType member name -> engine op name.
_REDUCE_OPS = {"SUM": "sum", "AVG": "avg", "MAX": "max", "MIN": "min", "PRODUCT": "prod"}


def _missing_api() -> list[str]:
    """The torch APIs this backend needs that this torch build lacks."""
    if not dist.is_available():
        return ["torch.distributed (this torch build has no distributed support)"]
    needed = {
        "torch.distributed.Backend.register_backend": getattr(
            getattr(dist, "Backend", None), "register_backend", None
        ),
        "torch.distributed.ProcessGroup": getattr(dist, "ProcessGroup", None),
        "torch.distributed._Work": getattr(dist, "_Work", None),
        "torch.distributed.PrefixStore": getattr(dist, "PrefixStore", None),
        "torch.futures.Future": getattr(getattr(torch, "futures", None), "Future", None),
    }
    return [name for name, value in needed.items() if value is None]


def is_registered() -> bool:
    """Whether ``register()`` has registered the ``"shardline"`` backend with torch."""
    return _registered


def register(*, strict: bool = False) -> bool:
    """Registers ``"shardline"`` as a ``torch.distributed`` backend for CPU tensors.

    Idempotent; ``import shardline`` calls it. Afterwards ``init_process_group("shardline")``
    and ``new_group(ranks, backend="shardline")`` create groups on the native engine. The
    backend does not claim the ``cpu`` device for torch's default backend choice (gloo keeps it).

    Args:
        strict: Raise instead of returning ``False`` when this torch lacks the needed APIs.

    Returns:
        ``True`` once registered; ``False`` when this torch cannot host the backend (with
        ``strict=False``; if torch can register backends at all, creating a group then raises
        a ``ShardlineError`` that names the missing APIs).

    Raises:
        ShardlineError: ``strict`` is set and torch lacks an API the backend needs.
    """
    global _registered  # noqa: PLW0603  # one registration per process
    with _register_lock:
        if _registered:
            return True
        missing = _missing_api()
        if missing:
            message = (
                f"torch {torch.__version__} lacks {', '.join(missing)}, which the "
                f"{BACKEND_NAME!r} torch.distributed backend needs; use torch 2.11 or newer"
            )
            if strict:
                raise ShardlineError(message)
            register_backend = getattr(getattr(dist, "Backend", None), "register_backend", None)
            if register_backend is not None and BACKEND_NAME.upper() not in _plugins():
                # Fail at group creation with the reason, not at `import shardline`.
                register_backend(BACKEND_NAME, _unavailable(message), devices=["cpu"])
            return False
        if BACKEND_NAME.upper() not in _plugins():
            dist.Backend.register_backend(
                BACKEND_NAME, _create_group, extended_api=True, devices=["cpu"]
            )
        _registered = True
        return True


def _plugins() -> dict[str, Any]:
    plugins = getattr(getattr(dist, "Backend", None), "_plugins", None)
    return plugins if isinstance(plugins, dict) else {}


def _unavailable(message: str) -> Callable[..., Any]:
    def fail(*_args: object) -> Any:
        raise ShardlineError(message)

    return fail


# -- group creation ---------------------------------------------------------------------------


def _engine_timeout(timeout: timedelta | None) -> float:
    """The engine's deadline: torch's ``timeout`` if the user chose one, else ours."""
    if timeout is None or timeout == _TORCH_DEFAULT_TIMEOUT:
        return timeout_seconds(None)
    return timeout_seconds(timeout)


def _master_addr(store: Store) -> str | None:
    """The rendezvous host: the innermost store's ``host``, else ``MASTER_ADDR``."""
    inner: object = store
    while isinstance(inner, dist.PrefixStore):  # type: ignore[attr-defined]
        inner = inner.underlying_store
    host = getattr(inner, "host", None)
    return str(host) if host else os.environ.get("MASTER_ADDR") or None


def _create_group(opts: Any, backend_options: object | None = None) -> ShardlineProcessGroup:
    """Creates one group; torch calls it with ``extended_api`` arguments.

    Args:
        opts: torch's ``_DistributedBackendOptions``: the group's prefixed store, group-local
            rank and size, timeout and id.
        backend_options: ``init_process_group(pg_options=...)``; unused.
    """
    del backend_options  # no options of our own yet
    from shardline.comm import init_process_group  # noqa: PLC0415  # lazy: no import cycle

    store: Store = opts.store
    group_id = str(getattr(opts, "group_id", "") or "0")
    group = init_process_group(
        dist.PrefixStore(f"{BACKEND_NAME}/", store),  # type: ignore[attr-defined]
        int(opts.group_rank),
        int(opts.group_size),
        backend="native",
        host_id=host_identity(),
        name=f"torch.{group_id}",
        timeout=_engine_timeout(getattr(opts, "timeout", None)),
        master_addr=_master_addr(store),
    )
    return ShardlineProcessGroup(group)


# -- completion --------------------------------------------------------------------------------


class _Op:
    """The state of one torch op: its native Works, outputs, and the future handed out.

    [Note: locks] ``_wait_lock`` serialises waiting and writing list outputs (held while the
    engine works, never while user callbacks run); ``_state_lock`` guards the flags and the
    future and is only ever held briefly, so ``get_future()`` never waits for the op.
    """

    def __init__(
        self,
        works: Sequence[Work],
        result: list[torch.Tensor],
        after: Callable[[], None] | None = None,
    ) -> None:
        self._works = list(works)
        self.result = result
        self._after = after
        self._wait_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None
        self._notified = False

    @property
    def done(self) -> bool:
        """Whether the op finished and its outputs are written (or it failed)."""
        return self._done

    @property
    def error(self) -> BaseException | None:
        """The op's error once it failed."""
        return self._error

    def finish(self, timeout: float | None) -> None:
        """Waits for the op, writes list outputs once, completes the future; raises its error.

        Raises:
            CollectiveTimeoutError: ``timeout`` passed first; the op keeps running.
            ShardlineError: the op failed.
        """
        if not self._done:
            deadline = None if timeout is None else time.monotonic() + timeout
            if not self._wait_lock.acquire(timeout=-1 if timeout is None else timeout):
                raise CollectiveTimeoutError(
                    f"Work.wait: the op did not complete within {timeout:.3f} s"
                )
            try:
                if not self._done:
                    self._wait(deadline)
            finally:
                self._wait_lock.release()
            self.notify()
        if self._error is not None:
            raise self._error

    def _wait(self, deadline: float | None) -> None:
        error: BaseException | None = None
        try:
            for w in self._works:
                w.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if self._after is not None:
                self._after()
        except CollectiveTimeoutError as exc:
            if deadline is not None and not all(w.is_completed() for w in self._works):
                raise  # the caller's timeout, not the op's deadline: the op keeps running
            error = exc
        except Exception as exc:  # any failure is the op's result
            error = exc
        with self._state_lock:
            self._error = error
            self._done = True
            self._works = []  # drop the tensors the engine held
            self._after = None

    def notify(self) -> None:
        """Completes the future, once, if one was handed out and the op is done."""
        with self._state_lock:
            if not self._done or self._future is None or self._notified:
                return
            self._notified = True
            future, error = self._future, self._error
        # Runs the future's callbacks in this thread (see [Note: completion]).
        if error is not None:
            future.set_exception(error)  # type: ignore[arg-type]  # torch's stub is too narrow
        else:
            future.set_result(self.result)

    def future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """The op's future (one per op), completed when the op finishes."""
        with self._state_lock:
            if self._future is not None:
                return self._future
            future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
            self._future = future
            done = self._done
        if done:
            self.notify()
        else:
            _COMPLETER.submit(self)
        return future

    def is_completed(self) -> bool:
        """Whether the op is done; finishes it (list outputs) if the engine is."""
        if self._done:
            return True
        if all(w.is_completed() for w in self._works):
            with contextlib.suppress(Exception):
                self.finish(None)
            return True
        return False


class _Completer:
    """An elastic pool of daemon threads that finish ops whose future was handed out.

    Invariant: every queued op has a thread promised to it that is not running callbacks: an
    idle unpromised thread if there is one (``_free``), else a new thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._free = 0
        self._spawned = 0

    def submit(self, op: _Op) -> None:
        """Queues ``op``; a thread finishes it and completes its future."""
        with self._lock:
            self._queue.put(op)
            if self._free > 0:
                self._free -= 1
                return
            self._spawned += 1
            name = f"shardline-torch-completer-{self._spawned}"
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        promised = True  # a new thread is promised to the op that spawned it
        while True:
            if not promised:
                with self._lock:
                    self._free += 1
            try:
                op = self._queue.get(timeout=_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._free > 0:  # nobody counts on this thread: leave
                        self._free -= 1
                        return
                # Every idle thread, this one included, is promised to an op already queued.
                promised = True
                continue
            promised = False
            with contextlib.suppress(Exception):  # the op's error goes to its future
                op.finish(None)


_COMPLETER = _Completer()


class ShardlineWork(_WorkBase):
    """A ``torch.distributed.Work`` over one or more native ops (see [Note: completion])."""

    def __init__(self, op: _Op) -> None:
        super().__init__()
        self._op = op

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Blocks until the op is done and its outputs are written; returns ``True``.

        Args:
            timeout: Give up after this long; ``None`` or zero (torch's "no timeout") waits up
                to the group's deadline.

        Raises:
            CollectiveTimeoutError: ``timeout`` passed first (the op keeps running).
            ShardlineError: the op failed (``PeerLostError``, ``CollectiveMismatchError``, ...).
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self._op.finish(seconds if seconds is not None and seconds > 0 else None)
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A future of the op's output tensors, completed when the op finishes."""
        return self._op.future()

    def is_completed(self) -> bool:
        """Whether the op finished (successfully or not)."""
        return self._op.is_completed()

    def is_success(self) -> bool:
        """Whether the op finished without error."""
        return self._op.is_completed() and self._op.error is None

    def exception(self) -> BaseException | None:
        """The op's error, if it failed."""
        return self._op.error

    def result(self) -> list[torch.Tensor]:
        """The op's output tensors."""
        return self._op.result


# -- the process group -------------------------------------------------------------------------


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

    def __init__(self, group: ProcessGroup) -> None:
        super().__init__(group.rank, group.world_size)
        self.group = group
        self._group_name = group.name
        self._group_desc = "undefined"

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
        works: Sequence[Work | None],
        result: list[torch.Tensor],
        after: Callable[[], None] | None = None,
    ) -> ShardlineWork:
        return ShardlineWork(_Op([w for w in works if w is not None], result, after))

    # -- collectives ---------------------------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> ShardlineWork:  # type: ignore[override]
        """All-reduces ``[tensor]`` in place (``opts.reduceOp``: SUM, AVG, MAX, MIN, PRODUCT)."""
        t = _one(tensors, "allreduce")
        op = _reduce_op(opts, "allreduce")
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
        """``allgather`` for each input of ``input_list`` into the matching output list."""
        ins = _cpus(input_list, "allgather_coalesced(input)")
        _same_len(output_lists, ins, "allgather_coalesced")
        works, outs = [], []
        for i, (out_list, inp) in enumerate(zip(output_lists, ins, strict=True)):
            o = _cpus(out_list, f"allgather_coalesced(output[{i}])")
            works.append(self.group.all_gather(o, inp, async_op=True))
            outs += o
        return self._work(works, outs)

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

    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> ShardlineWork:
        """Sends ``[tensor]`` to group rank ``dstRank`` (``tag`` must be 0)."""
        t = _one(tensors, "send")
        _check_tag(tag, "send")
        return self._work([self.group.send(t, int(dstRank), async_op=True)], [t])

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> ShardlineWork:
        """Receives into ``[tensor]`` what group rank ``srcRank`` sends (``tag`` must be 0)."""
        t = _one(tensors, "recv")
        _check_tag(tag, "recv")
        return self._work([self.group.recv(t, int(srcRank), async_op=True)], [t])

    def recv_anysource(self, tensors: Any, tag: int = 0) -> ShardlineWork:
        """Not supported: messages are matched by source; pass ``src``."""
        raise InvalidArgumentError(
            f"recv: backend {BACKEND_NAME!r} needs the source rank (src=...); receiving from "
            "any source is not supported"
        )

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


def _check_tag(tag: int, what: str) -> None:
    if tag != 0:
        raise InvalidArgumentError(
            f"{what}: backend {BACKEND_NAME!r} matches messages between two ranks in order and "
            f"does not support tags (got tag={tag}); use tag=0"
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


# Importing this module registers the backend; `import shardline` imports it.
register()
