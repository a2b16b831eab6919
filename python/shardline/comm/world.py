"""The job and its default group: ``init``, ``shutdown``, ``is_initialized``, ``default_group``.

``init`` reads the launcher's variables, opens the rendezvous store, agrees on a backend with
rank 0 and creates the default group; a rank that fails on the way tells the others through
the store, so that they stop too instead of waiting out their deadline. ``shutdown`` leaves.
Where rank 0 hosts the store (no launcher hosts it: see [Note: who hosts the store] in
``rendezvous``), leaving is collective: every rank checks out through the store and rank 0
leaves last, so the store outlives every rank that still uses it (sub-groups are created
through it long after ``init``). Under an elastic launcher ``init`` joins the job's current
generation instead, and ``reform`` moves the default group to the next one (the mechanics are
in ``generations``; who is in which generation, in ``membership``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shardline import config
from shardline.comm import failures, init_process_group
from shardline.comm.flight import RECORDER
from shardline.comm.group import ProcessGroup
from shardline.comm.rendezvous import generations, membership
from shardline.comm.rendezvous.env import (
    create_store,
    host_identity,
    launcher_hosts_store,
    read_env,
    timeout_seconds,
)
from shardline.comm.rendezvous.generations import ElasticJob
from shardline.comm.rendezvous.membership import Generation
from shardline.comm.rendezvous.store import (
    StoreClient,
    linger_after_failure,
    publish_failure,
)
from shardline.comm.trace.recorder import TRACER
from shardline.errors import (
    CollectiveTimeoutError,
    InvalidArgumentError,
    PeerLostError,
    ShardlineError,
)
from shardline.heap import keep_freed_memory

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = [
    "choose_backend",
    "default_group",
    "elastic_generation",
    "elastic_slot",
    "elastic_store",
    "host_group",
    "init",
    "is_initialized",
    "reform",
    "shutdown",
]

_log = logging.getLogger("shardline")
_JOINING = "joining the job (shardline.init)"
_LEAVING = "leaving the job (shardline.shutdown)"
_CHECK_OUT = "shardline/shutdown"


@dataclass
class _Job:
    """What ``shutdown`` needs of the job ``init`` joined.

    Attributes:
        store: The rendezvous store (hosted here on rank 0 when ``leave_together``).
        rank: This rank.
        world_size: Ranks in the job.
        leave_together: Rank 0 hosts the store: ``shutdown`` is collective.
        timeout: How long rank 0 waits for the others to check out, in seconds.
        checked_out: Whether this rank has checked out (it does so once).
    """

    store: Store
    rank: int
    world_size: int
    leave_together: bool
    timeout: float
    checked_out: bool = False

    def check_out(self, lost: PeerLostError | None = None) -> None:
        """Says this rank is done with the store; on rank 0, waits for the others to say so.

        A rank other than 0 that cannot reach the store (rank 0 is gone already) has nothing
        to protect: it logs and returns. Rank 0 waits ``timeout`` seconds at most, then logs
        which ranks did not check out and returns; it does not wait at all when ``lost``
        says a rank died already (a dead rank never checks out, and the job is failing).
        """
        if not self.leave_together or self.checked_out:
            return
        self.checked_out = True
        client = StoreClient(self.store, rank=self.rank, task=_LEAVING)
        if self.rank != 0:
            try:
                client.set(f"{_CHECK_OUT}/{self.rank}", "1", "checking out")
            except ShardlineError as exc:
                _log.warning("%s", exc)
            return
        if lost is not None:
            _log.warning(
                "rank 0: shutdown: not waiting for the other ranks to check out, since this job "
                "lost a rank (%s); the rendezvous store hosted here goes now",
                lost,
            )
            return
        others = [f"{_CHECK_OUT}/{r}" for r in range(1, self.world_size)]
        step = "waiting for the other ranks to check out, as the store's host"
        try:
            client.wait(others, self.timeout, step)
        except CollectiveTimeoutError:
            missing = [
                r for r in range(1, self.world_size) if not client.check([others[r - 1]], step)
            ]
            _log.warning(
                "rank 0: shutdown: rank(s) %s did not check out within %.1f s; leaving without "
                "them, and the rendezvous store hosted here goes too (a rank that still uses it "
                "fails); call shardline.shutdown() on every rank (SHARDLINE_TIMEOUT sets the wait)",
                missing,
                self.timeout,
            )


_lock = threading.Lock()
_default: ProcessGroup | None = None
_job: _Job | None = None
_settings: dict[str, bool | str | None] = {"deterministic": None}  # init()'s choices for this job
_elastic: ElasticJob | None = None
_atexit_registered = False


def choose_backend(
    backend: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    local_world_size: int = 1,
    cuda_devices: int | None = None,
) -> str:
    """The backend ``init`` uses; the same on every rank of a uniform job.

    The rule, first match wins:

    1. ``backend``, if given;
    2. ``SHARDLINE_BACKEND``, if set;
    3. ``SHARDLINE_DEVICE``: ``cpu`` gives ``"native"``, ``cuda`` or ``cuda:N`` gives ``"nccl"``;
    4. ``"nccl"`` if this host has at least one visible GPU per local rank
       (``torch.cuda.device_count() >= LOCAL_WORLD_SIZE``), else ``"native"``.

    Rule 4 never gives two ranks of one GPU (NCCL refuses that); a GPU host that trains on
    CPU sets ``SHARDLINE_DEVICE=cpu``. ``"gloo"`` and ``"mpi"`` are only used when named.

    Args:
        backend: The caller's choice, if any.
        env: Variables to read; ``os.environ`` by default.
        local_world_size: Number of ranks on this host.
        cuda_devices: Visible GPUs; ``torch.cuda.device_count()`` (0 without CUDA) if ``None``.

    Raises:
        ShardlineError: an unknown backend or ``SHARDLINE_DEVICE``.
    """
    if backend:
        if backend not in config.BACKENDS:
            raise ShardlineError(
                f"backend={backend!r} is not a backend; use one of {', '.join(config.BACKENDS)}"
            )
        return backend
    named: str | None = config.get("SHARDLINE_BACKEND", env)
    if named is not None:
        return named
    device: str | None = config.get("SHARDLINE_DEVICE", env)
    if device == "cpu":
        return "native"
    if device is not None:
        return "nccl"
    if cuda_devices is None:
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if cuda_devices >= max(local_world_size, 1) else "native"


def init(
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    *,
    trace: str | os.PathLike[str] | None = None,
    deterministic: bool | str | None = None,
) -> ProcessGroup:
    """Joins the job described by the environment and creates the default group.

    Reads torchrun's env:// variables or SLURM's (see ``shardline.comm.rendezvous.env``), opens
    the TCPStore (a client of the launcher's under ``shardline run`` or torchrun, else hosted
    by rank 0), and connects every rank. With ``backend="mpi"`` the ranks are MPI's and no
    store is opened: plain ``mpirun -n 4 python train.py`` works, and where
    ``RANK``/``WORLD_SIZE`` are set they must match MPI's. On every backend but NCCL the
    process's heap then keeps freed memory for the next step instead of faulting it in again
    (``shardline.heap``; ``SHARDLINE_KEEP_FREED_MEMORY=0`` leaves malloc as it was).

    Args:
        backend: ``"native"`` (CPU tensors), ``"nccl"`` (CUDA tensors, one GPU per rank,
            ``cuda:LOCAL_RANK``), ``"gloo"`` or ``"mpi"``. ``None`` takes ``SHARDLINE_BACKEND``,
            else chooses by device: see ``choose_backend`` (nccl where every local rank has a
            GPU and ``SHARDLINE_DEVICE`` is not ``cpu``, else native). Every rank must end up
            with the same backend; ranks that disagree with rank 0 fail here.
        timeout: Deadline of every blocking wait; ``SHARDLINE_TIMEOUT`` or 300 s by default.
            It is the default group's ``timeout``: its sub-groups (``new_group``,
            ``DeviceMesh``) inherit it, and work on the group waits by it (a checkpoint's
            commit, async SGD's rounds).
        trace: A folder where this rank writes its timeline, settings and heartbeat
            (``shardline.trace``; read by ``shardline doctor`` and ``shardline trace merge``).
            ``None`` takes ``SHARDLINE_TRACE``; unset, nothing is traced.
        deterministic: The default of ``sl.distribute(deterministic=)`` for this job:
            ``True``, one process and every power-of-two world size train to the same
            parameters, bit for bit; ``"microbatch"``, the same on the model's own kernels
            for micro-batches of one size; ``"repeat"``, the same bits run after run for one
            layout. ``None`` takes ``SHARDLINE_DETERMINISTIC``.

    Returns:
        The default group.

    Raises:
        ShardlineError: already initialised, inconsistent environment or backend choice, or
            setup failure. A rank that fails once the store is open publishes its error
            there; the ranks still joining then raise ``PeerLostError`` (or
            ``AuthenticationError``, when the failure was a refused secret) within a second,
            naming that rank and its error.
    """
    global _default, _job  # noqa: PLW0603
    with _lock:
        if _default is not None:
            raise ShardlineError(
                f"shardline is already initialised on rank {_default.rank}; call "
                "shardline.shutdown() first"
            )
        _settings["deterministic"] = (
            None if deterministic is None else deterministic_mode(deterministic, "init()")
        )
        named = backend.strip().lower() if backend else config.get("SHARDLINE_BACKEND")
        if named == "mpi":  # MPI has its own rendezvous
            _default = _init_mpi(timeout)
            _joined(_default, trace)
            return _default
        if config.raw("SHARDLINE_ELASTIC_SLOT") or config.raw("SHARDLINE_ELASTIC_STANDBY"):
            _default = _init_elastic(backend, timeout, explicit=bool(named))
            _joined(_default, trace)
            return _default
        info = read_env()
        chosen = choose_backend(backend, local_world_size=info.local_world_size)
        store = create_store(info, timeout)
        job = _Job(
            store,
            info.rank,
            info.world_size,
            leave_together=info.world_size > 1 and not launcher_hosts_store(info),
            timeout=timeout_seconds(timeout),
        )
        _check_out_at_exit()
        try:
            generations.agree_on_world_size(
                store, info.rank, info.world_size, info.local_world_size
            )
            generations.agree_on_backend(store, info.rank, chosen, explicit=bool(named))
            device = None
            if chosen == "nccl":
                from shardline.comm.backends import nccl  # noqa: PLC0415

                device = nccl.default_device(info.local_rank)
            group = init_process_group(
                store,
                info.rank,
                info.world_size,
                backend=chosen,
                host_id=host_identity(),
                timeout=timeout,
                master_addr=info.master_addr,
                device=device,
            )
        except Exception as exc:
            # See [Note: a rank that fails while joining] in comm.rendezvous.store.
            publish_failure(store, info.rank, exc)
            if job.leave_together and info.rank == 0:
                linger_after_failure(store, info.world_size)
            raise
        _default, _job = group, job
        failures.use_job_store(job.store)
        _joined(group, trace)
        return group


def _init_elastic(
    backend: str | None, timeout: timedelta | float | None, *, explicit: bool
) -> ProcessGroup:
    """``init`` under an elastic launcher: wait for a generation that lists this process."""
    global _job, _elastic  # noqa: PLW0603
    import torch.distributed as dist  # noqa: PLC0415

    generations.die_with_launcher()
    seconds = timeout_seconds(timeout)
    addr = config.env_var("MASTER_ADDR", default="127.0.0.1")
    port = int(config.env_required("MASTER_PORT"))
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            addr, port, None, False, timedelta(seconds=seconds)
        )
    except (RuntimeError, OSError) as exc:
        raise PeerLostError(
            f"a worker cannot reach the elastic job's store at {addr}:{port} ({exc}); its "
            "launcher (the node that hosts it) is gone"
        ) from exc
    standby = config.raw("SHARDLINE_ELASTIC_STANDBY")
    if standby:  # a warm spare: the script is loaded; wait until a slot needs it
        slot, number = generations.or_exit(lambda: membership.wait_standby(store, standby))
        incarnation = int(number)
        # The slot's variables, as a process started for it gets them (for the user's code).
        os.environ.update({"LOCAL_RANK": slot.split(".")[1], "SHARDLINE_ELASTIC_SLOT": slot,
                           "SHARDLINE_ELASTIC_INCARNATION": number,
                           "SHARDLINE_RESTART_COUNT": number,
                           "TORCHELASTIC_RESTART_COUNT": number})  # fmt: skip
    else:
        slot = str(config.raw("SHARDLINE_ELASTIC_SLOT"))
        incarnation = int(config.get("SHARDLINE_ELASTIC_INCARNATION"))
    local_rank = int(config.env_var("LOCAL_RANK", default="0"))
    gen = generations.or_exit(lambda: membership.join(store, slot, incarnation, seconds))
    local_world = int(config.env_var("LOCAL_WORLD_SIZE", default="1"))
    chosen = choose_backend(backend, local_world_size=local_world)
    state = ElasticJob(store, slot, incarnation, gen, chosen, seconds, local_rank)
    group = generations.form_newest(state, explicit=explicit)
    _elastic = state
    _job = _Job(store, group.rank, group.world_size, leave_together=False, timeout=seconds)
    failures.use_job_store(store)
    return group


def host_group(group: ProcessGroup) -> ProcessGroup:
    """The group to move host tensors among ``group``'s ranks on.

    ``group`` itself, but for an elastic NCCL job's default group: its native twin.
    """
    e = _elastic
    if e is not None and e.host is not None and group is _default:
        return e.host
    return group


def elastic_generation() -> Generation | None:
    """The generation the default group belongs to in an elastic job; else ``None``."""
    return _elastic.generation if _elastic is not None else None


def elastic_slot() -> tuple[str, int] | None:
    """In an elastic job, where this process runs: ``(slot, incarnation)``; else ``None``.

    The incarnation is 0 for a slot's first process, +1 for each replacement (a warm standby
    learns its slot and incarnation only in ``init``, not from its environment).
    """
    e = _elastic
    return (e.slot, e.incarnation) if e is not None else None


def elastic_store() -> Store | None:
    """In an elastic job, the store its launchers host (membership, generations); else ``None``."""
    e = _elastic
    return e.store if e is not None else None


def membership_changed() -> bool:
    """Whether a generation after the default group's was published (a store round trip)."""
    e = _elastic
    return e is not None and membership.pending(e.store, e.generation.number)


