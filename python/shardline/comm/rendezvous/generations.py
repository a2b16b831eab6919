"""This process's place in an elastic job: joining a generation, its groups, the next one.

Under ``shardline run --nnodes MIN:MAX`` a worker joins the newest generation that lists it
(``shardline.comm.rendezvous.membership``), forms that generation's default group (its keys under
``/elastic/g<n>``), and, on NCCL, a native twin of it for host copies and a watcher thread
that aborts the NCCL communicators once a later generation is published. ``world`` keeps the
process-wide state (``init``, ``reform``) and calls these.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

from shardline import config
from shardline.comm import init_process_group
from shardline.comm.group import ProcessGroup
from shardline.comm.rendezvous import membership
from shardline.comm.rendezvous.env import host_identity
from shardline.comm.rendezvous.membership import Generation
from shardline.comm.rendezvous.store import publish_failure, store_errors
from shardline.errors import PeerLostError, ShardlineError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = [
    "ElasticJob",
    "abort_all",
    "agree_on_backend",
    "close_all",
    "die_with_launcher",
    "form_generation",
    "form_newest",
    "or_exit",
    "watch_generation",
]

_log = logging.getLogger("shardline")
_JOINING = "joining the job (shardline.init)"


@dataclass
class ElasticJob:
    """This worker's place in an elastic job (``shardline run --nnodes MIN:MAX``).

    Attributes:
        store: The job's store (no prefix: membership keys are global to the job).
        slot: ``"<node>.<local rank>"``, where its launcher runs it.
        incarnation: 0 for the slot's first process, +1 for each replacement.
        generation: The generation the default group belongs to.
        backend: The backend every generation uses.
        timeout: Deadline of every wait, in seconds.
        local_rank: This worker's rank on its node.
        host: On NCCL, the same ranks on the native engine, for host copies.
    """

    store: Store
    slot: str
    incarnation: int
    generation: Generation
    backend: str
    timeout: float
    local_rank: int
    host: ProcessGroup | None = None


def agree_on_backend(store: Store, rank: int, chosen: str, *, explicit: bool) -> None:
    """Fails a rank whose backend differs from rank 0's, instead of hanging in setup."""
    client = store_errors(store, rank=rank, task=_JOINING)
    key = "shardline/init/backend"
    if rank == 0:
        client.set(key, chosen, "publishing the backend it chose")
        return
    theirs = client.get(key, "reading the backend rank 0 chose").decode()
    if theirs != chosen:
        how = "was given" if explicit else "chose"
        raise ShardlineError(
            f"rank {rank} {how} backend {chosen!r} but rank 0 uses {theirs!r}; every rank needs "
            "the same backend: pass the same backend= or set SHARDLINE_BACKEND (or "
            "SHARDLINE_DEVICE) alike on every host"
        )


def agree_on_world_size(store: Store, rank: int, world_size: int, local_world_size: int) -> None:
    """Fails a rank whose job size differs from the first rank's to join, at once.

    Nodes launched with different ``--nproc-per-node`` (or ``--nnodes``) count different
    world sizes and would otherwise wait out their timeout for ranks that never come. The
    first rank to get here records its sizes; every later one compares (the error it raises
    then reaches the others through the store within a second).
    """
    client = store_errors(store, rank=rank, task=_JOINING)
    mine = f"{world_size}/{local_world_size}"
    with client.step("comparing the job's size with the other ranks'"):
        first = bytes(store.compare_set("shardline/init/world_size", "", mine)).decode()
    if first != mine:
        world, local = first.split("/")
        raise ShardlineError(
            f"rank {rank} counts WORLD_SIZE={world_size} ({local_world_size} ranks on its node) "
            f"but the ranks that joined first count WORLD_SIZE={world} ({local} per node); "
            "launch every node with the same --nproc-per-node and --nnodes"
        )


_T = TypeVar("_T")


def or_exit(wait: Callable[[], _T]) -> _T:
    """``wait()``; if the job finished meanwhile, this process leaves with exit code 0."""
    try:
        return wait()
    except membership.JobFinished as exc:
        _log.warning("elastic: %s; exiting", exc)
        raise SystemExit(0) from None


def die_with_launcher() -> None:
    """Asks Linux to kill this worker when its launcher dies: a node goes as a whole."""
    import ctypes  # noqa: PLC0415
    import signal  # noqa: PLC0415

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the launcher died before the call
            os.kill(os.getpid(), signal.SIGKILL)


