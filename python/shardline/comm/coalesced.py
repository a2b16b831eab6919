"""Many tensors broadcast as a few flat chunks: ``broadcast_coalesced``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardline.comm.group import ProcessGroup

__all__ = ["broadcast_coalesced"]


def broadcast_coalesced(
    group: ProcessGroup, tensors: Sequence[torch.Tensor], src: int, cap_bytes: int
) -> None:
    """Broadcasts tensors from ``src``, coalesced into flat chunks of about ``cap_bytes``.

    Tensors on another device than the group's (a model kept in host memory under nccl) travel
    through a chunk-sized copy on the group's device.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        chunk: list[torch.Tensor] = []
        size = 0
        for t in by_dtype[dtype]:
            nbytes = t.numel() * t.element_size()
            if chunk and size + nbytes > cap_bytes:
                _broadcast_chunk(group, chunk, src)
                chunk, size = [], 0
            chunk.append(t)
            size += nbytes
        if chunk:
            _broadcast_chunk(group, chunk, src)


def _broadcast_chunk(group: ProcessGroup, chunk: list[torch.Tensor], src: int) -> None:
    here = chunk[0].device == group.device
    if len(chunk) == 1 and chunk[0].is_contiguous() and here:
        group.broadcast(chunk[0], src=src)
        return
    flat = torch.cat([t.reshape(-1) for t in chunk])
    if not here:
        flat = flat.to(group.device)
    group.broadcast(flat, src=src)
    offset = 0
    with torch.no_grad():
        for t in chunk:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
