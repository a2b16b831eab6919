"""Backward in two passes, for zero-bubble schedules: to the stage's inputs now, weights later.

The input pass (``I``) runs autograd from the stage's outputs to its inputs only, so the next
stage back gets its gradients as early as it can. On the way it records, at each *weight node*
(a node on the path to an input that also leads to parameters: a matmul, a bias add, a norm),
the gradient that arrived there. The weight pass (``W``) then starts from those nodes with the
recorded gradients and computes only the parameters' gradients: nothing before the weight
nodes is computed twice. Parameters whose nodes the input pass never reached (no path from
the outputs through the inputs' ancestors) get a plain backward to them in ``W``.

The graph is kept between the passes (the input pass retains it) and freed with the outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["InputPass", "accumulate", "input_pass", "weight_nodes", "weight_pass"]


@dataclass
class InputPass:
    """What the weight pass needs: each weight node's recorded gradients and parameters."""

    nodes: list[tuple[Node, list[torch.Tensor]]] = field(default_factory=list)
    grads: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    rest: list[torch.Tensor] = field(default_factory=list)  # parameters no node reached


def weight_nodes(
    roots: Sequence[Node], inps: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> tuple[list[tuple[Node, list[torch.Tensor]]], list[torch.Tensor]]:
    """Weight nodes under ``roots``, and the parameters under none.

    A weight node is on the path to one of ``inps`` and has children off it that lead to
    parameters; each comes with those parameters.
    """
    ids = {id(p): p for p in params}
    inp_ids = {id(x) for x in inps}
    order: list[Node] = []  # post-order: every node after all of its children
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False) for root in reversed(roots)]
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
    # Parameters under each node off the input's path (those on it lead to every parameter
    # below them: that union is never needed, and merging it per node would cost nodes x
    # parameters). A node off the path has only children off it.
    leaves: dict[int, list[torch.Tensor]] = {}
    for node in order:  # children first
        var = getattr(node, "variable", None)
        children = [c for c, _ in node.next_functions if c is not None]
        here = (var is not None and id(var) in inp_ids) or any(to_input[id(c)] for c in children)
        to_input[id(node)] = here
        if not here:
            found = [ids[id(var)]] if var is not None and id(var) in ids else []
            for child in children:
                found += leaves[id(child)]
            leaves[id(node)] = list({id(p): p for p in found}.values()) if len(found) > 1 else found
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
    outs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inps: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], InputPass]:
    """The gradients of ``inps``, and what ``weight_pass`` needs to finish the backward.

    The backward starts from ``outs`` seeded with ``grads``; an input that did not matter gets
    zeros.
    """
    state = InputPass()
    roots = [o.grad_fn for o in outs if o.grad_fn is not None]
    if roots:
        state.nodes, state.rest = weight_nodes(roots, inps, params)
    else:
        state.rest = list(params)
    handles = []
    for node, _ in state.nodes:

        def record(grad_outputs: tuple[Any, ...], node: Node = node) -> None:
            state.grads[id(node)] = grad_outputs

        handles.append(node.register_prehook(record))
    found: Sequence[torch.Tensor | None] = [None] * len(inps)
    try:
        if outs and inps:  # outs need a gradient; some may be inputs passed through
            found = torch.autograd.grad(
                list(outs), list(inps), list(grads), retain_graph=True, allow_unused=True
            )
    finally:
        for h in handles:
            h.remove()
    return [
        torch.zeros_like(x) if g is None else g for x, g in zip(inps, found, strict=True)
    ], state


def weight_pass(
    outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], state: InputPass
) -> None:
    """Accumulates the parameters' gradients from the recorded weight nodes."""
    pending: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]] = []
    missed: list[torch.Tensor] = list(state.rest)
    for node, params in state.nodes:
        recorded = state.grads.get(id(node))
        if recorded is None:  # the input pass did not run through it
            missed += params
            continue
        direct = _linear_grads(node, recorded, params) or _norm_grads(node, recorded, params)
        if direct is not None:  # a linear layer's or a norm's weight and bias: no graph walk
            accumulate(*direct, fresh=True)
            continue
        edges = [GradientEdge(node, k) for k, g in enumerate(recorded) if g is not None]
        seeds = [g for g in recorded if g is not None]
        if edges:
            pending.append((edges, seeds, params))
    for edges, seeds, params in pending:
        found = torch.autograd.grad(edges, params, seeds, retain_graph=True, allow_unused=True)
        accumulate(params, found)
    missed = list({id(p): p for p in missed}.values())
    live = [(o, g) for o, g in zip(outs, grads, strict=True) if o.grad_fn is not None]
    if missed and live:
        found = torch.autograd.grad(
            [o for o, _ in live], missed, [g for _, g in live], retain_graph=True,
            allow_unused=True,
        )  # fmt: skip
        accumulate(missed, found)


