"""``parallel.placement``: a flat range of a local tensor mapped into its global tensor.

Against an independent reference: the local tensor holds its own flat indices, the global
tensor is built by placing the local block at its offsets, and each returned box must read
the same values there; together the boxes must hold exactly the block's elements inside the
flat range, once each. Blocks are sub-blocks of the local tensor, transposed or not.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.parallel.contract import Box, Shard
from shardline.parallel.placement import Placement, flat_boxes

_Case = tuple[torch.Tensor, torch.Tensor, list[int], tuple[int, ...], int, int]


@st.composite
def _cases(
    draw: st.DrawFn,
) -> tuple[torch.Tensor, torch.Tensor, list[int], tuple[int, ...], int, int]:
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    local = torch.arange(math.prod(shape)).view(shape)
    index = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        index.append(slice(a, draw(st.integers(a + 1, n))))
    block = local[tuple(index)]
    if block.dim() >= 2 and draw(st.booleans()):
        block = block.transpose(0, block.dim() - 1)
    global_shape = [s + draw(st.integers(0, 3)) for s in block.shape]
    offsets = tuple(
        draw(st.integers(0, g - s)) for g, s in zip(global_shape, block.shape, strict=True)
    )
    lo = draw(st.integers(0, local.numel()))
    hi = draw(st.integers(lo, local.numel()))
    return local, block, global_shape, offsets, lo, hi


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_a_flat_range_maps_to_the_boxes_holding_it(
    case: _Case,
) -> None:
    local, block, global_shape, offsets, lo, hi = case
    whole = torch.full(global_shape, -1, dtype=torch.long)
    whole[tuple(slice(o, o + n) for o, n in zip(offsets, block.shape, strict=True))] = block
    placement = Placement.of(Shard(global_shape, [Box(block, offsets)]), local, "w")
    flat = local.view(-1)[lo:hi]
    seen: list[int] = []
    for box in placement.pieces(flat, lo):
        region = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.tensor.shape, strict=True))
        assert torch.equal(whole[region], box.tensor)
        assert box.tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        seen += box.tensor.reshape(-1).tolist()
    want = sorted(v for v in block.reshape(-1).tolist() if lo <= v < hi)
    assert sorted(seen) == want
    assert len(seen) == len(set(seen))


@given(st.lists(st.integers(1, 4), min_size=0, max_size=4), st.data())
def test_flat_boxes_tile_the_range_in_order(shape: list[int], data: st.DataObject) -> None:
    total = math.prod(shape)
    lo = data.draw(st.integers(0, total))
    hi = data.draw(st.integers(lo, total))
    ids = torch.arange(total).view(shape)
    got: list[int] = []
    for offsets, sizes in flat_boxes(shape, lo, hi):
        got += (
            ids[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
            .reshape(-1)
            .tolist()
        )
    assert got == list(range(lo, hi))
