"""Every store call of ours goes through ``StoreClient``: torch's errors become ours.

The rendezvous store (torch's ``TCPStore``, often behind ``PrefixStore``s) carries host
identities, listener addresses, arena paths, a generated secret, the backend choice, barriers
and shutdown check-outs. A ``StoreClient`` wraps it for one task of one rank ("creating group
'world.3'"), and every call names its step ("publishing its host identity"), so a failure
says which rank, doing what, and what to do:

- the store's host is gone (torch's ``DistNetworkError``: broken pipe, connection reset):
  ``PeerLostError``;
- a wait passed its deadline (torch's ``DistStoreError``: "wait timeout"):
  ``CollectiveTimeoutError``;
- anything else the store raises: ``ShardlineError``.

[Note: a rank that fails while joining] A rank whose ``shardline.init`` fails once the store is
open (no GPU for it, another backend, the handshake refused its secret) publishes its error in
the job's store (``publish_failure``). Every wait of a ``StoreClient`` looks for such a record
every ``WATCH_EVERY`` seconds, and so does the native engine while it links its TCP mesh
(``StoreClient.raise_if_failed``): the ranks still in rendezvous raise within a second, naming
the failed rank and its error, instead of waiting out ``SHARDLINE_TIMEOUT`` for a peer that
will never come. A rank that saw a record says so (``FAILURES_SEEN``), so that whoever hosts
the store keeps it up until the others have read why (``linger_after_failure``, 5 s at most).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from shardline.errors import (
    AuthenticationError,
    CollectiveTimeoutError,
    PeerLostError,
    ShardlineError,
)

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = [
    "FAILURES",
    "FAILURES_SEEN",
    "WATCH_EVERY",
    "StoreClient",
    "exchange",
    "linger_after_failure",
    "publish_failure",
    "store_barrier",
    "store_errors",
]

FAILURES = "shardline/failures"
"""Counter of published join failures; record ``i`` (from 1) is at ``FAILURES/<i>``."""
FAILURES_SEEN = "shardline/failures/seen"
"""Counter of ranks that read a join failure and stopped."""
WATCH_EVERY = 0.5
"""Seconds between two looks for a join failure while waiting in the store."""
_POLL_MAX = 0.05  # the longest sleep between two checks of the keys a wait is for
_STORE_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, OSError)
_LINGER_S = 5.0


class _Absent(Exception):
    """Stands in for a torch error class this torch build lacks (never raised)."""


_DIST_ERROR: type[Exception] = getattr(dist, "DistError", _Absent)
_NETWORK_ERROR: type[Exception] = getattr(dist, "DistNetworkError", _Absent)


def store_address(store: object) -> str | None:
    """``host:port`` of the TCPStore under ``store``'s prefixes, if it is one."""
    inner = store
    while True:
        under = getattr(inner, "underlying_store", None)
        if under is None:
            break
        inner = under
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    return f"{host}:{port}" if host and port else None


