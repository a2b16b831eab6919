"""Backward in two passes, for zero-bubble schedules: to the stage's input now, weights later.

The input pass (``I``) runs autograd from the stage's output to its input only, so the next
stage back gets its gradient as early as it can. On the way it records, at each *weight node*
(a node on the path to the input that also leads to parameters: a matmul, a bias add, a norm),
the gradient that arrived there. The weight pass (``W``) then starts from those nodes with the
recorded gradients and computes only the parameters' gradients: nothing before the weight
nodes is computed twice. Parameters whose nodes the input pass never reached (no path from
the output through the input's ancestors) get a plain backward to them in ``W``.

The graph is kept between the passes (the input pass retains it) and freed with the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["InputPass", "input_pass", "weight_pass"]


@dataclass
class InputPass:
    """What the weight pass needs: each weight node's recorded gradients and parameters."""

    nodes: list[tuple[Node, list[torch.Tensor]]] = field(default_factory=list)
    grads: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    rest: list[torch.Tensor] = field(default_factory=list)  # parameters no node reached


def _graph(
    root: Node, inp: torch.Tensor, params: Sequence[torch.Tensor]
) -> tuple[list[tuple[Node, list[torch.Tensor]]], list[torch.Tensor]]:
    """Weight nodes under ``root``, and the parameters under none.

    A weight node is on the path to ``inp`` and has children off it that lead to parameters;
    each comes with those parameters.
    """
    ids = {id(p): p for p in params}
    order: list[Node] = []  # post-order: every node after all of its children
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:  # iterative: graphs of deep stages would overflow Python's recursion
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c, _ in node.next_functions if c is not None)
    to_input: dict[int, bool] = {}
    leaves: dict[int, list[torch.Tensor]] = {}  # node -> parameters reachable from it
    for node in order:  # children first
        var = getattr(node, "variable", None)
        here = var is inp
        found = [ids[id(var)]] if var is not None and id(var) in ids else []
        for child, _ in node.next_functions:
            if child is None:
                continue
            here = here or to_input.get(id(child), False)
            found += leaves.get(id(child), [])
        to_input[id(node)] = here
        leaves[id(node)] = list({id(p): p for p in found}.values())
    nodes, covered = [], set()
    for node in order:
        if not to_input[id(node)]:
            continue
        off_path = [
            p
            for child, _ in node.next_functions
            if child is not None and not to_input.get(id(child), False)
            for p in leaves.get(id(child), [])
        ]
        if off_path:
            uniq = list({id(p): p for p in off_path}.values())
            nodes.append((node, uniq))
            covered |= {id(p) for p in uniq}
    return nodes, [p for p in params if id(p) not in covered]


def input_pass(
    out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor, params: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, InputPass]:
    """The gradient of ``inp``, and what ``weight_pass`` needs to finish the backward."""
    state = InputPass()
    if out.grad_fn is not None:
        state.nodes, state.rest = _graph(out.grad_fn, inp, params)
    handles = []
    for node, _ in state.nodes:

        def record(grad_outputs: tuple[Any, ...], node: Node = node) -> None:
            state.grads[id(node)] = grad_outputs

        handles.append(node.register_prehook(record))
    try:
        (g,) = torch.autograd.grad(out, [inp], grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return g, state


def weight_pass(out: torch.Tensor, grad: torch.Tensor | None, state: InputPass) -> None:
    """Accumulates the parameters' gradients from the recorded weight nodes."""
    pending: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]] = []
    missed: list[torch.Tensor] = list(state.rest)
    for node, params in state.nodes:
        recorded = state.grads.get(id(node))
        if recorded is None:  # the input pass did not run through it
            missed += params
            continue
        edges = [GradientEdge(node, k) for k, g in enumerate(recorded) if g is not None]
        grads = [g for g in recorded if g is not None]
        if edges:
            pending.append((edges, grads, params))
    for edges, grads, params in pending:
        found = torch.autograd.grad(edges, params, grads, retain_graph=True, allow_unused=True)
        _accumulate(params, found)
    missed = list({id(p): p for p in missed}.values())
    if missed and out.grad_fn is not None:
        found = torch.autograd.grad(out, missed, grad, retain_graph=True, allow_unused=True)
        _accumulate(missed, found)


def _accumulate(params: list[torch.Tensor], grads: tuple[torch.Tensor | None, ...]) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.detach().clone()
            else:
                p.grad += g
