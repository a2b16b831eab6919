"""Deterministic mode: the same parameters, bit for bit, whatever the number of ranks.

A gradient is a sum over the batch's samples, and a floating-point sum depends on the order
of its additions. One process sums all samples inside each weight-gradient kernel; a rank of
DDP sums its samples there and the group then sums the ranks, in an order of the algorithm's
choosing. Deterministic mode fixes the order instead:

1. Each parameter's gradient is computed per *unit* (``unit`` consecutive samples, one by
   default) by the layers below, then the units' gradients are added in one canonical tree
   (``shardline.comm.tree.tree_sum``). A parameter used by several layers (a tied embedding)
   gets each unit's contributions added first, in the order backward reaches them.
2. The strategy's group is ``tree_group(group)``, whose sums add the ranks' results in the
   same tree. When every rank holds a power-of-two number of units, its block of units is a
   subtree of the tree over the whole batch, so the group finishes exactly the sum one
   process makes.
3. The mean over samples needs nothing: a mean loss over ``b`` samples scales each sample's
   gradient by ``1/b``, and the group's ``avg`` divides by the world size; both are powers of
   two, and scaling by a power of two commutes with rounding.

What it takes: the model's parameters belong to ``nn.Linear``, ``nn.LayerNorm`` and
``nn.Embedding`` layers (others raise, naming them), every such layer sees the samples along
the first dimension of its input, the loss is a mean over the samples (equal terms per
sample), rank ``r`` of ``W`` holds samples ``[r*b, (r+1)*b)`` of the global batch, and ``b``
(per rank) and ``W`` are powers of two. Other layers (attention, activations, the loss) work
row by row and give the same bits for a sample whatever the batch around it on CPU.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardline.errors import InvalidArgumentError
from shardline.parallel.deterministic.collector import Collector
from shardline.parallel.deterministic.layers import ACTIVE, LAYERS, check_layer

__all__ = ["collecting", "is_deterministic", "make_deterministic", "unit_of"]

_ATTR = "_shardline_deterministic"


def is_deterministic(model: nn.Module) -> bool:
    """Whether ``make_deterministic`` has prepared ``model``."""
    return hasattr(model, _ATTR)


def unit_of(model: nn.Module) -> int | None:
    """The samples per unit ``make_deterministic`` prepared ``model`` with; ``None``: not."""
    unit: int | None = getattr(model, _ATTR, None)
    return unit


def make_deterministic(model: nn.Module, *, unit: int = 1) -> nn.Module:
    """Prepares ``model`` (in place) for gradients that do not depend on the layout.

    Every ``nn.Linear``, ``nn.LayerNorm`` and ``nn.Embedding`` computes its parameters'
    gradients per unit of ``unit`` samples and adds the units in the canonical tree; the
    model's ``forward`` reads the batch size from its first tensor argument's first dimension.
    Train it as before, alone or under ``sl.distribute(..., deterministic=True)``, which calls
    this and reduces over ranks in the same tree. Larger units cost less (fewer per-unit
    gradients) and allow fewer layouts: every rank needs a power-of-two number of units.
    The prepared model can be copied (``copy.deepcopy``): the copy is prepared too.

    Returns:
        ``model`` itself.

    Raises:
        InvalidArgumentError: a trainable parameter that belongs to another kind of layer
            (named), an unsupported embedding option, ``unit < 1``, or a model prepared
            before with another unit.
    """
    if unit < 1:
        raise InvalidArgumentError(f"make_deterministic: unit must be >= 1, got {unit}")
    if is_deterministic(model):
        if getattr(model, _ATTR) != unit:
            raise InvalidArgumentError(
                f"make_deterministic: the model was prepared with unit={getattr(model, _ATTR)}, "
                f"not {unit}; build a fresh model to change it"
            )
        return model
    for name, m in model.named_modules():
        own = [n for n, p in m.named_parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        kind = next((k for k in LAYERS if type(m) is k), None)
        if kind is None:
            raise InvalidArgumentError(
                f"deterministic mode: {type(m).__name__} {name or '<root>'!r} holds trainable "
                f"parameters ({', '.join(own)}); only nn.Linear, nn.LayerNorm and "
                "nn.Embedding layers compute per-unit gradients. Build the model from those, "
                "or freeze these parameters (requires_grad_(False))"
            )
        check_layer(name, m)
        m._sl_name = name
        if m is not model:  # the root's forward is the batch's, below (it calls its layer's)
            m.forward = types.MethodType(LAYERS[kind], m)
    setattr(model, _ATTR, unit)
    # A bound method, not a closure: a deep copy of the model rebinds it to the copy.
    model.forward = types.MethodType(_forward, model)
    return model


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The prepared model's forward: a collector for this batch, then the model's own."""
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise InvalidArgumentError(
            "deterministic mode: the model's forward needs a tensor argument whose first "
            "dimension is the batch"
        )
    own = LAYERS.get(type(self))  # the model is itself one layer
    with collecting(first.shape[0], getattr(self, _ATTR)):
        if own is not None:
            return own(self, *args, **kwargs)
        return type(self).forward(self, *args, **kwargs)


@contextlib.contextmanager
def collecting(batch: int, unit: int, *, held: bool = False) -> Iterator[Collector]:
    """A forward of ``batch`` samples: the prepared layers inside give to the collector yielded.

    It takes their per-unit gradients (``unit`` samples a unit); ``held``: see ``Collector``.

    Raises:
        InvalidArgumentError: ``batch`` is not a power-of-two number of units.
    """
    units, rest = divmod(batch, unit)
    if rest or units < 1 or units & (units - 1):
        raise InvalidArgumentError(
            f"deterministic mode: a batch of {batch} samples is not a power-of-two number "
            f"of units of {unit}; each rank (and each micro-batch) needs 2**k units so that "
            "its sum is a subtree of the whole batch's"
        )
    previous = getattr(ACTIVE, "collector", None)
    collector = ACTIVE.collector = Collector(units, batch, held=held)
    try:
        yield collector
    finally:
        ACTIVE.collector = previous
