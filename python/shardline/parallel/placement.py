"""Where a flat range of a rank's local tensor lies in the global tensor it is part of.

Data parallelism that shards flat buffers (ZeRO) over a model whose parameters are already
slices of bigger tensors (tensor parallelism) holds, per parameter, elements ``start ..`` of
the *local* slice flattened. A checkpoint needs them as pieces of the *global* tensor.
``Placement`` records, once, how the local tensor's blocks lie in the global one (the ``Box``
pieces a tensor-parallel layer's ``sharded_state_dict()`` gives, each a view of the local
tensor, possibly transposed), and maps any flat range of the local tensor to ``Box`` pieces of
the global tensor that are views of the flat range's own memory, so a checkpoint reads from
and loads into it in place.

A flat range of a row-major block is a few boxes (a partial first row, whole rows, a partial
last row, recursively per dimension); a block that is a sub-block (or a transposed one) of
the local tensor is walked in the order of its strides, which is the order of memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardline.errors import InvalidArgumentError
from shardline.parallel import contract
from shardline.parallel.contract import Box, Shard

__all__ = ["Placement", "flat_boxes", "place", "placements_of"]


def flat_boxes(
    shape: Sequence[int], lo: int, hi: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements ``lo .. hi`` of a row-major ``shape`` as ``(offsets, sizes)`` boxes, in order."""
    shape = tuple(shape)
    if hi <= lo:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = (0,) * (len(shape) - 1)
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if lo % inner:  # a partial first row
        row = lo // inner
        stop = min(hi, (row + 1) * inner)
        out += [((row, *o), (1, *z)) for o, z in flat_boxes(shape[1:], lo - row * inner,
                                                              stop - row * inner)]  # fmt: skip
        lo = stop
    whole = (hi - lo) // inner
    if whole:
        out.append(((lo // inner, *rest), (whole, *shape[1:])))
        lo += whole * inner
    if lo < hi:  # a partial last row
        row = lo // inner
        out += [((row, *o), (1, *z)) for o, z in flat_boxes(shape[1:], 0, hi - lo)]
    return out


@dataclass(frozen=True)
class _Block:
    """One box of the global tensor, held in the local tensor at ``base`` with ``strides``."""

    offsets: tuple[int, ...]  # in the global tensor
    sizes: tuple[int, ...]
    strides: tuple[int, ...]  # in elements of the (contiguous) local tensor
    base: int  # flat index in the local tensor of the block's first element

    def order(self) -> list[int]:
        """Dimensions from the largest stride to the smallest: the order of memory."""
        return sorted(range(len(self.sizes)), key=lambda d: -self.strides[d])

    def before(self, x: int) -> int:
        """How many of the block's elements lie at flat local indices below ``x``."""
        dims = [(self.sizes[d], self.strides[d]) for d in self.order()]
        return _count(x - self.base, dims)


def _count(r: int, dims: list[tuple[int, int]]) -> int:
    """Points ``c`` of the strided box ``dims`` (sizes, strides) with ``sum(c * s) < r``."""
    if r <= 0:
        return 0
    if not dims:
        return 1
    (n, s), rest = dims[0], dims[1:]
    span = sum((m - 1) * t for m, t in rest)
    inner = math.prod(m for m, _ in rest)
    full = min(n, max(0, -(-(r - span) // s)))  # values v with v * s + span < r
    total = full * inner
    if full < n and full * s < r:
        total += _count(r - full * s, rest)
    return total


class Placement:
    """How a local tensor's blocks lie in its global tensor (see the module docstring).

    Args:
        global_shape: The global tensor's shape.
        blocks: The local tensor's blocks.
        local_shape: The local tensor's shape.
    """

    def __init__(
        self, global_shape: Sequence[int], blocks: Sequence[_Block], local_shape: Sequence[int]
    ) -> None:
        self.global_shape = tuple(global_shape)
        self.blocks = tuple(blocks)
        self.local_shape = tuple(local_shape)

    @classmethod
    def of(cls, layout: Shard, local: torch.Tensor, name: str) -> Placement:
        """From a ``Shard`` whose ``Box`` pieces are views of ``local`` (a contiguous tensor)."""
        if not local.is_contiguous():
            raise InvalidArgumentError(f"{name!r}: a sharded parameter must be contiguous")
        ptr = local.untyped_storage().data_ptr()
        blocks = []
        for piece in layout.pieces:
            t = piece.tensor
            if not isinstance(piece, Box) or t.untyped_storage().data_ptr() != ptr:
                raise InvalidArgumentError(
                    f"{name!r}: its layout's pieces must be blocks viewing the parameter's own "
                    "memory to be sharded again by data parallelism"
                )
            block = _Block(piece.offsets, tuple(t.shape), tuple(t.stride()),
                           int(t.storage_offset() - local.storage_offset()))  # fmt: skip
            dims = [(block.sizes[d], block.strides[d]) for d in block.order()]
            for k, (n, s) in enumerate(dims):  # memory order must be lexicographic order
                if n > 1 and s <= sum((m - 1) * u for m, u in dims[k + 1 :]):
                    raise InvalidArgumentError(f"{name!r}: a layout piece overlaps itself")
            blocks.append(block)
        return cls(layout.global_shape, blocks, tuple(local.shape))

    def pieces(self, flat: torch.Tensor, start: int) -> list[Box]:
        """``flat`` (elements ``start ..`` of the local tensor, flattened) as global boxes.

        Each box's tensor is a view of ``flat``.
        """
        if flat.dim() != 1 or not flat.is_contiguous():
            raise InvalidArgumentError("Placement.pieces: a contiguous 1-D range is needed")
        stop = start + flat.numel()
        out: list[Box] = []
        for b in self.blocks:
            order = b.order()
            lo, hi = b.before(start), b.before(stop)
            for o, z in flat_boxes([b.sizes[d] for d in order], lo, hi):
                corner = [0] * len(order)
                sizes = [0] * len(order)
                for k, d in enumerate(order):
                    corner[d], sizes[d] = o[k], z[k]
                at = b.base + sum(c * s for c, s in zip(corner, b.strides, strict=True)) - start
                view = flat.as_strided(sizes, b.strides, flat.storage_offset() + at)
                offsets = tuple(g + c for g, c in zip(b.offsets, corner, strict=True))
                out.append(Box(view, offsets))
        return out

    def shard(self, flat: torch.Tensor, start: int) -> Shard:
        """``flat`` as a ``Shard`` of the global tensor (``pieces``)."""
        return Shard(self.global_shape, self.pieces(flat, start))


def place(
    placement: Placement | None, flat: torch.Tensor, start: int, shape: Sequence[int]
) -> Shard:
    """Elements ``start ..`` of a local tensor of ``shape`` (``flat``, any shape of that many).

    Through ``placement`` (boxes of the global tensor), or as one flat range of the local one.
    """
    if placement is None:
        return Shard.flat(flat, shape, start)
    return placement.shard(flat.reshape(-1), start)


def placements_of(module: torch.nn.Module) -> dict[str, Placement]:
    """Each parameter of ``module`` that is a slice of a bigger tensor, with its placement.

    Read from the module's strategy contract (``contract.param_layouts``): a parameter whose
    layout is a ``Shard`` (a tensor-parallel weight). Call it while the parameters hold their
    values (before a wrapper frees them).
    """
    layouts = contract.param_layouts(module)
    params = dict(module.named_parameters())
    return {
        name: Placement.of(value, params[name], name)
        for name, value in layouts.items()
        if isinstance(value, Shard) and name in params
    }
