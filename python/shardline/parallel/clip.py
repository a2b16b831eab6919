"""``sl.clip_grad_norm_``: gradient clipping by the global norm, for any strategy.

A wrapper that knows its layout (DDP, ZeRO, a pipeline stage, and their compositions on a
mesh) clips with its own ``clip_grad_norm_``; a model split by tensor parallelism alone
clips over the group it is split over, each element counted once.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.parallel._common import clip_to_global_norm_, copies_over

__all__ = ["clip_grad_norm_"]

# How many tp ranks hold each parameter's elements (a collective to measure; fixed once the
# model is split), per model.
_COPIES: weakref.WeakKeyDictionary[nn.Module, tuple[ProcessGroup, dict[str, int]]] = (
    weakref.WeakKeyDictionary()
)


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Scales the gradients of ``model`` so that their global norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_`` on the dense model: the norm over every element of
    every parameter once, however the ranks hold them. Returns the norm (a tensor).

    Args:
        model: A wrapped model (``sl.distribute``, ``sl.pipeline``): its own
            ``clip_grad_norm_`` is used. Or a plain module, possibly split by
            ``sl.tensor_parallel`` over ``group``.
        max_norm: The largest norm the gradients keep.
        norm_type: The p of the p-norm (``float("inf")`` for the largest magnitude).
        group: For a plain module split by tensor parallelism, its tensor-parallel group
            (a collective over it; which ranks hold what is measured on the first call);
            ``None`` for a module every rank holds whole.
    """
    own = getattr(model, "clip_grad_norm_", None)
    if callable(own):
        return own(max_norm, norm_type)  # type: ignore[no-any-return]
    if group is None:
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    grads = [g for _, g in named]
    known = _COPIES.get(model)
    if known is None or known[0] is not group:  # measured once per model and group
        known = (group, copies_over(group, model))
        _COPIES[model] = known
    copies = known[1]
    device = grads[0].device if grads else None
    return clip_to_global_norm_(
        grads, grads, group, max_norm, norm_type, device, copies=[copies[n] for n, _ in named]
    )
