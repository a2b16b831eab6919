"""Models built on the meta device: each rank materialises only its own stages.

``with torch.device("meta"): model = build()`` costs no memory; ``sl.pipeline`` cuts it as
usual, then gives only this rank's children real storage (``to_empty``) and initialises them:
with the caller's ``init_fn(child)``, else by calling ``reset_parameters()`` on every module
that has one (what torch's own layers use to initialise themselves). Memory per rank is then
about 1/p of the model, never the whole of it. The values may instead come from a checkpoint
(``sl.checkpoint.load``) after the pipeline is built.

Copies that must start equal are made equal after initialisation (``PipelineModule``):
a weight tied across stages takes the value of its lowest rank, and data-parallel replicas
take replica 0's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from shardline.errors import InvalidArgumentError

__all__ = ["is_meta", "materialize"]


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _reset(child: nn.Module) -> None:
    for module in child.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def materialize(
    children: Iterable[tuple[str, nn.Module]],
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None,
) -> None:
    """Gives ``children`` storage on ``device`` and initialises them (see the module docs).

    Raises:
        InvalidArgumentError: a tensor is still on the meta device afterwards (``init_fn``
            replaced it with a meta tensor, say), naming it.
    """
    for name, child in children:
        child.to_empty(device=device)
        with torch.no_grad():
            (init_fn or _reset)(child)
        left = [
            n
            for n, t in itertools.chain(child.named_parameters(), child.named_buffers())
            if t.is_meta
        ]
        if left:
            raise InvalidArgumentError(
                f"pipeline: after initialising child {name!r}, {left[:4]} are still on the meta "
                "device; init_fn must give every tensor real values"
            )
