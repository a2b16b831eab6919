"""The communication at the edges of tensor-parallel regions, as autograd functions.

Megatron's mappings, over our ``ProcessGroup`` (native engine on CPU, NCCL on GPUs). Each
forward has the backward that makes the whole differentiable, so a layer built from them
trains as the dense layer does:

========================  ==============================  ================================
function                  forward                         backward
========================  ==============================  ================================
``copy_to``               identity                        all-reduce the gradient
``reduce_from``           all-reduce                      identity
``gather_from(dim)``      all-gather along ``dim``        keep this rank's slice
``split_to(dim)``         keep this rank's slice          all-gather along ``dim``
``gather_seq(dim)``       all-gather along ``dim``        reduce-scatter along ``dim``
``scatter_seq(dim)``      reduce-scatter along ``dim``    all-gather along ``dim``
========================  ==============================  ================================

``copy_to`` / ``reduce_from`` bracket a column-then-row pair of linears (the input goes in
whole, the partial sums come out reduced). Sequence parallelism replaces them with
``gather_seq`` / ``scatter_seq``: between the pairs the activations (and the norms and
dropout working on them) are split along the sequence, and the all-reduce becomes a
reduce-scatter plus an all-gather of the same bytes. Slices are equal: the size along
``dim`` must divide by the group's size.

Under ``torch.compile`` each of them runs eagerly (a graph break): the collectives are our
engine's calls, which the compiler does not trace; the layers' math between them compiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from shardline.comm.group import ProcessGroup
from shardline.errors import InvalidArgumentError

__all__ = ["copy_to", "gather_from", "gather_seq", "reduce_from", "scatter_seq", "split_to"]

_F = TypeVar("_F", bound=Callable[..., Any])
# Run under torch.compile as a graph break (see the module docstring); typed for mypy.
# torch's _disable_dynamo is torch.compiler.disable applied at the first call: applied at
# import, the latter imports torch._dynamo, which made `import shardline` take 2 s longer.
try:
    from torch._compile import _disable_dynamo as _disable
except ImportError:  # pragma: no cover - a torch without it: disable at once
    _disable = torch.compiler.disable
eager_region = cast(Callable[[_F], _F], _disable)


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    group.all_reduce(out)
    return out


def _slice(x: torch.Tensor, dim: int, group: ProcessGroup, what: str) -> torch.Tensor:
    n, t = x.shape[dim], group.world_size
    if n % t:
        raise InvalidArgumentError(
            f"tensor parallel: {what} splits dim {dim} of size {n} over {t} ranks; it must "
            f"divide evenly (pad it to a multiple of {t}, or use another tp size)"
        )
    return x.narrow(dim, group.rank * (n // t), n // t)


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    t = group.world_size
    x = x.contiguous()
    out = torch.empty((t, *x.shape), dtype=x.dtype, device=x.device)
    group.all_gather(out, x)
    return torch.cat(out.unbind(0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup, what: str) -> torch.Tensor:
    t = group.world_size
    _slice(x, dim, group, what)  # checks the size
    chunks = torch.stack(x.chunk(t, dim=dim))  # rank-major: chunk r goes to rank r
    out = torch.empty_like(chunks[0])
    group.reduce_scatter(out, chunks)
    return out


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _slice(grad, ctx.dim, ctx.group, "gather_from's gradient").contiguous(), None, None


class _SplitTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _slice(x, dim, group, "split_to").contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group, "gather_seq's gradient"), None, None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group, "scatter_seq")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


@eager_region
def copy_to(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Enters a tensor-parallel region with the whole input (gradients all-reduced back)."""
    out: torch.Tensor = _CopyTo.apply(x, group)
    return out


@eager_region
def reduce_from(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Leaves a region by summing the ranks' partial results."""
    out: torch.Tensor = _ReduceFrom.apply(x, group)
    return out


@eager_region
def gather_from(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """Leaves a region by concatenating the ranks' slices along ``dim``."""
    out: torch.Tensor = _GatherFrom.apply(x, group, dim % x.dim())
    return out


@eager_region
def split_to(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """Enters a region with this rank's slice of ``x`` along ``dim``."""
    out: torch.Tensor = _SplitTo.apply(x, group, dim % x.dim())
    return out


@eager_region
def gather_seq(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallel: the whole sequence from the ranks' parts (reduce-scatter back)."""
    out: torch.Tensor = _GatherSeq.apply(x, group, dim % x.dim())
    return out


@eager_region
def scatter_seq(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallel: partial sums reduced, each rank keeping its part of the sequence."""
    out: torch.Tensor = _ScatterSeq.apply(x, group, dim % x.dim())
    return out
