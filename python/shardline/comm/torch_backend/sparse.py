"""All-reduce of sparse COO tensors: every rank's entries gathered, then summed.

As Gloo does it: every rank learns every rank's number of entries and shape (one small
all-gather), gathers every rank's indices and values (two all-gathers of unequal sizes), adds
the ranks' tensors in rank order and coalesces, so every rank holds the same sum, written into
the caller's tensor.
"""

from __future__ import annotations

import torch

from shardline.comm.group import ProcessGroup
from shardline.errors import InvalidArgumentError

__all__ = ["sparse_all_reduce"]


def sparse_all_reduce(group: ProcessGroup, t: torch.Tensor, op: str) -> None:
    """Sums the sparse COO tensor ``t`` across ``group`` in place (blocking).

    Raises:
        InvalidArgumentError: ``op`` is not a sum, or the ranks' tensors differ in shape or
            sparse dimensions.
    """
    rank, world = group.rank, group.world_size
    if op != "sum":
        raise InvalidArgumentError(
            f"allreduce on rank {rank}: a sparse tensor can only be summed (ReduceOp.SUM), "
            f"got {op}; call .to_dense() for other reductions"
        )
    src = t.coalesce()
    sparse_dim = src.sparse_dim()
    meta = torch.tensor([src._nnz(), sparse_dim, *src.shape], dtype=torch.int64)
    lengths = torch.empty(world, dtype=torch.int64)
    group.all_gather(lengths, torch.tensor([meta.numel()]))
    if not bool((lengths == meta.numel()).all()):
        raise InvalidArgumentError(
            f"allreduce on rank {rank}: the ranks' sparse tensors differ in dimensions "
            f"(metadata lengths {lengths.tolist()}); pass tensors of one shape on every rank"
        )
    metas = torch.empty(world, meta.numel(), dtype=torch.int64)
    group.all_gather(metas, meta)
    for r in range(world):
        if not torch.equal(metas[r, 1:], meta[1:]):
            raise InvalidArgumentError(
                f"allreduce on rank {rank}: rank {r}'s sparse tensor has shape "
                f"{tuple(metas[r, 2:].tolist())} with {int(metas[r, 1])} sparse dimensions, "
                f"this rank's {tuple(src.shape)} with {sparse_dim}; pass one shape everywhere"
            )
    counts = metas[:, 0].tolist()
    dense_shape = tuple(src.shape[sparse_dim:])
    per_entry = src.values()[0].numel() if src._nnz() else int(torch.Size(dense_shape).numel())
    indices = [torch.empty(sparse_dim * n, dtype=torch.int64) for n in counts]
    group.all_gather(indices, src.indices().contiguous().reshape(-1))
    values = [torch.empty(n * per_entry, dtype=src.dtype) for n in counts]
    group.all_gather(values, src.values().contiguous().reshape(-1))
    total: torch.Tensor | None = None
    for n, i, v in zip(counts, indices, values, strict=True):
        part = torch.sparse_coo_tensor(
            i.view(sparse_dim, n), v.view(n, *dense_shape), src.shape, dtype=src.dtype
        )
        total = part if total is None else total + part
    assert total is not None  # a group has at least one rank
    t.copy_(total.coalesce())
