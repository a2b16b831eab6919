"""Per-unit sums over rows on a GPU, one kernel launch each (Triton): biases' and norms'.

A bias's per-unit gradient is its output gradient summed over the unit's rows (tokens); a
layer norm's weight takes the rows' ``x_hat * dy`` and its bias the rows' ``dy``. On a GPU
``sum(1)`` picks its strategy from the whole tensor's shape, so a unit's bits would depend on
the number of units. Here each program adds one unit's rows for a block of features, one row
after the other in float32 (``UNROLL`` rows loaded at a time, added in order): the same
additions whatever the number of units, the features' width or where a feature sits (a
column layer's slice). The tree of elementwise adds it replaces took nine launches for 512
rows, each with three Python calls.

Importing this module needs Triton (installed with torch's CUDA builds).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["norm_sums", "row_sums"]

_BLOCK = 128  # features per program
_UNROLL = 8  # rows loaded before they are added (in order)


@triton.jit
def _rows_kernel(x, out, rows, width, UNROLL: tl.constexpr, BLOCK: tl.constexpr):
    unit = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < width
    src = x + unit * rows * width + col
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    whole = rows - rows % UNROLL
    for r in range(0, whole, UNROLL):
        for i in tl.static_range(UNROLL):
            acc += tl.load(src + (r + i) * width, mask=mask, other=0.0).to(tl.float32)
    for r in range(whole, rows):
        acc += tl.load(src + r * width, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + unit * width + col, acc, mask=mask)


@triton.jit
def _norm_row(xs, gs, mean, rstd, r, width, mask, acc_w, acc_b, WEIGHT: tl.constexpr):
    g = tl.load(gs + r * width, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT:
        m = tl.load(mean + r).to(tl.float32)
        s = tl.load(rstd + r).to(tl.float32)
        v = tl.load(xs + r * width, mask=mask, other=0.0).to(tl.float32)
        acc_w += (v - m) * s * g
    return acc_w, acc_b + g


@triton.jit
def _norm_kernel(
    x, mean, rstd, dy, dw, db, rows, width,
    WEIGHT: tl.constexpr, BIAS: tl.constexpr, UNROLL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    unit = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < width
    first = unit * rows
    xs, gs = x + first * width + col, dy + first * width + col
    ms, rs = mean + first, rstd + first
    acc_w = tl.zeros([BLOCK], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK], dtype=tl.float32)
    whole = rows - rows % UNROLL
    for r in range(0, whole, UNROLL):
        for i in tl.static_range(UNROLL):
            acc_w, acc_b = _norm_row(xs, gs, ms, rs, r + i, width, mask, acc_w, acc_b, WEIGHT)
    for r in range(whole, rows):
        acc_w, acc_b = _norm_row(xs, gs, ms, rs, r, width, mask, acc_w, acc_b, WEIGHT)
    if WEIGHT:
        tl.store(dw + unit * width + col, acc_w, mask=mask)
    if BIAS:
        tl.store(db + unit * width + col, acc_b, mask=mask)


def row_sums(per_unit: torch.Tensor) -> torch.Tensor:
    """``per_unit`` (``[units, rows, *features]``) summed over rows, in float32."""
    units, rows = per_unit.shape[:2]
    x = per_unit.reshape(units, rows, -1).contiguous()
    width = x.shape[2]
    out = torch.empty((units, width), dtype=torch.float32, device=x.device)
    grid = (units, triton.cdiv(width, _BLOCK))
    _rows_kernel[grid](x, out, rows, width, UNROLL=_UNROLL, BLOCK=_BLOCK)
    return out.view(units, *per_unit.shape[2:])


def norm_sums(
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dy: torch.Tensor,
    shape: list[int],
    units: int,
    weight: bool,
    bias: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A layer norm's per-unit weight and bias gradients, float32, ``[units, *shape]``.

    ``x`` and ``dy`` are ``[..., *shape]``, their rows in ``units`` equal blocks; ``mean`` and
    ``rstd`` hold one value per row (``native_layer_norm``'s). ``None`` where not asked for.
    """
    width = math.prod(shape)
    total = x.numel() // width
    xs = x.reshape(total, width).contiguous()
    gs = dy.reshape(total, width).contiguous()
    ms, rs = mean.reshape(total).contiguous(), rstd.reshape(total).contiguous()
    dw = torch.empty((units, width), dtype=torch.float32, device=x.device) if weight else None
    db = torch.empty((units, width), dtype=torch.float32, device=x.device) if bias else None
    grid = (units, triton.cdiv(width, _BLOCK))
    _norm_kernel[grid](
        xs, ms, rs, gs, gs if dw is None else dw, gs if db is None else db, total // units,
        width, WEIGHT=weight, BIAS=bias, UNROLL=_UNROLL, BLOCK=_BLOCK,
    )  # fmt: skip
    return (
        None if dw is None else dw.view(units, *shape),
        None if db is None else db.view(units, *shape),
    )
