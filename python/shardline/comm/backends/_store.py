"""Small helpers over torch's Store shared by the backends: namespaced keys and a barrier."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from shardline.errors import CollectiveTimeoutError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["exchange", "store_barrier"]


def exchange(store: Store, prefix: str, rank: int, world_size: int, value: str) -> list[str]:
    """Publishes ``value`` under ``prefix/rank`` and returns every rank's value, in rank order."""
    store.set(f"{prefix}/{rank}", value)
    return [bytes(store.get(f"{prefix}/{r}")).decode() for r in range(world_size)]


def store_barrier(
    store: Store, key: str, rank: int, world_size: int, timeout: float, what: str
) -> None:
    """Returns once ``world_size`` ranks arrived at ``key``.

    Raises:
        CollectiveTimeoutError: not all ranks arrived within ``timeout`` seconds; the message
            says how many did.
    """
    arrived = store.add(f"{key}/count", 1)
    if arrived == world_size:
        store.set(f"{key}/done", "1")
    try:
        store.wait([f"{key}/done"], timedelta(seconds=timeout))
    except RuntimeError as exc:  # torch raises DistStoreError (a RuntimeError) on timeout
        count = store.add(f"{key}/count", 0)
        raise CollectiveTimeoutError(
            f"rank {rank}: {what} timed out after {timeout:.1f} s with {count} of {world_size} "
            "ranks arrived; check that every rank reaches this point (SHARDLINE_TIMEOUT)"
        ) from exc
