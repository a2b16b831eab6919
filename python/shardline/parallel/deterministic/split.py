"""Sums that tensor parallelism splits across ranks, cut into fixed blocks in every layout.

Tensor parallelism splits two sums of a linear layer over its ranks: a row-parallel layer's
output (a sum over its input features) and a column-parallel layer's input gradient (a sum
over its output features). Each rank adds its part and the group adds the ranks', so the
order of the additions depends on the number of ranks. In deterministic mode with ``blocks``
every such sum is cut into ``blocks`` equal blocks of features in every layout, one process
included: each block is one product of the same shape everywhere, and the blocks are added in
the canonical tree (``shardline.comm.tree.tree_sum``). A rank of ``t`` holds ``blocks / t``
consecutive blocks, a subtree, and the group (a ``tree_group``) adds the ranks' results in the
same tree, so every layout makes the sum one process makes.

A fused weight of ``pieces`` (q, k and v in one matrix) is split piece by piece: block ``j``
is the ``j``-th part of every piece, which is what the rank holding it holds.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shardline.comm.group import ProcessGroup
from shardline.comm.tree import tree_sum

__all__ = ["Split", "column_input_grad", "row_output"]


class Split(NamedTuple):
    """How a linear layer's split sums are cut, on this rank.

    Attributes:
        role: ``"column"`` (output features split: the input's gradient is the split sum)
            or ``"row"`` (input features split: the output is).
        pieces: Equal blocks of the output the weight fuses (q, k, v: 3); column only.
        blocks: This rank's blocks of the split features (the dense layer's, over ``t``).
        group: The tensor-parallel group that adds the ranks' sums (a ``tree_group``);
            ``None`` in one process.
    """

    role: str
    pieces: int
    blocks: int
    group: ProcessGroup | None


def row_output(x: torch.Tensor, weight: torch.Tensor, blocks: int) -> torch.Tensor:
    """``x @ weight.T`` (no bias), its sum over the input features in ``blocks`` blocks.

    ``x`` is ``(..., K)`` and ``weight`` ``(N, K)`` with ``blocks`` dividing ``K``; the
    blocks' products are added in the canonical tree.
    """
    k, n = x.shape[-1], weight.shape[0]
    s = k // blocks
    xs = x.reshape(-1, blocks, s).transpose(0, 1).contiguous()  # (blocks, M, s)
    ws = weight.view(n, blocks, s).permute(1, 2, 0).contiguous()  # (blocks, s, N)
    return tree_sum(torch.bmm(xs, ws), fresh=True).view(*x.shape[:-1], n)


def column_input_grad(
    dy: torch.Tensor, weight: torch.Tensor, pieces: int, blocks: int
) -> torch.Tensor:
    """``dy @ weight``: the sum over the output features in ``blocks`` blocks (each piece's).

    ``dy`` is ``(..., N)`` and ``weight`` ``(N, K)``, ``N`` being ``pieces`` pieces of
    ``blocks`` blocks each; the blocks' products are added in the canonical tree.
    """
    n, k = weight.shape
    s = n // (pieces * blocks)
    dys = dy.reshape(-1, pieces, blocks, s).permute(2, 0, 1, 3).reshape(blocks, -1, pieces * s)
    ws = weight.view(pieces, blocks, s, k).transpose(0, 1).reshape(blocks, pieces * s, k)
    return tree_sum(torch.bmm(dys, ws), fresh=True).view(*dy.shape[:-1], k)
