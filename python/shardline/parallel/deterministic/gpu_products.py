"""A linear layer's per-unit weight gradients on a GPU in float32, and their tree: one launch.

Unit ``u``'s gradient of a weight is ``dys[u].T @ xs[u]``. Under autocast ``torch.bmm`` makes
every unit's product in bf16, rounded; a copy widens them to float32 and the tree adds them:
three launches, and every unit's product written to memory and read back twice. Here each
program makes one tile of the gradient (``BM`` outputs by ``BN`` inputs) for every unit, one
unit after the other, accumulating each unit's rows in float32 in the same blocks of ``BK``
(one fixed tile shape: a unit's bits never depend on the number of units or the outputs asked
for), and adds the units' tiles in the canonical tree as they come (``tree_cuda.push``: one tile
held per level of a binary counter, at most five for ``MAX_UNITS``). So ``products(tree=True)``
gives the bits of ``tree_sum`` over ``products(tree=False)``'s float32 per-unit products,
which the blocks of a tied weight take, with nothing in between written to memory. The same
launch can write the sum rounded to the parameter's dtype (``rounded``) and make the layer's
bias's tree (``bias``: one more column of programs, with ``gpu_rows.row_sums``' additions),
which would each take a launch of their own.

Importing this module needs Triton (installed with torch's CUDA builds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardline.comm.tree_cuda import fold, push
from shardline.parallel.deterministic.gpu_rows import _UNROLL, _tree, _unit_rows, tree_fits

__all__ = ["MAX_UNITS", "products"]

# The most units one launch adds in its tree: the kernel is built for each number of units,
# each unit's loop written out (a test of 16 units took 8-12 s on an H200's host, building
# included; of 64, 73-80 s). More: the per-unit products in blocks of outputs, then
# ``tree_sum``.
MAX_UNITS = 16
# One tile shape for every call (a unit's bits follow it), the fastest of those timed on an
# H200 for the 101M GPT's layers at 8 units: 64 x 64 tiles, blocks of 64 rows, 4 warps, 4
# stages. A tile is 32 registers a thread; the counter holds up to five (16 units).
_BM, _BN, _BK, _WARPS, _STAGES = 64, 64, 64, 4, 4


@triton.jit
def _tile(dys, xs, u, m, n, rows, stop, ins, s_du, s_dr, s_xu, s_xr, BK: tl.constexpr):
    """Unit ``u``'s ``dys[u].T @ xs[u]`` at outputs ``m`` and inputs ``n``, in float32."""
    k = tl.arange(0, BK)
    a = dys + u * s_du + k[:, None] * s_dr + m[None, :]  # [BK, BM]: outputs contiguous
    b = xs + u * s_xu + k[:, None] * s_xr + n[None, :]  # [BK, BN]
    in_m, in_n = (m < stop)[None, :], (n < ins)[None, :]
    acc = tl.zeros((m.shape[0], n.shape[0]), dtype=tl.float32)
    for k0 in range(0, rows, BK):
        live = (k0 + k < rows)[:, None]  # past the unit's rows: zeros, which add nothing
        da = tl.load(a, mask=live & in_m, other=0.0)
        xb = tl.load(b, mask=live & in_n, other=0.0)
        acc = tl.dot(tl.trans(da), xb, acc)
        a += BK * s_dr
        b += BK * s_xr
    return acc