def form_newest(state: ElasticJob, *, explicit: bool = True) -> ProcessGroup:
    """The default group of ``state.generation``, or of a later one that replaced it.

    A generation replaced while its group forms (the members changed again) fails its
    waits (``PeerLostError``, see ``membership.Coordinator``): this process then joins the
    next one that lists it.
    """
    while True:
        try:
            return form_generation(state, explicit=explicit)
        except PeerLostError:
            newest = or_exit(lambda: membership.next_after(
                state.store, state.generation.number, state.slot, state.incarnation,
                state.timeout))  # fmt: skip
            _log.warning("elastic: generation %d was replaced while it formed; joining %d",
                         state.generation.number, newest.number)  # fmt: skip
            state.generation = newest


def form_generation(state: ElasticJob, *, explicit: bool = True) -> ProcessGroup:
    """The default group of ``state.generation`` (its keys under ``/elastic/g<n>``)."""
    gen = state.generation
    rank = gen.rank_of(state.slot, state.incarnation)
    assert rank is not None
    store = membership.generation_store(state.store, gen.number)
    try:
        agree_on_backend(store, rank, state.backend, explicit=explicit)
        device = None
        if state.backend == "nccl":
            from shardline.comm.backends import nccl  # noqa: PLC0415

            device = nccl.default_device(state.local_rank)
        group = init_process_group(
            store, rank, gen.world_size, backend=state.backend, host_id=host_identity(),
            name=f"world.g{gen.number}", timeout=state.timeout,
            master_addr=config.env_var("MASTER_ADDR"), device=device,
        )  # fmt: skip
    except Exception as exc:
        publish_failure(store, rank, exc)
        raise
    if state.backend == "nccl":
        # Host copies (commits, buddies, reshards) move on the CPU engine, which notices a
        # dead peer; NCCL's point-to-point would wait for it in its connection setup.
        state.host = init_process_group(
            store, rank, gen.world_size, backend="native", host_id=host_identity(),
            name=f"world.g{gen.number}.host", timeout=state.timeout,
            master_addr=config.env_var("MASTER_ADDR"),
        )  # fmt: skip
        watch_generation(state.store, gen.number, group)
    return group


_WATCH_S = 0.1


_abort_lock = threading.Lock()


def abort_all(group: ProcessGroup, lost: PeerLostError) -> None:
    """Marks ``group`` and its sub-groups (a strategy's) as having lost a peer; aborts them.

    Once per group, whoever comes first (the watcher thread or ``reform``).
    """
    with _abort_lock:
        _abort_all_locked(group, lost)


def _abort_all_locked(group: ProcessGroup, lost: PeerLostError) -> None:
    for child in list(group._children):
        _abort_all_locked(child, lost)
    if getattr(group, "_aborted", False):
        return
    group._aborted = True  # type: ignore[attr-defined]
    if group._peer_lost is None:
        group._peer_lost = lost
    with contextlib.suppress(Exception):
        group.abort(str(lost))


def close_all(group: ProcessGroup) -> None:
    """Refuses every later op of ``group`` and its sub-groups (no transport call)."""
    for child in list(group._children):
        close_all(child)
    group._closed = True


def watch_generation(store: Store, number: int, group: ProcessGroup) -> None:
    """Aborts an NCCL group once a later generation is published (a helper thread).

    NCCL does not notice a dead peer: an op with it waits until NCCL's watchdog kills the
    process. The launcher does notice (the worker's exit, or its node's silence), and its
    coordinator publishes the next generation; this thread then marks the group as having
    lost a peer and aborts its communicators, so the op in flight ends and the next one raises
    (``PeerLostError``, which ``shardline.elastic.run`` handles). A node that joins costs the
    step in flight the same way on NCCL. A thread of its own, with a store connection of its
    own (the main thread may be blocked in the store or on the GPU).
    """
    import torch.distributed as dist  # noqa: PLC0415

    addr = getattr(store, "host", None) or config.env_var("MASTER_ADDR", default="127.0.0.1")
    port = getattr(store, "port", None) or int(config.env_required("MASTER_PORT"))

    def watch() -> None:
        try:
            mine = dist.TCPStore(addr, port, None, False, timedelta(seconds=30))  # type: ignore[attr-defined]
            while not group._closed:
                if membership.pending(mine, number):
                    lost = PeerLostError(
                        f"rank {group.rank}: the elastic job moved on to a generation after "
                        f"#{number} (a rank was lost, or a node joined); group {group.name!r} "
                        "is aborted"
                    )
                    abort_all(group, lost)
                    return
                time.sleep(_WATCH_S)
        except Exception as exc:  # the store is gone: the job is over
            _log.debug("elastic: generation watcher stops: %s", exc)

    threading.Thread(target=watch, name=f"shardline-elastic-g{number}", daemon=True).start()