def reform() -> ProcessGroup:
    """After a lost rank or a membership change: the default group of the next generation.

    Waits for the launcher's coordinator to publish a generation after the current one that
    lists this process, shuts the old group down (its sub-groups too) and joins the new one.
    Only in an elastic job (``shardline run --nnodes MIN:MAX``); ``shardline.elastic.run``
    calls it.

    Raises:
        ShardlineError: not an elastic job, or the job stopped (too few nodes).
        CollectiveTimeoutError: no such generation within ``SHARDLINE_TIMEOUT``.
    """
    global _default, _job  # noqa: PLW0603
    e = _elastic
    if e is None or _default is None:
        raise ShardlineError(
            "shardline.reform: not an elastic job; launch with `shardline run --nnodes MIN:MAX`"
        )
    old = _default
    e.generation = generations.or_exit(lambda: membership.next_after(
        e.store, e.generation.number, e.slot, e.incarnation, e.timeout))  # fmt: skip
    lost = PeerLostError(f"the job moved on to generation {e.generation.number}")
    if old.backend == "nccl":
        # Aborted, never shut down: NCCL's shutdown waits for ops a dead peer never ends, and
        # racing the watcher's abort it crashed the process. The communicators are freed.
        generations.abort_all(old, lost)
        generations.close_all(old)
    else:
        if old._lost_peer() is not None:  # a healthy group (a grow) finishes its ops instead
            with contextlib.suppress(Exception):
                old.abort(str(lost))
        with contextlib.suppress(Exception):
            old.shutdown()
    if e.host is not None:
        with contextlib.suppress(Exception):
            e.host.shutdown()
        e.host = None
    group = generations.form_newest(e)
    with _lock:
        _default = group
        _job = _Job(e.store, group.rank, group.world_size, leave_together=False,
                    timeout=e.timeout)  # fmt: skip
        failures.use_job_store(e.store)
    _start_recorder(group)
    return group


