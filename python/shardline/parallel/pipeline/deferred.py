"""Weight gradients put off by the layers that own them, for zero-bubble's weight pass.

Zero-bubble splits a stage's backward in two: the input pass (``I``) to the stage's inputs
now, the weight pass (``W``) later. ``split_backward`` does that for any stage by walking the
autograd graph of each micro-batch and recording the gradient at each weight node. A stage
whose parameters all belong to ``nn.Linear`` and ``nn.LayerNorm`` layers (a transformer's
blocks, the usual case) needs no walk, as in Megatron's zero-bubble layers with their
weight-gradient store. While it runs deferred (``forwarding(store)``), each linear layer
notes its input and where its output enters the graph (``install`` gives it that forward).
The input pass (``WeightStore.input_pass``) then asks autograd, in the one call that
computes the inputs' gradients, for the gradient of each noted output and of the layer
norms' parameters (their backward kernel computes the input's anyway), and frees the graph.
``run`` computes ``g.T @ x`` and ``g.sum(0)`` for each linear layer, in the dtype it computed
in (autocast's), and adds every gradient to ``.grad``: the same kernels on the same operands
as autograd's one backward (tested bit for bit, with and without autocast).

Nothing changes outside ``forwarding``. A stage with any other parameter keeps
``split_backward``, and so does recomputation (its forward reruns inside the backward).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from shardline.errors import InvalidArgumentError
from shardline.parallel.pipeline.split_backward import accumulate, weight_nodes

__all__ = ["WeightStore", "deferrable", "forwarding", "install", "kept_bytes"]

_state = threading.local()  # per thread: the ranks of a test may be threads of one process


class WeightStore:
    """One micro-batch's deferred weight gradients: noted in forward, added in ``run``.

    Args:
        norms: The stage's layer norms' parameters (``install``'s answer): their gradients
            come with the input pass, from the kernel that computes the input's anyway.
    """

    def __init__(self, norms: Sequence[torch.Tensor] = ()) -> None:
        self._norms = list(norms)
        # (linear layer, its input and the input's version, where its output enters the graph)
        self._noted: list[tuple[nn.Linear, torch.Tensor, int, GradientEdge]] = []
        self._grads: list[tuple[nn.Linear, torch.Tensor, int, torch.Tensor]] = []
        self._ready: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, gradient)

    def covers(
        self,
        roots: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
    ) -> bool:
        """Whether what the layers noted is every way the stage's linear weights were used.

        One walk of the graph (``split_backward``'s): each weight node that leads to a
        linear layer's parameters must be that layer's own matrix product, as many times as
        the layer noted itself. A weight used some other way too (``x @ layer.weight.T`` in
        a custom forward) would lose that part of its gradient: the caller then walks the
        graph instead. The layer norms' gradients come whole from the input pass.
        """
        calls = Counter(id(layer) for layer, *_ in self._noted)
        owner = {id(p): layer for layer, *_ in self._noted for p in layer.parameters(recurse=False)}
        norms = {id(p) for p in self._norms}
        found: Counter[int] = Counter()
        nodes, _ = weight_nodes([r.grad_fn for r in roots if r.grad_fn is not None], inputs, params)
        for node, ps in nodes:
            rest = [p for p in ps if id(p) not in norms]  # the input pass asks for the norms'
            if not rest:
                continue
            # A parameter of no noted layer (a linear layer never called, its weight used
            # directly) would get no gradient at all.
            if any(id(p) not in owner for p in rest):
                return False
            layers = {id(owner[id(p)]) for p in rest}
            if len(layers) > 1 or type(node).__name__ not in ("AddmmBackward0", "MmBackward0"):
                return False
            found[layers.pop()] += 1
        linear_params = [p for p in params if id(p) in owner]
        reached = {id(p) for _, ps in nodes for p in ps}
        return found == calls and all(id(p) in reached for p in linear_params)

    def input_pass(
        self,
        roots: Sequence[torch.Tensor],
        seeds: Sequence[torch.Tensor | None],
        inputs: Sequence[torch.Tensor],
    ) -> list[torch.Tensor | None]:
        """The gradients of ``inputs`` from ``roots`` (seeded); keeps what ``run`` needs.

        Frees the graph: the weight pass needs only what this keeps.
        """
        edges = [edge for *_, edge in self._noted]
        wanted: Any = [*inputs, *edges, *self._norms]  # tensors and edges: autograd takes both
        if not wanted:
            return []
        found = torch.autograd.grad(list(roots), wanted, list(seeds), allow_unused=True)
        n, k = len(inputs), len(inputs) + len(edges)
        self._grads = [
            (layer, x, version, g)
            for (layer, x, version, _), g in zip(self._noted, found[n:k], strict=True)
            if g is not None  # a layer whose output did not reach the roots
        ]
        self._ready = [(p, g) for p, g in zip(self._norms, found[k:], strict=True) if g is not None]
        self._noted = []
        return list(found[:n])

    def run(self) -> None:
        """Computes the linear layers' weight gradients; adds every kept one into ``.grad``."""
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        with torch.no_grad():
            for layer, x, version, g in self._grads:
                if x._version != version:
                    raise InvalidArgumentError(
                        "zero-bubble: the input of an nn.Linear was modified in place after "
                        "its forward; the weight pass needs it as it was. Leave layers' "
                        "inputs unmodified, or use schedule='1f1b'"
                    )
                # In the dtype the layer computed in (autocast's cast of its input, if any).
                g2 = g.reshape(-1, g.shape[-1])
                x2 = x.reshape(-1, x.shape[-1]).to(g.dtype)
                params.append(layer.weight)
                grads.append(g2.t() @ x2)
                if layer.bias is not None:
                    params.append(layer.bias)
                    grads.append(g2.sum(0))
            params += [p for p, _ in self._ready]
            grads += [g for _, g in self._ready]
            # Each a tensor of its own (autograd's output for the norms): taken as it is.
            accumulate(params, tuple(g.to(p.dtype) for p, g in zip(params, grads, strict=True)),
                       fresh=True)  # fmt: skip
        self._grads, self._ready = [], []


@contextlib.contextmanager
def forwarding(store: WeightStore | None) -> Iterator[None]:
    """Around a stage's forward: its installed layers note themselves in ``store``."""
    before = getattr(_state, "store", None)
    _state.store = store
    try:
        yield
    finally:
        _state.store = before


def _note(layer: nn.Linear, x: torch.Tensor, out: torch.Tensor) -> None:
    store: WeightStore | None = getattr(_state, "store", None)
    if store is not None and out.requires_grad:
        # The edge now: an in-place op on the output later would move its grad_fn.
        store._noted.append((layer, x, x._version, get_gradient_edge(out)))


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = F.linear(x, self.weight, self.bias)
    _note(self, x, out)
    return out


def _layers(stage: nn.Module) -> tuple[list[nn.Linear], list[nn.Parameter]]:
    """``stage``'s linear layers and its layer norms' parameters.

    Exactly those classes: a subclass's forward could differ.
    """
    linears = [m for m in stage.modules() if type(m) is nn.Linear]
    norms = [p for m in stage.modules() if type(m) is nn.LayerNorm for p in m.parameters()]
    return linears, norms


def deferrable(stage: nn.Module) -> bool:
    """Whether ``install`` applies to ``stage``.

    It does when every trainable parameter of ``stage`` belongs to an ``nn.Linear`` or an
    ``nn.LayerNorm`` and it has a linear layer.
    """
    linears, norms = _layers(stage)
    covered = {id(p) for m in linears for p in m.parameters()} | {id(p) for p in norms}
    trained = [p for p in stage.parameters() if p.requires_grad]
    return bool(linears) and all(id(p) in covered for p in trained)


def install(stage: nn.Module) -> list[torch.Tensor] | None:
    """Lets ``stage``'s linear layers note themselves for a deferred weight pass.

    Where ``deferrable(stage)``: the answer is then the layer norms' parameters (for
    ``WeightStore``); else ``None`` and nothing changes. Outside ``forwarding`` the linear
    layers compute what they did.
    """
    if not deferrable(stage):
        return None
    linears, norms = _layers(stage)
    for m in linears:
        m.forward = types.MethodType(_linear_forward, m)  # type: ignore[method-assign]
    return list({id(p): p for p in norms if p.requires_grad}.values())


def kept_bytes(stage: nn.Module, x: Any, dtype: torch.dtype | None = None) -> int:
    """Bytes one micro-batch of ``stage`` keeps from its input pass to its weight pass.

    Each linear layer's input (as it comes in) and the gradient of its output (in
    ``dtype``, the compute dtype, when given); ``x`` the stage's input (on the meta device
    for pricing). A tensor that feeds several layers counts once.
    """
    inputs: dict[int, int] = {}
    held: list[torch.Tensor] = []  # the inputs stay alive, so that no id is reused
    outputs = 0

    def seen(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        nonlocal outputs
        inp = args[0]
        held.append(inp)
        inputs[id(inp)] = inp.numel() * inp.element_size()
        size = dtype.itemsize if dtype is not None else out.element_size()
        outputs += out.numel() * size

    handles = [m.register_forward_hook(seen) for m in _layers(stage)[0]]
    try:
        with torch.no_grad():
            stage(x)
    finally:
        for h in handles:
            h.remove()
    return sum(inputs.values()) + outputs
