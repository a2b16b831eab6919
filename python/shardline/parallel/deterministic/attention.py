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
memory-efficient kernel (``DeterministicAttention``, a torch function mode that sees every
call, however the model refers to the function), and hooks on the kernel's autograd node turn
torch's deterministic algorithms on for that node's backward alone: before it, and back after
it (a backward that failed inside leaves them on until the next deterministic forward). Where
the node is not found behind the output, the call runs again on the math backend. Inputs that
kernel does not take (``sdpa_kernel`` finds no kernel for them) run on the math backend, as
before. (Earlier, an autograd function ran the kernel on an inner graph and its backward
called ``torch.autograd.grad`` on it: about 180 us of host time per backward on an H200's
host, and a second backward through one forward was refused.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

__all__ = ["DeterministicAttention"]

_SDPA = F.scaled_dot_product_attention


class DeterministicAttention(TorchFunctionMode):
    """Inside it, ``scaled_dot_product_attention`` runs as the module doc says."""

    def __enter__(self) -> DeterministicAttention:
        _restore(every=True)  # left on by a backward that failed inside the kernel's
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

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
        out, efficient = _forward(args, kwargs)
        if not efficient or out.grad_fn is None:
            return out
        node = _kernel_node(out)
        if node is None:  # not found behind what the call did after it: the math backend
            with sdpa_kernel(SDPBackend.MATH):
                return _SDPA(*args, **kwargs)
        node.register_prehook(_fix)  # the kernel's backward under fixed algorithms
        node.register_hook(_unfix)
        return out


def _kernel_node(out: torch.Tensor, depth: int = 4) -> Any:
    """The memory-efficient kernel's autograd node behind ``out``, or ``None``.

    ``out``'s own, or one a few single-input nodes back (a slice that drops the padding of
    a head size the kernel rounds up, say).
    """
    node = out.grad_fn
    for _ in range(depth):
        if node is None:
            return None
        if "EfficientAttention" in node.name():
            return node
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return None


def _forward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, bool]:
    """The memory-efficient kernel's attention, or the math backend's where it has none.

    And whether it is the memory-efficient kernel's.
    """
    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out: torch.Tensor = _SDPA(*args, **kwargs)
            return out, True
    except RuntimeError:  # "No available kernel": shapes, dtypes or masks it does not take
        with sdpa_kernel(SDPBackend.MATH):
            out = _SDPA(*args, **kwargs)
        return out, False


# The deterministic-algorithms setting as each running attention backward found it (the
# autograd node's pre-hook turns it on, its hook restores it).
_SAVED: list[tuple[bool, bool]] = []


def _fix(grad_outputs: Any) -> None:
    """Before the kernel's backward: torch's deterministic algorithms on (no atomics)."""
    on = torch.are_deterministic_algorithms_enabled()
    _SAVED.append((on, torch.is_deterministic_algorithms_warn_only_enabled()))
    if not on:
        torch.use_deterministic_algorithms(True)


def _unfix(grad_inputs: Any, grad_outputs: Any) -> None:
    """After it: the setting as it was."""
    _restore()


def _restore(*, every: bool = False) -> None:
    while _SAVED:
        on, warn_only = _SAVED.pop()
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
        if not every:
            return