def _joined(group: ProcessGroup, trace: str | os.PathLike[str] | None) -> None:
    """Once joined: the heap keeps freed memory on CPU backends; the recorders start.

    See ``shardline.heap`` (unless ``SHARDLINE_KEEP_FREED_MEMORY=0``).
    """
    if group.backend != "nccl" and config.get("SHARDLINE_KEEP_FREED_MEMORY"):
        keep_freed_memory()
    _start_recorder(group, trace)


def _start_recorder(group: ProcessGroup, trace: str | os.PathLike[str] | None = None) -> None:
    """The flight recorder learns who this process is and dumps on ``SIGUSR1``.

    The tracer starts where ``trace`` or ``SHARDLINE_TRACE`` says (nothing when neither does).
    """
    directory = config.get("SHARDLINE_FLIGHT_DIR")
    RECORDER.configure(
        rank=group.rank,
        world_size=group.world_size,
        capacity=config.get("SHARDLINE_FLIGHT_OPS"),
        directory=Path(directory) if directory else None,
    )
    RECORDER.install_signal_handler()
    where = trace if trace is not None else config.get("SHARDLINE_TRACE")
    if where:
        TRACER.start(where, rank=group.rank, world_size=group.world_size, backend=group.backend)


def _init_mpi(timeout: timedelta | float | None) -> ProcessGroup:
    """The default group on MPI: ranks from MPI, checked against RANK/WORLD_SIZE if set."""
    from shardline.comm.backends import mpi  # noqa: PLC0415

    rank, world_size = mpi.mpi_rank_and_size()
    # A launcher's RANK/WORLD_SIZE, if any, must agree with MPI's (mpi.create checks that).
    for name in ("RANK", "WORLD_SIZE"):
        raw = (config.env_var(name) or "").strip()
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ShardlineError(f"{name}={raw!r} is not an integer") from None
        if name == "RANK":
            rank = value
        else:
            world_size = value
    return init_process_group(None, rank, world_size, backend="mpi", timeout=timeout)


