"""Deterministic mode's CPU kernels: per-unit weight gradients, row sums and layer-norm sums.

Each is checked against an independent reference (``torch.bmm`` in float64 for the values, the
definition row by row in float32 for the bits) and for what the layouts rely on: a unit's bits
do not depend on the rows or features asked for (tensor-parallel slices), on the number of
units (a rank's share of the batch) or on the number of threads.
"""

from __future__ import annotations

import functools

import pytest
import torch

from shardline.comm.tree import tree_sum
from shardline.parallel.deterministic.collector import Lookups, Products, _total, sum_uses
from shardline.parallel.deterministic.layers import _LayerNormFn, _per_unit_sum


def _values(*shape: int, seed: int) -> torch.Tensor:
    """Float32 values whose sums depend on the order of the additions (exponents spread)."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return (v * torch.exp2(torch.randint(-8, 8, shape, generator=gen).double())).float()


@pytest.mark.parametrize(("units", "rows", "outs", "ins"), [(16, 64, 96, 40), (3, 300, 17, 5)])
def test_unit_products_are_each_units_product_and_any_slice_has_the_same_bits(
    units: int, rows: int, outs: int, ins: int
) -> None:
    dys, xs = _values(units, rows, outs, seed=1), _values(units, rows, ins, seed=2)
    p = Products(dys, xs)
    assert p.native
    each = p.rows(0, outs, None)
    want = torch.bmm(dys.double().transpose(1, 2), xs.double())
    scale = torch.bmm(dys.double().abs().transpose(1, 2), xs.double().abs())
    assert ((each.double() - want).abs() <= rows * 2.0**-24 * scale).all()  # float32 bound
    # A column-parallel rank's rows of the weight, and a row-parallel rank's input features.
    a, b = outs // 3, outs - 2
    assert torch.equal(p.rows(a, b, None), each[:, a:b])
    assert torch.equal(Products(dys[:, :, a:b], xs).rows(0, b - a, None), each[:, a:b])
    c = ins // 2
    assert torch.equal(Products(dys, xs[:, :, :c]).rows(0, outs, None), each[:, :, :c])
    # The fused sum is the canonical tree over the units' products, bit for bit.
    assert torch.equal(p.summed()[0], tree_sum(each))


def test_a_ranks_share_of_the_units_is_a_subtree_on_any_number_of_threads() -> None:
    units, rows, outs, ins = 16, 32, 128, 64  # enough multiply-adds to use the threads
    dys, xs = _values(units, rows, outs, seed=3), _values(units, rows, ins, seed=4)
    threads = torch.get_num_threads()
    try:
        got = []
        for n in (1, 4):
            torch.set_num_threads(n)
            whole = Products(dys, xs).summed()[0]
            ranks = [Products(dys[r * 4 : (r + 1) * 4], xs[r * 4 : (r + 1) * 4]) for r in range(4)]
            assert torch.equal(tree_sum(torch.stack([p.summed()[0] for p in ranks])), whole)
            got.append(whole)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0], got[1])


def _lookups(units: int, tokens: int, rows: int, width: int, seed: int) -> Lookups:
    """An embedding's lookups of ``rows`` rows: few, so most are read several times a unit."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, rows, (units * tokens,), generator=gen)
    unit = torch.arange(units).repeat_interleave(tokens)
    return Lookups(units, unit, idx, _values(units * tokens, width, seed=seed), rows)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_tied_weights_lookups_are_added_in_the_engines_tree_as_index_add_does(
    threads: int,
) -> None:
    # The output layer's products, then the embedding's lookups (and a second embedding's),
    # added unit by unit in their order, then the tree: the engine in one pass against the
    # rows of each use added (``index_add_``) and ``tree_sum``.
    units, tokens, outs, ins = 8, 32, 24, 40
    weight = torch.zeros(outs, ins)
    dys, xs = _values(units, tokens, outs, seed=5), _values(units, tokens, ins, seed=6)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for given in (
            [Products(dys, xs), _lookups(units, tokens, outs, ins, 7)],
            [
                Products(dys, xs),
                _lookups(units, tokens, outs, ins, 8),
                _lookups(units, 5, outs, ins, 9),
            ],
            [_lookups(units, tokens, outs, ins, 10)],  # an embedding of its own
            [_lookups(units, tokens, outs, ins, 11), _lookups(units, 3, outs, ins, 12)],
        ):
            want = tree_sum(_total(given, 0, outs))
            got = sum_uses(weight, given)
            assert torch.equal(got, want)
            # A rank's share of the units is a subtree.
            halves = [sum_uses(weight, [_half(u, h) for u in given]) for h in range(2)]
            assert torch.equal(tree_sum(torch.stack(halves)), got)
        # An embedding large enough for the threads, alone.
        big = [_lookups(16, 64, 2048, 128, 13)]
        assert torch.equal(sum_uses(torch.zeros(2048, 128), big), tree_sum(_total(big, 0, 2048)))
    finally:
        torch.set_num_threads(saved)