class StoreClient:
    """One rank's store calls for one task; failures name the rank, the task and the step.

    Args:
        store: A torch ``Store`` (or another client, whose store is reused).
        rank: This rank, in the group the task is about.
        task: What the calls are for, e.g. ``"creating group 'world.3'"``.
    """

    def __init__(self, store: Store | StoreClient, *, rank: int, task: str) -> None:
        self.store: Any = store.store if isinstance(store, StoreClient) else store
        self.rank = rank
        self.task = task

    @property
    def address(self) -> str | None:
        """``host:port`` of the store, when it is a TCPStore."""
        return store_address(self.store)

    @contextlib.contextmanager
    def step(self, what: str, *, store_only: bool = False) -> Iterator[None]:
        """Turns a store failure inside the block into a ``ShardlineError`` about ``what``.

        Args:
            what: The step, e.g. ``"publishing its host identity"``.
            store_only: Translate only torch's distributed errors (for a block that does more
                than store calls, such as building a torch process group through the store).
        """
        caught = (_DIST_ERROR,) if store_only else (RuntimeError, OSError)
        try:
            yield
        except ShardlineError:
            raise
        except caught as exc:
            raise self.error(what, exc) from exc

    def error(self, what: str, exc: BaseException) -> ShardlineError:
        """The ``ShardlineError`` for ``exc``, raised by the store during ``what``."""
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        head = f"rank {self.rank}: {self.task}: {what}"
        where = self.address
        store = f"the rendezvous store at {where}" if where else "the rendezvous store"
        if isinstance(exc, (_NETWORK_ERROR, ConnectionError)):
            return PeerLostError(
                f"{head} failed: {store} is gone ({text}): rank 0 or the launcher that hosted "
                "it exited. If rank 0 failed, its own error says why; if it had finished, call "
                "shardline.shutdown() on every rank (it is collective: rank 0 leaves last), or "
                "launch with `shardline run`, whose launcher hosts the store for the whole job"
            )
        if isinstance(exc, TimeoutError) or "timeout" in text.lower() or "timed out" in text:
            return CollectiveTimeoutError(
                f"{head} timed out ({text}); check that every rank reaches this point "
                "(SHARDLINE_TIMEOUT sets the deadline)"
            )
        return ShardlineError(f"{head} failed: {store} raised {type(exc).__name__}: {text}")

    def set(self, key: str, value: str | bytes, what: str) -> None:
        """``store.set(key, value)``."""
        with self.step(what):
            self.store.set(key, value)

    def get(self, key: str, what: str) -> bytes:
        """``store.get(key)``: waits until ``key`` exists (up to the store's timeout).

        Raises ``PeerLostError`` (``AuthenticationError`` for a refused secret) within
        ``WATCH_EVERY`` seconds once a rank published a join failure.
        """
        with self.step(what):
            timeout = self.store.timeout.total_seconds()
        self._await([key], timeout, what)
        with self.step(what):
            return bytes(self.store.get(key))

    def add(self, key: str, amount: int, what: str) -> int:
        """``store.add(key, amount)``: the counter after adding."""
        with self.step(what):
            return int(self.store.add(key, amount))

    def check(self, keys: list[str], what: str) -> bool:
        """Whether every key of ``keys`` exists (no waiting)."""
        with self.step(what):
            return bool(self.store.check(keys))

    def wait(self, keys: list[str], timeout: float, what: str) -> None:
        """Waits until every key of ``keys`` exists, ``timeout`` seconds at most.

        Raises ``PeerLostError`` (``AuthenticationError`` for a refused secret) within
        ``WATCH_EVERY`` seconds once a rank published a join failure.
        """
        self._await(keys, timeout, what)

    def _await(self, keys: list[str], timeout: float, what: str) -> None:
        # Polls with ``check`` (torch's timed ``wait`` would log a warning at each slice),
        # from 1 ms up to 50 ms between checks, looking for join failures every WATCH_EVERY.
        start = time.monotonic()
        deadline, watch = start + timeout, start + WATCH_EVERY
        pause = 0.001
        while True:
            with self.step(what):
                if self.store.check(keys):
                    return
            now = time.monotonic()
            if now >= watch:
                self.raise_if_failed(what)
                watch = now + WATCH_EVERY
            if now >= deadline:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: {self.task}: {what} timed out after {timeout:.1f} s "
                    f"waiting for {', '.join(keys)}; check that every rank reaches this point "
                    "(SHARDLINE_TIMEOUT sets the deadline)"
                )
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, _POLL_MAX)

    def raise_if_failed(self, what: str) -> None:
        """Raises if a rank published a join failure.

        ``AuthenticationError`` when the handshake refused a secret, else ``PeerLostError``;
        both name the failed rank and its error. See [Note: a rank that fails while joining].
        """
        with self.step(what):
            if int(self.store.add(FAILURES, 0)) == 0:
                return
            self.store.wait([f"{FAILURES}/1"], timedelta(seconds=5))
            record = json.loads(bytes(self.store.get(f"{FAILURES}/1")))
            with contextlib.suppress(*_STORE_ERRORS):
                self.store.add(FAILURES_SEEN, 1)
        if int(record["rank"]) < 0:  # not a rank's failure: the job's (an elastic generation)
            raise PeerLostError(f"rank {self.rank}: {self.task}: {what}: {record['message']}")
        kind = AuthenticationError if record["kind"] == "AuthenticationError" else PeerLostError
        advice = (
            "give every rank the same SHARDLINE_SECRET"
            if kind is AuthenticationError
            else "fix the failed rank (its error above), then start the job again"
        )
        error = kind(
            f"rank {self.rank}: {self.task}: {what}: stopped, since rank {record['rank']} "
            f"failed while joining the job with {record['kind']}: {record['message']} "
            f"({advice})"
        )
        error.failed_rank = int(record["rank"])
        raise error