@triton.jit
def _products_kernel(
    dys, xs, out, low, bias, bias_low, rows, start, stop, ins, s_du, s_dr, s_xu, s_xr,
    TREE: tl.constexpr, UNITS: tl.constexpr, ROUND: tl.constexpr, BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    m = start + tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    keep = (m < stop)[:, None] & (n < ins)[None, :]
    at = (m - start)[:, None].to(tl.int64) * ins + n[None, :]
    if BIAS and tl.program_id(1) * BN >= ins:  # past the inputs: the bias's tree at outputs m
        # ``row_sums(tree=True)``'s adds (each unit's rows in order, then the units pairwise)
        unit = tl.arange(0, UNITS).to(tl.int64)[:, None]
        live = (m < stop)[None, :] & (unit < UNITS)
        acc = _unit_rows(dys + unit * s_du + m[None, :], rows, s_dr, live, UNROLL)
        summed = _tree(acc, UNITS, BM)
        tl.store(bias + (m - start), summed, mask=m < stop)
        if ROUND:
            tl.store(bias_low + (m - start), summed.to(bias_low.dtype.element_ty), mask=m < stop)
    elif not TREE:  # one unit a program, written whole
        u = tl.program_id(2).to(tl.int64)
        p = _tile(dys, xs, u, m, n, rows, stop, ins, s_du, s_dr, s_xu, s_xr, BK)
        tl.store(out + u * (stop - start) * ins + at, p, mask=keep)
        if ROUND:
            tl.store(low + u * (stop - start) * ins + at, p.to(low.dtype.element_ty), mask=keep)
    else:  # every unit in turn, added in the tree as they come
        s0 = tl.zeros((BM, BN), dtype=tl.float32)
        s1, s2, s3, s4, s5, s6 = s0, s0, s0, s0, s0, s0
        for u in tl.static_range(UNITS):
            p = _tile(dys, xs, u, m, n, rows, stop, ins, s_du, s_dr, s_xu, s_xr, BK)
            s0, s1, s2, s3, s4, s5, s6 = push(u, p, s0, s1, s2, s3, s4, s5, s6)
        total = fold(UNITS, s0, s1, s2, s3, s4, s5, s6)
        tl.store(out + at, total, mask=keep)
        if ROUND:  # the gradient in the parameter's dtype too: no launch to round it
            tl.store(low + at, total.to(low.dtype.element_ty), mask=keep)


def products(
    dys: torch.Tensor,
    xs: torch.Tensor,
    start: int,
    stop: int,
    *,
    tree: bool,
    rounded: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    bias_rounded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Outputs ``[start, stop)`` of every unit's ``dys[u].T @ xs[u]``, in float32.

    ``dys`` (``[units, rows, outs]``) and ``xs`` (``[units, rows, ins]``): one dtype, on a GPU.
    ``tree``: their sum over units in the canonical tree, ``[stop - start, ins]`` (at most
    ``MAX_UNITS`` units); else ``[units, stop - start, ins]``. ``rounded`` (contiguous, of
    that shape, any float dtype): also filled with the result rounded to its dtype, as
    ``Tensor.to`` rounds (to nearest, ties to even), in the same launch.

    ``bias`` (``tree``, float32, contiguous, ``[stop - start]``; a power of two of units, as
    ``gpu_rows.tree_fits`` says): filled with the bias's gradient, ``dys``' rows summed and
    the units added in the tree, with ``gpu_rows.row_sums(tree=True)``'s bits, by extra
    programs of the same launch; ``bias_rounded`` (with ``rounded``) its rounding.
    """
    units, rows, _ = dys.shape
    ins = xs.shape[2]
    if dys.stride(2) != 1:
        dys = dys.contiguous()
    if xs.stride(2) != 1:
        xs = xs.contiguous()
    shape = (stop - start, ins) if tree else (units, stop - start, ins)
    out = torch.empty(shape, dtype=torch.float32, device=dys.device)
    if bias is not None and not (
        tree
        and tree_fits(units)
        and bias.shape == (stop - start,)
        and bias.is_contiguous()
        and (rounded is None) == (bias_rounded is None)
        and (bias_rounded is None or bias_rounded.shape == bias.shape)
    ):  # fmt: skip
        raise ValueError(
            f"products: a bias of {list(bias.shape)} for {units} units ({stop - start} "
            "outputs wanted, with the tree and a power of two of units; rounded with the "
            "weight or not at all)"
        )
    # ``bias``: one more column of programs, past the inputs' tiles
    columns = triton.cdiv(ins, _BN) + (bias is not None)
    grid = (triton.cdiv(stop - start, _BM), columns, 1 if tree else units)
    if tree and not 1 <= units <= MAX_UNITS:
        raise ValueError(f"products(tree=True) adds 1 to {MAX_UNITS} units, not {units}")
    if rounded is not None and (rounded.shape != out.shape or not rounded.is_contiguous()):
        raise ValueError(f"products: rounded is {list(rounded.shape)}, not {list(shape)}")
    low = out if rounded is None else rounded
    _products_kernel[grid](
        dys, xs, out, low, out if bias is None else bias,
        low if bias_rounded is None else bias_rounded, rows, start, stop, ins,
        dys.stride(0), dys.stride(1), xs.stride(0), xs.stride(1), TREE=tree,
        UNITS=units if tree else 1, ROUND=rounded is not None, BIAS=bias is not None,
        BM=_BM, BN=_BN, BK=_BK, UNROLL=_UNROLL, num_warps=_WARPS, num_stages=_STAGES,
    )  # fmt: skip
    return out