def is_initialized() -> bool:
    """Whether ``init`` created a default group (and ``shutdown`` has not run)."""
    return _default is not None


def default_group() -> ProcessGroup:
    """The default group; raises ``ShardlineError`` if ``init`` has not run."""
    if _default is None:
        raise ShardlineError("shardline is not initialised; call shardline.init() first")
    return _default


REPEAT = "repeat"  # the deterministic mode of one layout's bits, run after run
MICROBATCH = "microbatch"  # every layout's bits, on the model's kernels, per micro-batch


def deterministic_mode(value: object = None, where: str = "") -> bool | str:
    """``value`` as a deterministic mode: ``False``, ``True``, ``"repeat"`` or ``"microbatch"``.

    ``True``: every layout's bits the same; ``"repeat"``: one layout's, run after run;
    ``"microbatch"``: every layout's, for micro-batches of one size, on the model's kernels.
    ``None`` takes ``init``'s choice, else ``SHARDLINE_DETERMINISTIC``.

    Raises:
        InvalidArgumentError: any other value, naming the call (``where``).
    """
    if value is None:
        chosen = _settings["deterministic"]
        value = config.get("SHARDLINE_DETERMINISTIC") if chosen is None else chosen
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in (REPEAT, MICROBATCH):
        return value.strip().lower()
    raise InvalidArgumentError(
        f"{where + ': ' if where else ''}deterministic={value!r}: use True (the same bits in "
        "every layout), 'microbatch' (the same, for micro-batches of one size, on the "
        "model's kernels), 'repeat' (the same bits run after run, for one layout) or False"
    )


