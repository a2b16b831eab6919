"""The layers whose parameters get per-unit gradients: linear, layer norm, embedding.

Each patched layer runs its usual forward outside a deterministic forward (evaluation, no
grad). Inside one it runs an autograd function that computes the input's gradient as torch
does and hands the parameters' per-unit gradients to the forward's ``Collector``, which
returns their tree sum as the parameter's gradient once its last use has given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardline.errors import InvalidArgumentError
from shardline.parallel.deterministic.collector import Collector, Dense, Lookups, Products

__all__ = ["ACTIVE", "LAYERS", "check_layer"]

ACTIVE = threading.local()  # .collector: that of the deterministic forward on this thread


def _collector(x: torch.Tensor, layer: nn.Module) -> Collector | None:
    c: Collector | None = getattr(ACTIVE, "collector", None)
    if c is None or not torch.is_grad_enabled():
        return None
    if x.dim() == 0 or x.shape[0] != c.batch:
        where = f"nn.{type(layer).__name__} {layer._sl_name!r}"
        raise InvalidArgumentError(
            f"deterministic mode: {where} got an input of shape {list(x.shape)}, whose first "
            f"dimension is not the batch's {c.batch} samples. Its gradient would be summed "
            "over the samples by autograd, in an order that depends on the batch size; give "
            "it one row per sample (for positions: torch.arange(n).expand(batch, n))"
        )
    return c


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, c: Collector
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.c = c
        ctx.keys = (c.use(weight), None if bias is None else c.use(bias))
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        c: Collector = ctx.c
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dys = dy.reshape(c.units, -1, dy.shape[-1])
        dw = c.give(ctx.keys[0], Products(dys, x.reshape(c.units, -1, x.shape[-1])))
        db = None if ctx.keys[1] is None else c.give(ctx.keys[1], Dense(dys.sum(1)))
        return dx, dw, db, None


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        shape: list[int],
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        c: Collector,
    ) -> torch.Tensor:
        out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.shape, ctx.c = shape, c
        ctx.keys = tuple(None if p is None else c.use(p) for p in (weight, bias))
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, rstd, weight, bias = ctx.saved_tensors
        c: Collector = ctx.c
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.ops.aten.native_layer_norm_backward(
                dy, x, ctx.shape, mean, rstd, weight, bias, [True, False, False]
            )[0]
        dys = dy.reshape(c.units, -1, *dy.shape[-len(ctx.shape) :])
        dw = db = None
        if ctx.keys[0] is not None:
            products = torch.sub(x, mean).mul_(rstd).mul_(dy)  # x-hat times dy
            dw = c.give(ctx.keys[0], Dense(products.reshape(dys.shape).sum(1)))
        if ctx.keys[1] is not None:
            db = c.give(ctx.keys[1], Dense(dys.sum(1)))
        return dx, None, dw, db, None, None


class _EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, idx: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, c: Collector
    ) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.padding_idx, ctx.rows, ctx.c = padding_idx, weight.shape[0], c
        ctx.key = c.use(weight)
        return F.embedding(idx, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (idx,) = ctx.saved_tensors
        c: Collector = ctx.c
        flat, rows = idx.reshape(-1), dy.reshape(-1, dy.shape[-1])
        unit = torch.arange(c.units, device=idx.device).repeat_interleave(flat.numel() // c.units)
        if ctx.padding_idx is not None:  # the padding row gets no gradient
            keep = flat != ctx.padding_idx
            flat, rows, unit = flat[keep], rows[keep], unit[keep]
        return None, c.give(ctx.key, Lookups(c.units, unit, flat, rows, ctx.rows)), None, None


def _linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    c = _collector(x, self)
    if c is None:
        return F.linear(x, self.weight, self.bias)
    out: torch.Tensor = _LinearFn.apply(x, self.weight, self.bias, c)
    return out


def _layer_norm(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    c = _collector(x, self)
    shape = list(self.normalized_shape)
    if c is None:
        return F.layer_norm(x, shape, self.weight, self.bias, self.eps)
    out: torch.Tensor = _LayerNormFn.apply(x, shape, self.weight, self.bias, self.eps, c)
    return out


def _embedding(self: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    c = _collector(idx, self)
    if c is None:
        return F.embedding(idx, self.weight, self.padding_idx)
    out: torch.Tensor = _EmbeddingFn.apply(idx, self.weight, self.padding_idx, c)
    return out


# The layer types (exactly these, not subclasses, whose forward may differ) and their forwards.
LAYERS: dict[type, Callable[..., torch.Tensor]] = {
    nn.Linear: _linear,
    nn.LayerNorm: _layer_norm,
    nn.Embedding: _embedding,
}


def check_layer(name: str, m: nn.Module) -> None:
    """Refuses the layer options deterministic mode does not handle."""
    if isinstance(m, nn.Embedding) and (m.max_norm is not None or m.scale_grad_by_freq or m.sparse):
        raise InvalidArgumentError(
            f"deterministic mode: nn.Embedding {name!r} uses max_norm, scale_grad_by_freq or "
            "sparse gradients, which it does not support; turn them off"
        )
