"""Splitting a model into contiguous pipeline stages.

A model whose forward is a chain of its children, ``nn.Sequential``, is cut between children:
balanced (``split="auto"``) or where the caller names the first child of each stage after the
first. Balanced means by compute when an example micro-batch is given (each child's forward
FLOPs on it, counted by ``torch.utils.flop_counter``: a vocabulary head weighs what it
computes, an embedding little), else by parameter count. Stage ``s`` of ``S`` holds the
children of its part under their original names, so a stage's ``named_parameters()`` are
the whole model's names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardline.errors import InvalidArgumentError

__all__ = ["balanced_parts", "chain_children", "child_costs", "keep_only", "named_parts"]


def child_costs(children: list[tuple[str, nn.Module]], example: Any = None) -> list[int]:
    """What each child costs: forward FLOPs on ``example`` plus parameters, or parameters.

    With no example, the cost is the parameter count. The FLOPs are counted from shapes, the
    same on every rank (no timing, no agreement needed). The parameter term stands for the
    work per weight that FLOPs miss (reading it, writing its gradient) and decides between
    children that compute nothing.
    """
    sizes = [sum(p.numel() for p in child.parameters()) for _, child in children]
    if example is None:
        return sizes
    first = next((p for _, c in children for p in c.parameters()), None)
    x = example
    if first is not None and first.is_meta and isinstance(x, torch.Tensor):
        x = x.to("meta")  # a model built on the meta device: shapes are all it needs
    # Imported here: it imports triton where installed, a quarter second at every import.
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415

    flops = []
    with torch.no_grad():
        for _, child in children:
            with FlopCounterMode(display=False) as counter:
                x = child(x)
            flops.append(counter.get_total_flops())
    return [f + n for f, n in zip(flops, sizes, strict=True)]


def balanced_parts(
    children: list[tuple[str, nn.Module]], stages: int, costs: Sequence[int] | None = None
) -> list[list[str]]:
    """Cuts ``children`` into ``stages`` contiguous, non-empty parts, balanced.

    The largest part's cost (``costs``, one per child; parameter counts if None) is as small
    as it can be (a linear-partition DP; ties go to earlier cuts).
    """
    n = len(children)
    if stages > n:
        raise InvalidArgumentError(
            f"the model has {n} children to split but the pipeline has {stages} stages; use "
            f"at most {n} stages (ranks x virtual_stages), or a model with more layers"
        )
    sizes = list(costs) if costs is not None else child_costs(children)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][j]: the smallest largest-part over the first j children in k parts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    bounds, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        bounds.append((i, j))
        j = i
    return [[children[x][0] for x in range(i, j)] for i, j in reversed(bounds)]


def named_parts(
    children: list[tuple[str, nn.Module]], starts: Sequence[str], stages: int
) -> list[list[str]]:
    """Cuts ``children`` before each child named in ``starts``.

    ``starts`` holds ``stages - 1`` names, in order: the first stage runs up to the first.
    """
    names = [name for name, _ in children]
    if len(starts) != stages - 1:
        raise InvalidArgumentError(
            f"split={list(starts)} names {len(starts)} points but {stages} stages need "
            f"{stages - 1}: name the first child of every stage after the first"
        )
    at = []
    for name in starts:
        if name not in names:
            raise InvalidArgumentError(
                f"split point {name!r} is not a child of the model; its children are "
                f"{names[:12]}{' ...' if len(names) > 12 else ''}"
            )
        at.append(names.index(name))
    if any(b <= a for a, b in zip([0, *at], at, strict=False)) or at[:1] == [0]:
        raise InvalidArgumentError(
            f"split={list(starts)}: the points must be distinct children in model order, "
            "after the first child, so that no stage is empty"
        )
    edges = [0, *at, len(names)]
    return [names[edges[k] : edges[k + 1]] for k in range(stages)]


def chain_children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of a model whose forward chains them in order (``nn.Sequential``).

    Raises:
        InvalidArgumentError: the model is not an ``nn.Sequential`` (other models are split
            by tracing: ``pipeline.trace``).
    """
    if not isinstance(model, nn.Sequential):
        raise InvalidArgumentError(
            f"sl.pipeline splits an nn.Sequential (its forward chains its children); got "
            f"{type(model).__name__}. Write the model as nn.Sequential(embedding, *blocks, "
            "head), or split it by tracing (sl.pipeline(..., split=[...], example=...))"
        )
    children = list(model.named_children())
    if not children:
        raise InvalidArgumentError("the model has no children to split into stages")
    return children


def keep_only(model: nn.Module, names: set[str]) -> None:
    """Drops every child of ``model`` not in ``names``: a rank holds only its own stages.

    A dropped child's memory goes with its last reference.
    """
    for name in [n for n, _ in model.named_children() if n not in names]:
        del model._modules[name]
