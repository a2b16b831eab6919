"""Object collectives: any picklable Python object, over a group's tensor collectives.

An object travels pickled, as bytes in a uint8 tensor on the group's device (CPU, or the
nccl backend's GPU), after its length: ``all_gather_object`` all-gathers every rank's length,
then the bytes (an unequal all_gather); ``broadcast_object`` broadcasts the length, then the
bytes. Like ``torch.distributed``'s object collectives, they unpickle what other ranks send,
which runs code of their choosing: use them only between ranks that trust each other (the
ranks of one job do: they share its secret).

An object that does not pickle (a lock, an open file, a lambda) fails every rank of the call,
not only its own: that rank sends a length of -1 instead, the others raise naming it, and it
raises with pickle's error, so none waits for bytes that will not come.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from shardline.comm.group import ProcessGroup
from shardline.comm.world import default_group
from shardline.errors import InvalidArgumentError

__all__ = ["all_gather_object", "broadcast_object"]


def _group(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else default_group()


def _pickled(obj: Any, device: torch.device) -> torch.Tensor | Exception:
    """``obj`` pickled into a uint8 tensor, or the error that pickling it raised."""
    try:
        data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:  # any __reduce__ may raise anything: the other ranks are told
        return exc
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def _refused(what: str, g: ProcessGroup, bad: list[int], own: Exception | None) -> None:
    """Raises on every rank when some rank's object did not pickle (``bad``: those ranks)."""
    if own is not None:
        raise InvalidArgumentError(
            f"{what} on rank {g.rank} of group {g.name!r}: its object cannot be pickled "
            f"({type(own).__name__}: {own}); pass a picklable object (every rank of the call "
            "raises)"
        ) from own
    if bad:
        ranks = ", ".join(map(str, bad))
        raise InvalidArgumentError(
            f"{what} on rank {g.rank} of group {g.name!r}: the object of rank {ranks} cannot be "
            "pickled; see the error raised there"
        )


def _unpickled(payload: torch.Tensor) -> Any:
    return pickle.loads(payload.cpu().numpy().tobytes())  # trusted peers: see the module doc


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank. Collective.

    Args:
        obj: This rank's object; anything ``pickle`` takes. Sizes may differ between ranks.
        group: The ranks taking part; the default group when ``None``.

    Returns:
        ``[obj of rank 0, obj of rank 1, ...]`` (copies, also this rank's own).

    Raises:
        InvalidArgumentError: a rank's object cannot be pickled (on every rank).
        ShardlineError: a collective failed (``PeerLostError``, ``CollectiveTimeoutError``).
    """
    g = _group(group)
    payload = _pickled(obj, g.device)
    own = payload if isinstance(payload, Exception) else None
    size = -1 if isinstance(payload, Exception) else payload.numel()
    sizes = torch.empty(g.world_size, dtype=torch.int64, device=g.device)
    g.all_gather(sizes, torch.tensor([size], dtype=torch.int64, device=g.device))
    _refused("all_gather_object", g, [r for r, n in enumerate(sizes.tolist()) if n < 0], own)
    assert not isinstance(payload, Exception)
    outs = [torch.empty(int(n), dtype=torch.uint8, device=g.device) for n in sizes.tolist()]
    g.all_gather(outs, payload)
    return [_unpickled(o) for o in outs]


def broadcast_object(obj: Any, src: int = 0, group: ProcessGroup | None = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank. Collective.

    Args:
        obj: The object, on ``src``; ignored on the other ranks (pass ``None``).
        src: The rank of ``group`` that sends.
        group: The ranks taking part; the default group when ``None``.

    Returns:
        ``src``'s object (a copy, on ``src`` too).

    Raises:
        InvalidArgumentError: ``src`` is not a rank of the group, or its object cannot be
            pickled (on every rank).
        ShardlineError: a collective failed.
    """
    g = _group(group)
    payload = _pickled(obj, g.device) if g.rank == src else None
    own = payload if isinstance(payload, Exception) else None
    n = 0 if payload is None else -1 if isinstance(payload, Exception) else payload.numel()
    size = torch.tensor([n], dtype=torch.int64).to(g.device)
    g.broadcast(size, src)
    _refused("broadcast_object", g, [src] if int(size.item()) < 0 else [], own)
    assert not isinstance(payload, Exception)
    buf = payload if payload is not None else torch.empty(int(size.item()), dtype=torch.uint8)
    buf = buf.to(g.device)
    g.broadcast(buf, src)
    return _unpickled(buf)
