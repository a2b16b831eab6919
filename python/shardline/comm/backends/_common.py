"""Pieces shared by the backends that hand tensors to torch's process groups (gloo, nccl, mpi)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "BOOL_OPS",
    "as_bytes",
    "gather_args",
    "pad_unequal",
    "reduce_args",
    "scatter_args",
    "split",
]

# [Note: bool] bool is reduced as uint8: sum/max are "or", prod/min are "and".
BOOL_OPS = {"sum": "max", "max": "max", "prod": "min", "min": "min"}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened and viewed as uint8 (data movement needs no dtype)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def split(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``parts`` equal views of ``flat``."""
    return list(flat.view(parts, flat.numel() // parts).unbind(0))


def gather_args(
    out: torch.Tensor | None, inp: torch.Tensor, root: int, world_size: int
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], Any]:
    """Torch's ``gather`` arguments: ``inp`` into the flat ``out`` (``None`` off the root)."""
    opts = dist.GatherOptions()
    opts.rootRank = root
    outs = [] if out is None else [split(as_bytes(out), world_size)]
    return outs, [as_bytes(inp)], opts


def scatter_args(
    out: torch.Tensor, inp: torch.Tensor | None, root: int, world_size: int
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], Any]:
    """Torch's ``scatter`` arguments: the flat ``inp`` (``None`` off the root) into ``out``."""
    opts = dist.ScatterOptions()
    opts.rootRank = root
    ins = [] if inp is None else [split(as_bytes(inp), world_size)]
    return [as_bytes(out)], ins, opts


def reduce_args(t: torch.Tensor, op: str, ops: Mapping[str, Any]) -> tuple[torch.Tensor, Any]:
    """The flat buffer and torch ReduceOp for reducing ``t`` with ``op`` (bool as uint8)."""
    if t.dtype == torch.bool:
        return as_bytes(t), ops[BOOL_OPS[op]]
    return (t if t.dim() == 1 else t.reshape(-1)), ops[op]


def pad_unequal(
    out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int], world_size: int
) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
    """An unequal all_gather as an equal one: ``(padded input, gathered, unpad)``.

    Gather ``padded`` (``max(counts)`` elements) from every rank into ``gathered``, then call
    ``unpad()`` to copy each rank's ``counts[r]`` elements into ``out``, in rank order.
    """
    width = max(counts)
    padded = torch.zeros(width, dtype=inp.dtype, device=inp.device)
    padded[: inp.numel()] = inp.reshape(-1)
    gathered = torch.empty(width * world_size, dtype=inp.dtype, device=inp.device)

    def unpad() -> None:
        start, flat = 0, out.reshape(-1)
        for r, c in enumerate(counts):
            flat[start : start + c] = gathered[r * width : r * width + c]
            start += c

    return padded, gathered, unpad