def _half(use: Products | Lookups, h: int) -> Products | Lookups:
    """Units ``[h * n/2, (h + 1) * n/2)`` of ``use``: what a rank of two holds."""
    if isinstance(use, Products):
        n = use.dys.shape[0] // 2
        return Products(use.dys[h * n : (h + 1) * n], use.xs[h * n : (h + 1) * n])
    n = use.units // 2
    mine = (use.unit >= h * n) & (use.unit < (h + 1) * n)
    return Lookups(n, use.unit[mine] - h * n, use.idx[mine], use.dy[mine], use.total)


def test_the_tree_sum_of_long_rows_has_the_same_bits_on_any_number_of_threads() -> None:
    rows = _values(16, 200_000, seed=8)  # long enough to use the threads
    threads = torch.get_num_threads()
    try:
        got = []
        for n in (1, 4):
            torch.set_num_threads(n)
            got.append(tree_sum(rows))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0], got[1])
    assert torch.equal(got[0], tree_sum(torch.stack([tree_sum(rows[:8]), tree_sum(rows[8:])])))


def _rows_in_order(t: torch.Tensor) -> torch.Tensor:
    """Each unit's rows added one after the other, from zero (the definition)."""
    return functools.reduce(torch.add, t.unbind(1), torch.zeros_like(t[:, 0]))


def test_row_sums_add_each_units_rows_in_order_whatever_the_features_beside() -> None:
    dys = _values(4, 37, 3, 19, seed=5)
    sums = _per_unit_sum(dys)
    assert torch.equal(sums, _rows_in_order(dys))
    assert torch.equal(_per_unit_sum(dys[..., 4:11].contiguous()), sums[..., 4:11])
    assert torch.equal(_per_unit_sum(dys[:1]), sums[:1])


def test_layer_norm_sums_are_the_products_added_in_order() -> None:
    units, per, width = 4, 9, 48
    x, dy = _values(units, per, width, seed=6), _values(units, per, width, seed=7)
    weight, bias = torch.ones(width), torch.zeros(width)
    _, mean, rstd = torch.native_layer_norm(x, [width], weight, bias, 1e-5)

    got: list[torch.Tensor] = []

    class Given:  # stands in for the collector: keeps what the layer gives
        units = 4

        def give(self, key: int, use: object) -> None:
            got.append(use.per_unit)  # type: ignore[attr-defined]

    class Ctx:
        saved_tensors = (x, mean, rstd, weight, bias)
        needs_input_grad = (False,)
        shape, c, keys = [width], Given(), (1, 2)

    _LayerNormFn.backward(Ctx(), dy)
    w, b = got
    assert torch.equal(w, _rows_in_order(((x - mean) * rstd) * dy))
    assert torch.equal(b, _rows_in_order(dy))


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_input_gradient_is_torchs_and_its_bits_follow_the_row_alone(
    affine: bool,
) -> None:
    units, per, width = 4, 9, 45
    x, dy = _values(units, per, width, seed=8), _values(units, per, width, seed=9)
    weight = torch.rand(width, generator=torch.Generator().manual_seed(3)) + 0.5
    w, b = (weight, torch.zeros(width)) if affine else (None, None)
    _, mean, rstd = torch.native_layer_norm(x, [width], w, b, 1e-5)

    def dx_of(rows: int) -> torch.Tensor:
        class Ctx:
            saved_tensors = (x[:rows], mean[:rows], rstd[:rows], w, b)
            needs_input_grad = (True,)
            shape, keys = [width], (None, None)

            class c:  # the collector, of which only the units are read here
                units = rows

        got = _LayerNormFn.backward(Ctx(), dy[:rows])[0]
        assert got is not None
        return got

    dx = dx_of(units)
    want = torch.ops.aten.native_layer_norm_backward(
        dy.double(), x.double(), [width], mean.double(), rstd.double(),
        None if w is None else w.double(), None if b is None else b.double(),
        [True, False, False],
    )[0]  # fmt: skip
    torch.testing.assert_close(dx.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(dx_of(1), dx[:1])  # one unit's rows: the same bits
    x = x.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, strided
    assert not x.is_contiguous()
    assert torch.equal(dx_of(units), dx)
