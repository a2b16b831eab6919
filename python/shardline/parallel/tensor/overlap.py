"""The shared input's gradient all-reduce, overlapped with the weight gradients.

Column layers that share one input (q, k and v; gate and up) take it through one
``copy_to`` (the ``"shared_input"`` style), whose backward all-reduces the summed input
gradient once. In autograd's order that all-reduce can only start after every layer's
backward, weight gradients included, so nothing overlaps it. Here each such layer's backward
computes only its input gradient and leaves ``(grad_output, input)`` for later; the shared
copy's backward starts the all-reduce, computes the weight and bias gradients it was left
(GEMMs that do not need the reduced gradient) and only then waits. The weights are inputs of
the shared copy, so their gradients still arrive through autograd (``AccumulateGrad``, and
every hook DDP or ZeRO put there).

A layer defers only when the call is plain: gradients on, no autocast, the same weight and
bias objects the hook saw, no other weight transform (a transposed ``Conv1D``, a slice
shared by several ranks, sequence parallelism): otherwise it runs as before and its
gradients take autograd's usual path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardline.comm.group import ProcessGroup
from shardline.parallel.tensor.regions import eager_region

__all__ = ["SharedInputCall", "deferred_linear", "shared_copy"]


class SharedInputCall:
    """One forward call of a module whose column layers share an input.

    ``params`` lists each layer's weight and bias (``None`` without one) as the hook saw them;
    ``saved[i]`` is what layer ``i``'s backward left for the shared copy's.
    """

    __slots__ = ("params", "saved")

    def __init__(self, params: Sequence[torch.Tensor | None]) -> None:
        self.params = list(params)
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}

    def holds(self, index: int, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether layer ``index`` still has the weight and bias the shared copy was given."""
        return self.params[2 * index] is weight and self.params[2 * index + 1] is bias


class _SharedCopy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup, deferred: SharedInputCall, *params: Any
    ) -> torch.Tensor:
        ctx.group, ctx.deferred = group, deferred
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        deferred: SharedInputCall = ctx.deferred
        out = grad.clone(memory_format=torch.contiguous_format)
        work = ctx.group.all_reduce(out, async_op=True)
        grads: list[torch.Tensor | None] = []
        for i in range(len(deferred.params) // 2):
            got = deferred.saved.pop(i, None)
            if got is None:  # the layer did not run (or did not defer) in this call
                grads += [None, None]
                continue
            g, x, has_bias = got
            g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            grads.append(g2.t().mm(x2))
            grads.append(g2.sum(0) if has_bias else None)
        work.wait()
        return (out, None, None, *grads)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        deferred: SharedInputCall,
        index: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.deferred, ctx.index, ctx.has_bias = deferred, index, b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        ctx.deferred.saved[ctx.index] = (g, x, ctx.has_bias)
        return g.matmul(w), None, None, None, None


@eager_region
def shared_copy(x: torch.Tensor, group: ProcessGroup, deferred: SharedInputCall) -> torch.Tensor:
    """``copy_to`` for a shared input whose layers defer their weight gradients to it."""
    out: torch.Tensor = _SharedCopy.apply(x, group, deferred, *deferred.params)
    return out


@eager_region
def deferred_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    deferred: SharedInputCall,
    index: int,
) -> torch.Tensor:
    """``F.linear`` whose backward leaves the weight gradient to ``shared_copy``'s."""
    out: torch.Tensor = _DeferredLinear.apply(x, w, b, deferred, index)
    return out


def plain_call(x: torch.Tensor) -> bool:
    """Whether a forward may defer: gradients on, and no autocast on ``x``'s device."""
    return torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type)
