"""List-shaped collective arguments turned into the flat buffers backends take, and back.

``ProcessGroup`` calls these after its own checks; each raises ``InvalidArgumentError`` naming
the op, the rank and the entry that is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from shardline.comm._buffers import check_numel, check_same_dtype
from shardline.errors import InvalidArgumentError

if TYPE_CHECKING:
    from shardline.comm._buffers import TensorLike
    from shardline.comm.group import ProcessGroup

__all__ = ["flat_input", "flat_output", "scatter_into", "tensor_list"]

TensorList = Sequence["TensorLike"]


def tensor_list(
    g: ProcessGroup, values: TensorList, what: str, like: torch.Tensor, n: int
) -> list[torch.Tensor]:
    if len(values) != n:
        raise InvalidArgumentError(
            f"{what} on rank {g.rank}: expected a list of {n} tensors (one per rank), "
            f"got {len(values)}"
        )
    outs = [g._t(v, f"{what}[{i}]") for i, v in enumerate(values)]
    for o in outs:
        check_same_dtype(what, g.rank, like, o)
    return outs


def flat_input(
    g: ProcessGroup, value: TensorLike | TensorList, op: str, n: int, like: torch.Tensor
) -> torch.Tensor:
    if isinstance(value, list | tuple):
        parts = tensor_list(g, value, f"{op}(input list)", like, g.world_size)
        for i, p in enumerate(parts):
            check_numel(f"{op}(input list[{i}])", g.rank, n, p, "every entry like the output")
        if n == 0:
            return torch.empty(0, dtype=like.dtype, device=like.device)
        return torch.cat([p.reshape(-1) for p in parts])
    return g._t(value, f"{op}(input)")


def flat_output(
    g: ProcessGroup, value: TensorLike | TensorList, op: str, like: torch.Tensor
) -> tuple[torch.Tensor, Callable[[], None] | None]:
    n = like.numel()
    if isinstance(value, list | tuple):
        outs = tensor_list(g, value, f"{op}(output list)", like, g.world_size)
        for i, o in enumerate(outs):
            check_numel(f"{op}(output list[{i}])", g.rank, n, o, "every entry like the input")
        flat = torch.empty(n * g.world_size, dtype=like.dtype, device=like.device)
        return flat, scatter_into(flat, outs)
    out = g._t(value, f"{op}(output)")
    check_same_dtype(op, g.rank, like, out)
    check_numel(
        f"{op}(output)",
        g.rank,
        n * g.world_size,
        out,
        f"world_size {g.world_size} x input's {n}",
    )
    return out, None


def scatter_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> Callable[[], None]:
    """A finaliser copying consecutive parts of ``flat`` into ``outs``."""

    def copy() -> None:
        start = 0
        for o in outs:
            n = o.numel()
            o.view(-1).copy_(flat[start : start + n])
            start += n

    return copy
