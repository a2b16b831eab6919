"""Run ranks as threads of this process: the helper every distributed test goes through."""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shardline.comm import ProcessGroup, init_process_group

__all__ = [
    "SECRET",
    "THREAD_PREFIX",
    "built_once",
    "host_ids",
    "new_store",
    "run_ranks",
    "seeded",
    "shared_store",
]

SECRET = b"shardline-test-secret"
THREAD_PREFIX = "shardline-rank-"


_F = TypeVar("_F", bound=Callable[..., Any])
_BUILDING = threading.RLock()


def built_once(fn: _F) -> _F:
    """``functools.cache`` for a test's pristine model, safe when ranks (threads) ask at once.

    Such a model is built from the global RNG (``torch.manual_seed(0)`` then its layers'
    initialisation): two threads that both missed the cache would build it at the same time,
    their draws interleaved, and get different weights. One build at a time here.
    """
    cached = functools.cache(fn)

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        with _BUILDING:
            return cached(*args)

    return call  # type: ignore[return-value]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """``torch.manual_seed(seed)`` then the block, one rank thread at a time.

    Ranks are threads sharing torch's global generator: two that seed and then build a model
    at once interleave their draws and get different weights (a test then compares a model
    nobody built). Builders that seed the global generator run inside this.
    """
    with _BUILDING:
        torch.manual_seed(seed)
        yield


def host_ids(n: int, transport: str) -> list[str]:
    """Host identities that force ``transport``: one host, one per rank, or two hosts."""
    if transport == "shm":
        return ["host-a"] * n
    if transport == "tcp":
        return [f"host-{r}" for r in range(n)]
    if transport == "hier":
        return ["host-a" if r < (n + 1) // 2 else "host-b" for r in range(n)]
    raise ValueError(f"unknown transport {transport!r}; use shm, tcp or hier")


def new_store(timeout: float = 30.0) -> dist.TCPStore:
    """A master TCPStore on a free loopback port (port 0)."""
    return dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False
    )


def shared_store(timeout: float = 30.0) -> dist.HashStore:
    """An in-memory store for ranks that are threads of this process (``run_ranks`` says why
    not a TCPStore)."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=timeout))
    return store


def run_ranks(
    n: int,
    body: Callable[[ProcessGroup], Any],
    backend: str = "native",
    transport: str = "shm",
    timeout: float = 60.0,
    op_timeout: float = 20.0,
    secrets: list[bytes | None] | None = None,
) -> list[Any]:
    """Runs ``body(group)`` on ``n`` ranks as threads, each with its own ProcessGroup.

    ``secrets`` gives each rank's job secret (``None``: resolved from the environment);
    by default all ranks share ``SECRET``.

    Returns every rank's return value, in rank order. If any rank raised, raises one
    AssertionError listing every failed rank's exception and traceback; if any rank is still
    running after ``timeout`` seconds, aborts the groups and reports the stuck ranks.
    Groups are always shut down.
    """
    # The ranks are threads of this process, so they share an in-memory store. A TCPStore
    # client per rank made torch look up the reverse DNS name of ::ffff:127.0.0.1 (it logs
    # the address it connects to), and where the resolver drops some of those queries (CI's
    # machines: about every 50th in a process) a connect took 5 s: a sixth of the
    # collective tests' time. The store's deadline is at least 30 s, whatever the group's.
    store = shared_store(max(op_timeout, 30.0))
    ids = host_ids(n, transport)
    results: list[Any] = [None] * n
    errors: dict[int, str] = {}
    groups: list[ProcessGroup | None] = [None] * n

    def run(rank: int) -> None:
        try:
            g = init_process_group(
                store,
                rank,
                n,
                backend=backend,
                host_id=ids[rank],
                timeout=op_timeout,
                secret=secrets[rank] if secrets is not None else SECRET,
                master_addr="127.0.0.1",
            )
            groups[rank] = g
            results[rank] = body(g)
        except BaseException as exc:
            errors[rank] = "".join(traceback.format_exception(exc))

    threads = [
        threading.Thread(target=run, args=(r,), name=f"{THREAD_PREFIX}{r}", daemon=True)
        for r in range(n)
    ]
    for t in threads:
        t.start()
    stuck = _join(threads, timeout)
    if stuck:
        for g in groups:
            if g is not None:
                _quietly(lambda g=g: g.abort("run_ranks timed out"))
        _join(threads, 5.0)
    _shutdown_all(groups)
    _forget_torch_ddp_forward()
    # Free this run's groups and stores now: left to the cyclic collector, leftover
    # connections from earlier runs occasionally held a later run's store connections up
    # for 5 s (seen in 1 of ~10 back-to-back runs).
    groups.clear()
    gc.collect()
    if stuck or errors:
        lines = [f"{len(errors)} of {n} ranks failed ({backend}, {transport}):"]
        lines += [f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)]
        if stuck:
            lines.append(f"ranks still running after {timeout} s: {stuck}")
        raise AssertionError("\n".join(lines))
    return results


def _forget_torch_ddp_forward() -> None:
    """Clears torch DDP's class-wide "module in forward" that ranks as threads leave set.

    ``DistributedDataParallel`` saves and restores ``_active_ddp_module`` around each forward.
    Two threads' forwards interleave (A enters, B enters and saves A, A leaves, B leaves and
    restores A), so A's module stays set after both end; ``torch.compile`` in a later test of
    the same process then compiles as if inside DDP (DDPOptimizer) and fails. Processes
    never share it; only this harness's threads do."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._active_ddp_module = None


def _join(threads: list[threading.Thread], timeout: float) -> list[int]:
    import time

    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [i for i, t in enumerate(threads) if t.is_alive()]


def _shutdown_all(groups: list[ProcessGroup | None]) -> None:
    # Concurrently: close() waits for queued ops, which may need peers to close too.
    closers = [
        threading.Thread(target=_quietly, args=(g.shutdown,), daemon=True)
        for g in groups
        if g is not None
    ]
    for t in closers:
        t.start()
    _join(closers, 10.0)


def _quietly(fn: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):
        fn()
