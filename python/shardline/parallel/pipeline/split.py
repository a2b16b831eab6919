"""Splitting a model into contiguous pipeline stages.

A model whose forward is a chain of its children, ``nn.Sequential``, is cut between children:
balanced by parameter count (``split="auto"``) or where the caller names the first child of
each stage after the first. Stage ``s`` of ``S`` holds the children of its part under their
original names, so a stage's ``named_parameters()`` are the whole model's names.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from shardline.errors import InvalidArgumentError

__all__ = ["balanced_parts", "chain_children", "keep_only", "named_parts"]


def _sizes(children: list[tuple[str, nn.Module]]) -> list[int]:
    return [sum(p.numel() for p in child.parameters()) for _, child in children]


def balanced_parts(children: list[tuple[str, nn.Module]], stages: int) -> list[list[str]]:
    """Cuts ``children`` into ``stages`` contiguous, non-empty parts, balanced.

    The largest part's parameter count is as small as it can be (a linear-partition DP; ties
    go to earlier cuts).
    """
    n = len(children)
    if stages > n:
        raise InvalidArgumentError(
            f"the model has {n} children to split but the pipeline has {stages} stages; use "
            f"at most {n} stages (ranks x virtual_stages), or a model with more layers"
        )
    sizes = _sizes(children)
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
