"""The canonical tree sum on a GPU in one kernel launch (Triton), for ``tree_sum``.

Added level by level with elementwise adds, the tree over ``n`` rows takes ``log2 n`` kernel
launches and three Python calls a level; deterministic mode sums every parameter's per-unit
gradients this way, and its steps on a GPU are bound by launches. Here one launch adds every
level: each program owns a block of columns, adds the pairs of rows of one level, waits for
all its threads (a barrier), stores the sums into the first rows of ``parts`` (which the
caller lets go), and goes on to the next level. Each addition is the tree's, one float32 add
in the same order, so the bits are those of the elementwise adds.

Importing this module needs Triton (installed with torch's CUDA builds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_ROWS", "tree_sum_into"]

MAX_ROWS = 64  # the most rows one launch adds (a power of two); more: the elementwise adds


@triton.jit
def _tree_kernel(parts, out, width, N: tl.constexpr, LEVELS: tl.constexpr, BLOCK: tl.constexpr):
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
        else:
            tl.store(parts + pair[:, None] * width + col[None, :], total, mask=mask)
            tl.debug_barrier()


def tree_sum_into(parts: torch.Tensor) -> torch.Tensor:
    """The tree sum over dim 0 of ``parts``, which it overwrites (the caller lets it go).

    ``parts``: float32, contiguous, on a GPU, ``2**k`` rows (``1 <= k``, at most ``MAX_ROWS``).
    """
    n = parts.shape[0]
    width = parts[0].numel()
    out = torch.empty(parts.shape[1:], dtype=parts.dtype, device=parts.device)
    block = max(32, min(512, 1024 // (n // 2)))
    grid = (triton.cdiv(width, block),)
    _tree_kernel[grid](parts, out, width, N=n, LEVELS=n.bit_length() - 1, BLOCK=block)
    return out