def _linear_grads(
    node: Node, recorded: tuple[Any, ...], params: list[torch.Tensor]
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]] | None:
    """A linear layer's parameter gradients computed directly, or None for any other node.

    ``F.linear`` records ``addmm(bias, x, weight.t())`` (``mm(x, weight.t())`` without a
    bias): with the gradient ``g`` of its output, the weight's is ``g.T @ x`` and the bias's
    ``g.sum(0)``, what its backward node computes for them. Anything else (a cast in between
    under autocast, scaled terms, other parents) takes the general path.
    """
    kind = type(node).__name__
    if kind not in ("AddmmBackward0", "MmBackward0") or len(recorded) != 1:
        return None
    n = node  # type: Any
    if recorded[0] is None or (
        kind == "AddmmBackward0" and (n._saved_alpha, n._saved_beta) != (1, 1)
    ):
        return None
    edges = node.next_functions
    bias_edge, weight_edge = (
        (edges[0], edges[2]) if kind == "AddmmBackward0" else ((None, 0), edges[1])
    )
    if weight_edge[0] is None or type(weight_edge[0]).__name__ != "TBackward0":
        return None
    ((acc, _),) = weight_edge[0].next_functions
    weight = getattr(acc, "variable", None)
    bias = getattr(bias_edge[0], "variable", None) if bias_edge[0] is not None else None
    if weight is None or (bias_edge[0] is not None and bias is None):
        return None
    owned = [weight] + ([bias] if bias is not None else [])
    if {id(p) for p in owned} != {id(p) for p in params}:
        return None
    g = recorded[0]
    x = n._saved_mat1 if kind == "AddmmBackward0" else n._saved_self
    return owned, (g.t() @ x,) + ((g.sum(0),) if bias is not None else ())


def _norm_grads(
    node: Node, recorded: tuple[Any, ...], params: list[torch.Tensor]
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]] | None:
    """A layer norm's weight and bias gradients from its saved statistics, or None.

    The node's own kernel, asked for those two outputs only (the input's gradient was the
    input pass's).
    """
    if type(node).__name__ != "NativeLayerNormBackward0" or len(recorded) != 1:
        return None
    if recorded[0] is None:
        return None
    _, (w_acc, _), (b_acc, _) = node.next_functions
    weight = getattr(w_acc, "variable", None) if w_acc is not None else None
    bias = getattr(b_acc, "variable", None) if b_acc is not None else None
    if (w_acc is not None and weight is None) or (b_acc is not None and bias is None):
        return None  # a weight computed from parameters, not one itself
    owned = [t for t in (weight, bias) if t is not None]
    if not owned or {id(p) for p in owned} != {id(p) for p in params}:
        return None
    n = node  # type: Any
    _, gw, gb = torch.ops.aten.native_layer_norm_backward(
        recorded[0], n._saved_input, n._saved_normalized_shape, n._saved_result1,
        n._saved_result2, n._saved_weight, n._saved_bias,
        [False, weight is not None, bias is not None],
    )  # fmt: skip
    grads = tuple(g for g, t in ((gw, weight), (gb, bias)) if t is not None)
    return owned, grads


def accumulate(
    params: list[torch.Tensor], grads: tuple[torch.Tensor | None, ...], fresh: bool = False
) -> None:
    """Adds ``grads`` into the parameters' ``.grad``, as autograd's accumulation does.

    ``fresh``: each gradient is a new tensor of its own (computed here), so a parameter
    without a ``.grad`` takes it as it is, as autograd takes a gradient it made; others (from
    ``autograd.grad``, which may hand back a seed or a view of one) are copied first.
    """
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                own = fresh and g.is_contiguous() and (g.dtype, g.shape) == (p.dtype, p.shape)
                p.grad = g.detach() if own else g.detach().clone()
            else:
                p.grad += g
