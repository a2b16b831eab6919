"""Weight gradients put off by the layers that own them, for zero-bubble's weight pass.

Zero-bubble splits a stage's backward in two: the input pass (``I``) to the stage's inputs
now, the weight pass (``W``) later. ``split_backward`` does that for any stage by walking the
autograd graph of each micro-batch and recording the gradient at each weight node. A stage
whose parameters all belong to ``nn.Linear`` and ``nn.LayerNorm`` layers (a transformer's
blocks, the usual case) needs no walk: while it runs deferred (``forwarding(store)``), each such
layer notes its input and where its output enters the graph (``install`` gives it that
forward). The input pass (``WeightStore.input_pass``) then asks autograd, in the one call
that computes the inputs' gradients, for the gradient of each noted output too, and frees the
graph: what the weight pass needs is those gradients and the noted inputs. ``run`` computes
``g.T @ x`` and ``g.sum(0)`` (a layer norm's from its own backward kernel, its statistics
recomputed from the input) and adds them to ``.grad``: the same kernels on the same operands
as autograd's one backward (tested bit for bit).

Nothing changes outside ``forwarding``, and a stage with any other parameter keeps
``split_backward``; so do autocast (the layers' inputs are cast inside them) and
recomputation (the forward reruns inside the backward).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["WeightStore", "forwarding", "install"]

_state = threading.local()  # per thread: the ranks of a test may be threads of one process


class WeightStore:
    """One micro-batch's deferred layers: noted in forward, their weights' gradients in ``run``."""

    def __init__(self) -> None:
        # (layer, its input and the input's version, where its output enters the graph)
        self._noted: list[tuple[nn.Module, torch.Tensor, int, GradientEdge]] = []
        self._grads: list[tuple[nn.Module, torch.Tensor, int, torch.Tensor]] = []

    def input_pass(
        self,
        roots: Sequence[torch.Tensor],
        seeds: Sequence[torch.Tensor | None],
        inputs: Sequence[torch.Tensor],
    ) -> list[torch.Tensor | None]:
        """The gradients of ``inputs`` from ``roots`` (seeded); keeps the noted layers'.

        Frees the graph: the weight pass needs only what this keeps.
        """
        edges = [edge for *_, edge in self._noted]
        if not inputs and not edges:
            return []
        wanted: Any = [*inputs, *edges]  # tensors and edges: autograd takes both
        found = torch.autograd.grad(list(roots), wanted, list(seeds), allow_unused=True)
        self._grads = [
            (layer, x, version, g)
            for (layer, x, version, _), g in zip(self._noted, found[len(inputs) :], strict=True)
            if g is not None  # a layer whose output did not reach the roots
        ]
        self._noted = []
        return list(found[: len(inputs)])

    def run(self) -> None:
        """Computes the noted layers' weight gradients and adds them into ``.grad``."""
        with torch.no_grad():
            for layer, x, version, g in self._grads:
                if x._version != version:
                    raise RuntimeError(
                        f"zero-bubble: the input of a {type(layer).__name__} was modified in "
                        "place after its forward; the weight pass needs it as it was. Leave "
                        "layers' inputs unmodified, or use schedule='1f1b'"
                    )
                if isinstance(layer, nn.Linear):
                    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
                    _add(layer.weight, g2.t() @ x2)
                    if layer.bias is not None:
                        _add(layer.bias, g2.sum(0))
                    continue
                assert isinstance(layer, nn.LayerNorm)
                weight, bias, shape = layer.weight, layer.bias, list(layer.normalized_shape)
                _, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, layer.eps)
                _, gw, gb = torch.ops.aten.native_layer_norm_backward(
                    g, x, shape, mean, rstd, weight, bias,
                    [False, weight is not None, bias is not None],
                )  # fmt: skip
                if weight is not None:
                    _add(weight, gw)
                if bias is not None:
                    _add(bias, gb)
        self._grads = []


@contextlib.contextmanager
def forwarding(store: WeightStore | None) -> Iterator[None]:
    """Around a stage's forward: its installed layers note themselves in ``store``."""
    before = getattr(_state, "store", None)
    _state.store = store
    try:
        yield
    finally:
        _state.store = before


def _note(layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
    store: WeightStore | None = getattr(_state, "store", None)
    if store is not None and out.requires_grad:
        # The edge now: an in-place op on the output later would move its grad_fn.
        store._noted.append((layer, x, x._version, get_gradient_edge(out)))


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = F.linear(x, self.weight, self.bias)
    _note(self, x, out)
    return out


def _norm_forward(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    out = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
    _note(self, x, out)
    return out


def _add(p: torch.Tensor, g: torch.Tensor) -> None:
    """``p.grad += g`` as autograd accumulates (a fresh tensor of its own is taken as is)."""
    if p.grad is None:
        p.grad = g if g.is_contiguous() and g.dtype == p.dtype else g.contiguous().to(p.dtype)
    else:
        p.grad += g


def install(stage: nn.Module) -> bool:
    """Lets ``stage``'s layers note themselves for a deferred weight pass; whether it could.

    Only when every trainable parameter of ``stage`` is a weight or bias of an ``nn.Linear``
    or ``nn.LayerNorm`` (exactly those classes: a subclass's forward could differ); otherwise
    nothing changes. Outside ``forwarding`` their forwards compute what they did.
    """
    layers = [m for m in stage.modules() if type(m) in (nn.Linear, nn.LayerNorm)]
    covered = {id(p) for m in layers for p in m.parameters(recurse=False)}
    if not layers or any(p.requires_grad and id(p) not in covered for p in stage.parameters()):
        return False
    for m in layers:
        forward: Any = _linear_forward if type(m) is nn.Linear else _norm_forward
        m.forward = types.MethodType(forward, m)
    return True
