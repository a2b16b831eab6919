"""The canonical tree sum on a GPU in one kernel launch (Triton), for ``tree_sum``.

Added level by level with elementwise adds, the tree over ``n`` rows takes ``log2 n`` kernel
launches and three Python calls a level; deterministic mode sums every parameter's per-unit
gradients this way, and its steps on a GPU are bound by launches. Here one launch adds every
level: each program owns a block of columns, adds the pairs of rows of one level, waits for
all its threads (a barrier), stores the sums into the first rows of ``parts`` (which the
caller lets go), and goes on to the next level. Each addition is the tree's, one float32 add
in the same order, so the bits are those of the elementwise adds.

``push`` and ``fold`` are the same tree inside a kernel that makes its leaves one after the
other (deterministic mode's per-unit sums: ``gpu_rows``, ``gpu_products``), in registers: a
binary counter whose level ``j`` holds the sum of ``2**j`` consecutive leaves, a subtree.

Importing this module needs Triton (installed with torch's CUDA builds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_ROWS", "fold", "push", "tree_sum_into"]

MAX_ROWS = 64  # the most rows one launch adds (a power of two); more: the elementwise adds


@triton.jit
def push(u: tl.constexpr, p, s0, s1, s2, s3, s4, s5, s6):
    """Adds leaf ``u`` (value ``p``; leaves ``0..u-1`` pushed before) to the counter ``s0..s6``.

    Leaf ``u`` closes the subtrees of its trailing ones, left + right (each the tree's add),
    and the result is held at the level above them. Returns the new ``s0..s6``.
    """
    if u % 2 == 1:
        p = s0 + p
    if u % 4 == 3:
        p = s1 + p
    if u % 8 == 7:
        p = s2 + p
    if u % 16 == 15:
        p = s3 + p
    if u % 32 == 31:
        p = s4 + p
    if u % 64 == 63:
        p = s5 + p
    if u % 2 == 0:
        s0 = p
    elif u % 4 == 1:
        s1 = p
    elif u % 8 == 3:
        s2 = p
    elif u % 16 == 7:
        s3 = p
    elif u % 32 == 15:
        s4 = p
    elif u % 64 == 31:
        s5 = p
    else:
        s6 = p
    return s0, s1, s2, s3, s4, s5, s6


@triton.jit
def fold(LEAVES: tl.constexpr, s0, s1, s2, s3, s4, s5, s6):
    """The canonical tree's sum of ``LEAVES`` pushed leaves (``1 <= LEAVES <= 64``: levels 0-6).

    The counter holds one subtree per set bit of ``LEAVES``; the canonical tree is the largest
    (left) plus the tree of the rest, so they are added from the smallest up.
    """
    if LEAVES % 2 == 1:  # the smallest subtree: the lowest set bit's
        total = s0
    elif LEAVES % 4 == 2:
        total = s1
    elif LEAVES % 8 == 4:
        total = s2
    elif LEAVES % 16 == 8:
        total = s3
    elif LEAVES % 32 == 16:
        total = s4
    elif LEAVES % 64 == 32:
        total = s5
    else:
        total = s6
    # then each larger one, left of what is added so far: bit j set and a lower one too
    if LEAVES % 4 > 2:
        total = s1 + total
    if LEAVES % 8 > 4:
        total = s2 + total
    if LEAVES % 16 > 8:
        total = s3 + total
    if LEAVES % 32 > 16:
        total = s4 + total
    if LEAVES % 64 > 32:
        total = s5 + total
    return total


@triton.jit
def _tree_kernel(
    parts, out, low, width,
    N: tl.constexpr, LEVELS: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    col = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_row = col < width
    pair = tl.arange(0, N // 2).to(tl.int64)
    for level in tl.static_range(LEVELS):
        live = pair < (N >> (level + 1))  # the pairs of this level
        mask = live[:, None] & in_row[None, :]
        left = tl.load(parts + (2 * pair)[:, None] * width + col[None, :], mask=mask, other=0.0)
        right = tl.load(
            parts + (2 * pair + 1)[:, None] * width + col[None, :], mask=mask, other=0.0
        )
        total = left + right
        tl.debug_barrier()  # every thread has loaded this level before any stores over it
        if level == LEVELS - 1:
            first = (pair == 0)[:, None] & in_row[None, :]
            tl.store(out + pair[:, None] * 0 + col[None, :], total, mask=first)
            if ROUND:  # the sum in another dtype too: no launch to round it
                low_ty = low.dtype.element_ty
                tl.store(low + pair[:, None] * 0 + col[None, :], total.to(low_ty), mask=first)
        else:
            tl.store(parts + pair[:, None] * width + col[None, :], total, mask=mask)
            tl.debug_barrier()


def tree_sum_into(parts: torch.Tensor, *, rounded: torch.Tensor | None = None) -> torch.Tensor:
    """The tree sum over dim 0 of ``parts``, which it overwrites (the caller lets it go).

    ``parts``: float32, contiguous, on a GPU, ``2**k`` rows (``1 <= k``, at most ``MAX_ROWS``).
    ``rounded`` (contiguous, as many values as a row): also filled with the sum rounded to its
    dtype, as ``Tensor.to`` rounds (to nearest, ties to even), in the same launch.
    """
    n = parts.shape[0]
    width = parts[0].numel()
    out = torch.empty(parts.shape[1:], dtype=parts.dtype, device=parts.device)
    block = max(32, min(512, 1024 // (n // 2)))
    grid = (triton.cdiv(width, block),)
    if rounded is not None and (rounded.numel() != width or not rounded.is_contiguous()):
        raise ValueError(f"tree_sum_into: rounded is {list(rounded.shape)}, not {width} "
                         "contiguous values")  # fmt: skip
    low = out if rounded is None else rounded
    _tree_kernel[grid](
        parts, out, low, width, N=n, LEVELS=n.bit_length() - 1, ROUND=rounded is not None,
        BLOCK=block,
    )  # fmt: skip
    return out