def publish_failure(store: Store, rank: int, exc: BaseException) -> None:
    """Tells the job that ``rank`` failed while joining, with ``exc``.

    Best effort: the store may be gone too. See [Note: a rank that fails while joining].
    """
    if getattr(exc, "failed_rank", None) is not None:
        return  # this rank stopped because of another's record: that one says why
    record = json.dumps({"rank": rank, "kind": type(exc).__name__, "message": str(exc)})
    with contextlib.suppress(*_STORE_ERRORS):
        index = int(store.add(FAILURES, 1))
        store.set(f"{FAILURES}/{index}", record)


def linger_after_failure(store: Store, world_size: int, limit: float = _LINGER_S) -> None:
    """Keeps the caller's store up until every rank read a published join failure.

    Returns once every rank either failed or read the failure, ``limit`` seconds at most (at
    once where no failure was published): the others then raise the failed rank's error, not
    "the store is gone".
    """
    deadline = time.monotonic() + limit
    with contextlib.suppress(*_STORE_ERRORS):
        while int(store.add(FAILURES, 0)) > 0 and time.monotonic() < deadline:
            if int(store.add(FAILURES, 0)) + int(store.add(FAILURES_SEEN, 0)) >= world_size:
                return
            time.sleep(0.05)


def store_errors(store: Store | StoreClient, *, rank: int, task: str) -> StoreClient:
    """``store`` as a ``StoreClient`` for ``task``; a client keeps its own (the caller's) task."""
    if isinstance(store, StoreClient):
        return store
    return StoreClient(store, rank=rank, task=task)


def exchange(client: StoreClient, prefix: str, world_size: int, value: str, what: str) -> list[str]:
    """Publishes ``value`` under ``prefix/<rank>``; returns every rank's value, in rank order.

    Args:
        client: The store, for this rank and task.
        prefix: Key prefix of this round.
        world_size: Ranks taking part.
        value: This rank's value.
        what: What the values are, for messages (``"host identity"``).

    Raises:
        CollectiveTimeoutError: a rank did not publish in time; names the ranks that did not.
        PeerLostError: the store is gone.
    """
    client.set(f"{prefix}/{client.rank}", value, f"publishing its {what}")
    values = []
    for r in range(world_size):
        try:
            values.append(client.get(f"{prefix}/{r}", f"reading rank {r}'s {what}").decode())
        except CollectiveTimeoutError as exc:
            step = f"looking for every rank's {what}"
            absent = [q for q in range(world_size) if not client.check([f"{prefix}/{q}"], step)]
            raise CollectiveTimeoutError(
                f"{exc}; rank(s) {absent} of {world_size} never published theirs"
            ) from exc
    return values


def store_barrier(
    client: StoreClient, key: str, world_size: int, timeout: float, what: str
) -> None:
    """Returns once ``world_size`` ranks arrived at ``key``.

    Args:
        client: The store, for this rank and task.
        key: Key prefix of this barrier.
        world_size: Ranks taking part.
        timeout: Seconds to wait at most.
        what: The step, for messages (``"waiting for every rank to connect"``).

    Raises:
        CollectiveTimeoutError: not all ranks arrived within ``timeout`` seconds; the message
            says how many did.
        PeerLostError: the store is gone.
    """
    arrived = client.add(f"{key}/count", 1, what)
    if arrived == world_size:
        client.set(f"{key}/done", "1", what)
    try:
        client.wait([f"{key}/done"], timeout, what)
    except CollectiveTimeoutError as exc:
        count = client.add(f"{key}/count", 0, what)
        raise CollectiveTimeoutError(
            f"rank {client.rank}: {client.task}: {what} timed out after {timeout:.1f} s with "
            f"{count} of {world_size} ranks arrived; check that every rank reaches this point "
            "(SHARDLINE_TIMEOUT)"
        ) from exc
