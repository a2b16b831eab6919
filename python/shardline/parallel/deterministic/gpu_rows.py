"""Per-unit sums over rows on a GPU, one kernel launch each (Triton): biases' and norms'.

A bias's per-unit gradient is its output gradient summed over the unit's rows (tokens); a
layer norm's weight takes the rows' ``x_hat * dy`` and its bias the rows' ``dy``. On a GPU
``sum(1)`` picks its strategy from the whole tensor's shape, so a unit's bits would depend on
the number of units. Here each program adds one unit's rows for a block of features, one row
after the other in float32 (``UNROLL`` rows loaded at a time, added in order): the same
additions whatever the number of units, the features' width or where a feature sits (a
column layer's slice). The tree of elementwise adds it replaces took nine launches for 512
rows, each with three Python calls.

Where a bias or a norm is used once its gradient is the tree over units of those sums
(``tree=True``). ``row_sums`` makes it in the same launch: each program takes a block of
features for every unit at once (a row of each unit a step, each unit's rows in order) and
adds the units level by level, pairs ``2i`` and ``2i+1``. ``norm_sums`` writes the units'
weight and bias sums side by side and adds both in one ``tree_sum`` (a second launch, not
three: its loads of ``x`` per unit were 2.7x slower as one launch's, on an H200). Both give
the bits of ``tree_sum`` over the per-unit sums.

Importing this module needs Triton (installed with torch's CUDA builds).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shardline.comm.tree import tree_sum
from shardline.comm.tree_cuda import MAX_ROWS, tree_sum_into

__all__ = ["MAX_UNITS", "norm_sums", "row_sums", "tree_fits"]

MAX_UNITS = 64  # the most units a tree in one launch adds (a power of two)

_BLOCK = 128  # features per program
_UNROLL = 8  # rows loaded before they are added (in order)


@triton.jit
def _unit_rows(src, rows, width, mask, UNROLL: tl.constexpr):
    """The rows below ``src`` (row 0's addresses, any shape) added in order, in float32."""
    acc = tl.zeros(src.shape, dtype=tl.float32)
    whole = rows - rows % UNROLL
    for r in range(0, whole, UNROLL):
        for i in tl.static_range(UNROLL):
            acc += tl.load(src + (r + i) * width, mask=mask, other=0.0).to(tl.float32)
    for r in range(whole, rows):
        acc += tl.load(src + r * width, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _rows_kernel(x, out, rows, width, UNROLL: tl.constexpr, BLOCK: tl.constexpr):
    unit = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < width
    acc = _unit_rows(x + unit * rows * width + col, rows, width, mask, UNROLL)
    tl.store(out + unit * width + col, acc, mask=mask)


@triton.jit
def _halve(acc, N: tl.constexpr, BLOCK: tl.constexpr):
    """One level of the tree over ``acc``'s ``N`` rows: rows ``2i`` + ``2i+1``."""
    left, right = tl.split(tl.permute(tl.reshape(acc, [N // 2, 2, BLOCK]), (0, 2, 1)))
    return left + right


@triton.jit
def _tree(acc, UNITS: tl.constexpr, BLOCK: tl.constexpr):
    """The canonical tree over ``acc``'s ``UNITS`` rows (a power of two up to 64), ``[BLOCK]``."""
    if UNITS >= 64:
        acc = _halve(acc, 64, BLOCK)
    if UNITS >= 32:
        acc = _halve(acc, 32, BLOCK)
    if UNITS >= 16:
        acc = _halve(acc, 16, BLOCK)
    if UNITS >= 8:
        acc = _halve(acc, 8, BLOCK)
    if UNITS >= 4:
        acc = _halve(acc, 4, BLOCK)
    if UNITS >= 2:
        acc = _halve(acc, 2, BLOCK)
    return tl.reshape(acc, [BLOCK])


@triton.jit
def _rows_tree_kernel(
    x, out, low, rows, width,
    UNITS: tl.constexpr, ROUND: tl.constexpr, UNROLL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Every unit's rows at once (one row of each unit per step, each unit's in order), then
    # the tree over the units.
    unit = tl.arange(0, UNITS).to(tl.int64)[:, None]
    col = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = (col < width)[None, :] & (unit < UNITS)
    acc = _unit_rows(x + unit * rows * width + col[None, :], rows, width, mask, UNROLL)
    total = _tree(acc, UNITS, BLOCK)
    tl.store(out + col, total, mask=col < width)
    if ROUND:  # the gradient in the parameter's dtype too: no launch to round it
        tl.store(low + col, total.to(low.dtype.element_ty), mask=col < width)


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
def _unit_norm(xs, gs, ms, rs, rows, width, mask, WEIGHT: tl.constexpr, UNROLL: tl.constexpr):
    """The rows' ``x_hat * dy`` and ``dy`` below ``xs``/``gs`` (row 0's), added in order."""
    acc_w = tl.zeros(gs.shape, dtype=tl.float32)
    acc_b = tl.zeros(gs.shape, dtype=tl.float32)
    whole = rows - rows % UNROLL
    for r in range(0, whole, UNROLL):
        for i in tl.static_range(UNROLL):
            acc_w, acc_b = _norm_row(xs, gs, ms, rs, r + i, width, mask, acc_w, acc_b, WEIGHT)
    for r in range(whole, rows):
        acc_w, acc_b = _norm_row(xs, gs, ms, rs, r, width, mask, acc_w, acc_b, WEIGHT)
    return acc_w, acc_b


@triton.jit
def _norm_kernel(
    x, mean, rstd, dy, dw, db, rows, width, stride,
    WEIGHT: tl.constexpr, BIAS: tl.constexpr, UNROLL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    unit = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < width
    first = unit * rows
    acc_w, acc_b = _unit_norm(x + first * width + col, dy + first * width + col, mean + first,
                              rstd + first, rows, width, mask, WEIGHT, UNROLL)  # fmt: skip
    if WEIGHT:
        tl.store(dw + unit * stride + col, acc_w, mask=mask)
    if BIAS:
        tl.store(db + unit * stride + col, acc_b, mask=mask)


def row_sums(
    per_unit: torch.Tensor, *, tree: bool = False, rounded: torch.Tensor | None = None
) -> torch.Tensor:
    """``per_unit`` (``[units, rows, *features]``) summed over rows, in float32.

    ``tree``: those sums added over units in the canonical tree (``[*features]``; units as
    ``tree_fits`` says), in the same launch: the bits of ``tree_sum`` over them; and
    ``rounded`` (contiguous, ``[*features]``), if given, filled with them rounded to its
    dtype as ``Tensor.to`` rounds, in that launch too.
    """
    units, rows = per_unit.shape[:2]
    x = per_unit.reshape(units, rows, -1).contiguous()
    width = x.shape[2]
    if tree:
        block = _tree_block(units)
        out = torch.empty(width, dtype=torch.float32, device=x.device)
        low = out if rounded is None else _flat(rounded, width)
        _rows_tree_kernel[(triton.cdiv(width, block),)](
            x, out, low, rows, width, UNITS=units, ROUND=rounded is not None, UNROLL=_UNROLL,
            BLOCK=block,
        )  # fmt: skip
        return out.view(per_unit.shape[2:])
    if rounded is not None:
        raise ValueError("row_sums: rounded goes with tree=True")
    out = torch.empty((units, width), dtype=torch.float32, device=x.device)
    _rows_kernel[(units, triton.cdiv(width, _BLOCK))](
        x, out, rows, width, UNROLL=_UNROLL, BLOCK=_BLOCK
    )
    return out.view(units, *per_unit.shape[2:])


def _flat(rounded: torch.Tensor, width: int) -> torch.Tensor:
    """``rounded`` as the kernels write it: contiguous, ``width`` values."""
    if rounded.numel() != width or not rounded.is_contiguous():
        raise ValueError(f"rounded is {list(rounded.shape)} (contiguous: "
                         f"{rounded.is_contiguous()}), not {width} contiguous values")  # fmt: skip
    return rounded


def norm_sums(
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dy: torch.Tensor,
    shape: list[int],
    units: int,
    weight: bool,
    bias: bool,
    *,
    tree: bool = False,
    rounded: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A layer norm's per-unit weight and bias gradients, float32, ``[units, *shape]``.

    ``x`` and ``dy`` are ``[..., *shape]``, their rows in ``units`` equal blocks; ``mean`` and
    ``rstd`` hold one value per row (``native_layer_norm``'s). ``None`` where not asked for.
    ``tree``: each summed over units in the canonical tree (``[*shape]``): the units' weight
    and bias sums lie side by side in one buffer, and one ``tree_sum`` adds both; and
    ``rounded`` (contiguous, the weight's then the bias's, those asked for), if given, filled
    with them rounded to its dtype as ``Tensor.to`` rounds (in the tree's launch where it
    takes one).
    """
    width = math.prod(shape)
    total = x.numel() // width
    xs = x.reshape(total, width).contiguous()
    gs = dy.reshape(total, width).contiguous()
    ms, rs = mean.reshape(total).contiguous(), rstd.reshape(total).contiguous()
    kinds = int(weight) + int(bias)
    per = torch.empty((units, max(kinds, 1), width), dtype=torch.float32, device=x.device)
    dw, db = per[:, 0], per[:, kinds - 1]
    _norm_kernel[(units, triton.cdiv(width, _BLOCK))](
        xs, ms, rs, gs, dw, db, total // units, width, kinds * width,
        WEIGHT=weight, BIAS=bias, UNROLL=_UNROLL, BLOCK=_BLOCK,
    )  # fmt: skip
    if rounded is not None and not tree:
        raise ValueError("norm_sums: rounded goes with tree=True")
    if tree:
        low = None if rounded is None else _flat(rounded, per[0].numel())
        if low is not None and 2 <= units <= MAX_ROWS and units & (units - 1) == 0:
            sums = tree_sum_into(per, rounded=low)  # the tree and its rounding: one launch
        else:
            sums = tree_sum(per, fresh=True)
            if low is not None:
                low.copy_(sums.view(low.shape))
        dw, db = sums[0], sums[kinds - 1]
    lead = () if tree else (units,)
    return (
        dw.view(*lead, *shape) if weight else None,
        db.view(*lead, *shape) if bias else None,
    )


def tree_fits(units: int) -> bool:
    """Whether ``row_sums(tree=True)`` takes ``units`` units: a power of two up to ``MAX_UNITS``.

    (``norm_sums(tree=True)`` takes any number: its tree is ``tree_sum``'s launch.)
    """
    return 1 <= units <= MAX_UNITS and units & (units - 1) == 0


def _tree_block(units: int) -> int:
    """Features a program of a tree launch takes: ``_BLOCK`` values a row, all units'.

    As many programs as the per-unit launch's: the rows' in-order adds bound both.
    """
    if not tree_fits(units):
        raise ValueError(f"a tree in one launch adds 1 to {MAX_UNITS} units, a power of two, "
                         f"not {units}")  # fmt: skip
    return max(16, _BLOCK // units)