def shutdown() -> None:
    """Shuts the default group down (waiting for queued ops) and leaves the job.

    Collective where rank 0 hosts the rendezvous store (plain env:// or srun; not under
    ``shardline run`` or torchrun, whose launcher hosts it): every rank checks out through
    the store, and rank 0 returns only once the others have, so the store outlives every rank
    that still creates groups through it. Rank 0 waits the group's ``timeout`` at most
    (``init``'s, else ``SHARDLINE_TIMEOUT``), then logs which ranks did not check out (logger
    ``"shardline"``) and returns; it does not wait once an op here raised ``PeerLostError`` (a
    dead rank never checks out). A rank that exits without ``shutdown`` checks out at exit.
    """
    global _default, _job
    with _lock:
        group, _default = _default, None
        job, _job = _job, None
        _settings["deterministic"] = None
        failures.use_job_store(None)
        if group is None:
            return
        if job is not None and _elastic is None:
            failures.note_left(job.store, job.rank, "shutdown")
        TRACER.stop(state="shutdown")
        try:
            group.shutdown()
        finally:
            if job is not None:
                job.check_out(group._lost_peer())


def _check_out_at_exit() -> None:
    """Registers, once, a check-out at interpreter exit for ranks that skip ``shutdown``.

    Only ranks other than 0 check out there (a rank that raised, or returned early, then
    does not keep rank 0 waiting in its ``shutdown``); rank 0 waits only in ``shutdown``.
    """
    global _atexit_registered  # noqa: PLW0603
    if _atexit_registered:
        return
    _atexit_registered = True

    def check_out() -> None:
        job = _job
        if job is not None and _elastic is None:
            failures.note_left(job.store, job.rank, "ended")
        if job is not None and job.rank != 0:
            with contextlib.suppress(Exception):
                job.check_out()

    atexit.register(check_out)
