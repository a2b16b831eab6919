"""What the layout pricers share (``tensor_layout``, ``pipeline_layout``).

A copy of the model on the meta device (nothing allocated), the example batch widened to a
replica's (at a fixed global batch a replica of ``k`` ranks trains ``k`` ranks' batches), the
sizes worth pricing, and an error in one line for a note.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from shardline.errors import InvalidArgumentError
from shardline.parallel.activations import _map_tensors

__all__ = ["first_line", "meta_copy", "split_sizes", "widened"]


def split_sizes(world_size: int, local_ranks: int) -> list[int]:
    """The tp (or pp) sizes worth pricing: powers of two above 1 that divide both."""
    sizes, t = [], 2
    while t <= min(world_size, local_ranks):
        if world_size % t == 0 and local_ranks % t == 0:
            sizes.append(t)
        t *= 2
    return sizes


def widened(example_input: Any, k: int) -> Any:
    """``example_input`` with each tensor repeated ``k`` times along its first dimension."""
    if k == 1:
        return example_input

    def repeat(x: torch.Tensor) -> torch.Tensor:
        return x.repeat(k, *([1] * (x.dim() - 1))) if x.dim() else x

    return _map_tensors(example_input, repeat)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (nothing copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad
            )
    for b in model.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return copy.deepcopy(model, memo)


def first_line(e: BaseException) -> str:
    """An error in one line: its first, with its type unless it is shardline's own."""
    text = str(e).splitlines()[0] if str(e) else ""
    return text if isinstance(e, InvalidArgumentError) else f"{type(e).__name__}: {text}"
