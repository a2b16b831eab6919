"""Attention on a GPU in deterministic mode: the memory-efficient kernel, its backward made fixed.

``scaled_dot_product_attention`` has three fused GPU backends and the math one (batched
products and a row-wise softmax). On an H200 (bf16, 16 x 16 heads x 512 x 64, causal; a probe
of each backend on 16 samples against their first 8, 4, 2 and 1, and a repeat; the
memory-efficient rows of ``benches/gpu_batch_invariance.py`` check the same):

- flash attention's gradients depend on the batch and change from run to run;
- the memory-efficient kernel's depend on neither the batch nor the run once torch's
  deterministic algorithms are on (its backward then adds without atomics), in fp32 and
  bf16; without them they change from run to run (and in fp32 with the batch too);
- the math backend's depend on neither, and its forward and backward took 3.0 ms where the
  memory-efficient one's took 0.6 ms (it multiplies in float32 and keeps the scores).

So a deterministic forward on a GPU runs each ``scaled_dot_product_attention`` on the
memory-efficient kernel, in an autograd function whose backward turns torch's deterministic
algorithms on around the kernel's backward (``DeterministicAttention``, a torch function mode
that sees every call, however the model refers to the function). Inputs that kernel does not
take (``sdpa_kernel`` finds no kernel for them) run on the math backend, as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from shardline.errors import InvalidArgumentError
from shardline.parallel.deterministic import kernels

__all__ = ["DeterministicAttention"]

_SDPA = F.scaled_dot_product_attention


class DeterministicAttention(TorchFunctionMode):
    """Inside it, ``scaled_dot_product_attention`` runs as the module doc says."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return _Attention.apply(kwargs, *args)
        return _forward(args, kwargs)  # no backward: the kernel's forward depends on neither


def _forward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The memory-efficient kernel's attention, or the math backend's where it has none."""
    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out: torch.Tensor = _SDPA(*args, **kwargs)
    except RuntimeError:  # "No available kernel": shapes, dtypes or masks it does not take
        with sdpa_kernel(SDPBackend.MATH):
            out = _SDPA(*args, **kwargs)
    return out


class _Attention(torch.autograd.Function):
    """The attention of ``_forward`` on a graph of its own; backward under fixed algorithms."""

    @staticmethod
    def forward(ctx: Any, kwargs: dict[str, Any], *args: Any) -> torch.Tensor:
        # The inputs as leaves of an inner graph, whose backward is run by this one's.
        leaves = [
            a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
            for a in args
        ]
        with torch.enable_grad():
            out = _forward(tuple(leaves), kwargs)
        ctx.leaves, ctx.out = leaves, out
        return out.detach()

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.out is None:
            raise InvalidArgumentError(
                "deterministic mode on a GPU: a second backward through one forward's "
                "attention (retain_graph=True) is not supported, as its inner graph is freed "
                "by the first; run the forward again for each backward"
            )
        leaves, out = ctx.leaves, ctx.out
        ctx.leaves = ctx.out = None  # the inner graph is freed by this backward, as torch's
        wanted = [
            i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor) and a.requires_grad
        ]
        with kernels.algorithms():  # the kernel's backward without atomics
            grads = torch.autograd.grad(out, [leaves[i] for i in wanted], dout)
        by_index = dict(zip(wanted, grads, strict=True))
        return (None, *(by_index.get(i) for i in range(len(leaves))))
