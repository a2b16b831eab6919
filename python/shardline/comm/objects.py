"""Object collectives: any picklable Python object, over a group's tensor collectives.

An object travels pickled, as bytes in a uint8 tensor on the group's device (CPU, or the
nccl backend's GPU), after its length: ``all_gather_object`` all-gathers every rank's length,
then the bytes (an unequal all_gather); ``broadcast_object`` broadcasts the length, then the
bytes. Like ``torch.distributed``'s object collectives, they unpickle what other ranks send,
which runs code of their choosing: use them only between ranks that trust each other (the
ranks of one job do: they share its secret).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from shardline.comm.group import ProcessGroup
from shardline.comm.world import default_group

__all__ = ["all_gather_object", "broadcast_object"]


def _group(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else default_group()


def _pickled(obj: Any, device: torch.device) -> torch.Tensor:
    data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


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
        ShardlineError: a collective failed (``PeerLostError``, ``CollectiveTimeoutError``).
    """
    g = _group(group)
    payload = _pickled(obj, g.device)
    sizes = torch.empty(g.world_size, dtype=torch.int64, device=g.device)
    g.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=g.device))
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
        InvalidArgumentError: ``src`` is not a rank of the group.
        ShardlineError: a collective failed.
    """
    g = _group(group)
    payload = _pickled(obj, g.device) if g.rank == src else None
    size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
    size = size.to(g.device)
    g.broadcast(size, src)
    buf = payload if payload is not None else torch.empty(int(size.item()), dtype=torch.uint8)
    buf = buf.to(g.device)
    g.broadcast(buf, src)
    return _unpickled(buf)
