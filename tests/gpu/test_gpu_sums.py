"""Deterministic mode's Triton sums on a GPU: the tree's bits, and sums that ignore the batch.

``comm.tree_cuda`` adds a tree in one launch and must give the bits of the elementwise adds
(``tree._torch_tree``), which other ranks' trees use; ``gpu_rows`` sums a unit's rows the same
way whatever the number of units and the width (a column layer's slice of the features);
``gpu_products`` makes a unit's weight gradient with the same bits whatever the number of units
and the outputs asked for, and its tree gives the elementwise adds' bits over them. The trees'
roundings made in their launch equal ``Tensor.to``'s, and a bias's tree made by its weight's
launch has ``row_sums``' bits.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the GPU host)", allow_module_level=True)
triton = pytest.importorskip("triton", reason="needs Triton (torch's CUDA builds install it)")

from shardline.comm import tree, tree_cuda  # noqa: E402
from shardline.comm.tree_cuda import tree_sum_into  # noqa: E402
from shardline.parallel.deterministic import (  # noqa: E402
    collector,
    gpu_products,
    gpu_rows,
    layers,
    make_deterministic,
)
from shardline.parallel.deterministic.gpu_rows import norm_sums, row_sums  # noqa: E402
from shardline.parallel.deterministic.split import column_input_grad, row_output  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("width", [1, 33, 1000, (1 << 20) + 3])
def test_the_one_launch_tree_gives_the_elementwise_adds_bits(n: int, width: int) -> None:
    parts = torch.randn(n, width, device="cuda", generator=torch.Generator("cuda").manual_seed(n))
    want = tree._torch_tree(parts.clone())
    assert torch.equal(_bits(tree_sum_into(parts.clone())), _bits(want))
    assert torch.equal(_bits(tree.tree_sum(parts.clone(), fresh=True)), _bits(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_sums_ignore_the_batch_and_the_width(dtype: torch.dtype) -> None:
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(16, 512, 1024, device="cuda", generator=g).to(dtype)
    full = row_sums(x)
    want = x.double().sum(1)
    assert (full.double() - want).abs().max() <= 1e-5 * want.abs().max()
    for b in (8, 4, 2, 1):
        assert torch.equal(_bits(row_sums(x[:b])), _bits(full[:b]))
    assert torch.equal(_bits(row_sums(x[:, :, 256:768])), _bits(full[:, 256:768]))
    assert torch.equal(_bits(row_sums(x[:, :, :3])), _bits(full[:, :3]))
    assert torch.equal(_bits(row_sums(x)), _bits(full))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_sums_ignore_the_batch(dtype: torch.dtype) -> None:
    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(16, 512, 1024, device="cuda", generator=g).to(dtype).float()
    dy = torch.randn(16, 512, 1024, device="cuda", generator=g).to(dtype)
    _, mean, rstd = torch.native_layer_norm(x, [1024], None, None, 1e-5)
    dw, db = norm_sums(x, mean, rstd, dy, [1024], 16, True, True)
    assert dw is not None and db is not None
    want_w = ((x.double() - mean.double()) * rstd.double() * dy.double()).sum(1)
    want_b = dy.double().sum(1)
    assert (dw.double() - want_w).abs().max() <= 1e-5 * want_w.abs().max()
    assert (db.double() - want_b).abs().max() <= 1e-5 * want_b.abs().max()
    for b in (8, 4, 1):
        w, bias = norm_sums(x[:b], mean[:b], rstd[:b], dy[:b], [1024], b, True, True)
        assert w is not None and bias is not None
        assert torch.equal(_bits(w), _bits(dw[:b])) and torch.equal(_bits(bias), _bits(db[:b]))
    none, only = norm_sums(x, mean, rstd, dy, [1024], 16, False, True)
    assert none is None and only is not None and torch.equal(_bits(only), _bits(db))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_sums_ignore_the_batch_and_the_ranks(dtype: torch.dtype) -> None:
    """Tensor parallelism's cut sums on a GPU: a rank's blocks then the ranks' tree give one
    process's bits, and a sample's rows do not depend on the batch around it."""
    g = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(8, 512, 1024, device="cuda", generator=g).to(dtype)
    w = (torch.randn(256, 1024, device="cuda", generator=g) * 0.02).to(dtype)
    whole = row_output(x, w, 4)
    for t in (2, 4):
        cols = 1024 // t
        parts = [row_output(x[..., r * cols : (r + 1) * cols], w[:, r * cols : (r + 1) * cols],
                            4 // t) for r in range(t)]  # fmt: skip
        assert torch.equal(_bits(tree.tree_sum(torch.stack(parts))), _bits(whole))
    for b in (4, 1):
        assert torch.equal(_bits(row_output(x[:b], w, 4)), _bits(whole[:b]))
    dy = torch.randn(8, 512, 256, device="cuda", generator=g).to(dtype)
    wc = (torch.randn(256, 1024, device="cuda", generator=g) * 0.02).to(dtype)
    grad = column_input_grad(dy, wc, 1, 4)
    for b in (4, 1):
        assert torch.equal(_bits(column_input_grad(dy[:b], wc, 1, 4)), _bits(grad[:b]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("units", [1, 2, 3, 5, 7, 8, 16])
def test_unit_products_tree_gives_the_elementwise_adds_bits(dtype: torch.dtype, units: int) -> None:
    g = torch.Generator("cuda").manual_seed(units)
    dys = torch.randn(units, 70, 300, device="cuda", generator=g).to(dtype)
    xs = torch.randn(units, 70, 200, device="cuda", generator=g).to(dtype)
    per = gpu_products.products(dys, xs, 0, 300, tree=False)
    assert per.dtype == torch.float32
    # float32 products of bf16 values are exact: only the accumulation rounds
    want = torch.bmm(dys.double().transpose(1, 2), xs.double())
    torch.testing.assert_close(per.double(), want, rtol=1e-5, atol=1e-5)
    summed = gpu_products.products(dys, xs, 0, 300, tree=True)
    assert torch.equal(_bits(summed), _bits(tree._torch_tree(per.clone())))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_units_product_ignores_the_batch_and_the_outputs_asked_for(dtype: torch.dtype) -> None:
    g = torch.Generator("cuda").manual_seed(0)
    dys = torch.randn(16, 512, 1024, device="cuda", generator=g).to(dtype)
    xs = torch.randn(16, 512, 768, device="cuda", generator=g).to(dtype)
    per = gpu_products.products(dys, xs, 0, 1024, tree=False)
    for units in (8, 2, 1):  # fewer units a rank
        got = gpu_products.products(dys[:units], xs[:units], 0, 1024, tree=False)
        assert torch.equal(_bits(got), _bits(per[:units]))
    # a block of a tied weight's outputs, a column layer's slice
    assert torch.equal(
        _bits(gpu_products.products(dys, xs, 100, 701, tree=False)), _bits(per[:, 100:701])
    )
    eight = gpu_products.products(dys[8:], xs[8:], 100, 701, tree=True)
    assert torch.equal(_bits(eight), _bits(tree._torch_tree(per[8:, 100:701].clone())))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("units", [1, 2, 8, 16, 64])
def test_row_and_norm_trees_give_the_elementwise_adds_bits(dtype: torch.dtype, units: int) -> None:
    g = torch.Generator("cuda").manual_seed(units)
    dys = torch.randn(units, 64, 1000, device="cuda", generator=g).to(dtype)
    per = row_sums(dys)
    assert torch.equal(_bits(row_sums(dys, tree=True)), _bits(tree._torch_tree(per.clone())))
    x = torch.randn(units, 64, 1000, device="cuda", generator=g).to(dtype)
    _, mean, rstd = torch.native_layer_norm(x.float(), [1000], None, None, 1e-5)
    w, b = norm_sums(x, mean, rstd, dys, [1000], units, True, True)
    tw, tb = norm_sums(x, mean, rstd, dys, [1000], units, True, True, tree=True)
    assert torch.equal(_bits(tw), _bits(tree._torch_tree(w.clone())))
    assert torch.equal(_bits(tb), _bits(tree._torch_tree(b.clone())))
    # a bias's only use: the tree in one launch, the sum_uses gives the parameter
    use = collector.Rows(lambda t, _: (row_sums(dys, tree=t), None), gpu_rows.tree_fits(units))
    grad = collector.sum_uses(torch.empty(1000, device="cuda"), [use])
    assert torch.equal(_bits(grad), _bits(tree.tree_sum(per, fresh=True)))


def test_trees_in_one_launch_take_what_fits() -> None:
    assert [gpu_rows.tree_fits(n) for n in (1, 2, 3, 6, 64, 128)] == [
        True, True, False, False, True, False
    ]  # fmt: skip
    dys = torch.randn(6, 4, 32, device="cuda")
    with pytest.raises(ValueError, match="power of two"):
        row_sums(dys, tree=True)
    use = collector.Rows(lambda t, _: (row_sums(dys, tree=t), None), gpu_rows.tree_fits(6))
    grad = collector.sum_uses(torch.empty(32, device="cuda"), [use])  # sums, then the tree
    assert torch.equal(_bits(grad), _bits(tree.tree_sum(row_sums(dys), fresh=True)))
    # more units than a products tree in one launch takes: per-unit products, then the tree
    many = gpu_products.MAX_UNITS * 2
    dys, xs = (torch.randn(many, 8, n, device="cuda").bfloat16() for n in (16, 4))
    use = collector.Products(dys, xs)
    assert use.gpu and not use.tree_fits
    grad = collector.sum_uses(torch.empty(16, 4, device="cuda"), [use])
    per = gpu_products.products(dys, xs, 0, 16, tree=False)
    assert torch.equal(_bits(grad), _bits(tree.tree_sum(per, fresh=True)))


def test_a_kernel_that_fails_to_build_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Triton failing at its first launch (no C compiler, say) leaves the trees of adds."""

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(tree, "_CUDA", [])
    monkeypatch.setattr(layers, "_GPU_ROWS", [])
    monkeypatch.setattr(tree_cuda, "tree_sum_into", broken)
    monkeypatch.setattr(gpu_rows, "row_sums", broken)
    monkeypatch.setattr(collector, "_GPU_PRODUCTS", [])
    monkeypatch.setattr(gpu_products, "products", broken)
    parts = torch.randn(4, 100, device="cuda")
    with pytest.warns(UserWarning, match="tree kernel failed to build"):
        got = tree.tree_sum(parts.clone(), fresh=True)
    assert torch.equal(_bits(got), _bits(tree._torch_tree(parts)))
    dys = torch.randn(2, 8, 16, device="cuda")
    with pytest.warns(UserWarning, match="row-sum kernels failed to build"):
        sums = layers._per_unit_sum(dys)
    assert torch.equal(_bits(sums), _bits(tree.tree_sum(dys, dim=1)))
    dys, xs = (torch.randn(2, 8, n, device="cuda").bfloat16() for n in (16, 4))
    with pytest.warns(UserWarning, match="per-unit product kernel failed to build"):
        use = collector.Products(dys, xs)
    assert not use.gpu and use.dtype == torch.bfloat16
    assert torch.equal(use.rows(0, 16, None), torch.bmm(dys.transpose(1, 2), xs))


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("units", [1, 2, 8])
def test_the_trees_rounded_in_their_launch_are_tensor_to(low: torch.dtype, units: int) -> None:
    """``rounded``: each tree's float32 sum rounded as ``Tensor.to`` rounds, in its launch."""
    g = torch.Generator("cuda").manual_seed(units)
    dys, xs = (torch.randn(units, 96, n, device="cuda", generator=g).to(low) for n in (200, 72))
    r = torch.empty(200, 72, dtype=low, device="cuda")
    whole = gpu_products.products(dys, xs, 0, 200, tree=True, rounded=r)
    assert torch.equal(_bits(whole), _bits(gpu_products.products(dys, xs, 0, 200, tree=True)))
    assert torch.equal(r, whole.to(low))
    r = torch.empty(200, dtype=low, device="cuda")
    sums = row_sums(dys, tree=True, rounded=r)
    assert torch.equal(r, sums.to(low))
    x = torch.randn(units, 96, 200, device="cuda", generator=g).to(low)
    _, mean, rstd = torch.native_layer_norm(x.float(), [200], None, None, 1e-5)
    r = torch.empty(2, 200, dtype=low, device="cuda")
    w, b = norm_sums(x, mean, rstd, dys, [200], units, True, True, tree=True, rounded=r)
    assert torch.equal(r, torch.stack([w, b]).to(low))
    if units > 1:
        parts = torch.randn(units, 1000, device="cuda", generator=g)
        r = torch.empty(1000, dtype=low, device="cuda")
        sums = tree_sum_into(parts.clone(), rounded=r)
        assert torch.equal(r, sums.to(low))


def test_a_low_precision_parameters_gradient_comes_rounded_from_the_launch() -> None:
    """``sum_uses`` of a bf16 weight: the float32 tree rounded (and kept where wanted)."""
    g = torch.Generator("cuda").manual_seed(5)
    dys, xs = (torch.randn(8, 64, n, device="cuda", generator=g).bfloat16() for n in (48, 40))
    weight = torch.empty(48, 40, dtype=torch.bfloat16, device="cuda")
    want = gpu_products.products(dys, xs, 0, 48, tree=True)
    grad = collector.sum_uses(weight, [collector.Products(dys, xs)])
    assert grad.dtype == torch.bfloat16 and torch.equal(grad, want.to(torch.bfloat16))
    collector.keep_wide([weight])
    grad = collector.sum_uses(weight, [collector.Products(dys, xs)])
    wide = collector.wide_grad(weight)
    assert wide is not None and torch.equal(_bits(wide), _bits(want))
    assert torch.equal(grad, want.to(torch.bfloat16))
    bias = torch.empty(48, dtype=torch.bfloat16, device="cuda")
    grad = collector.sum_uses(bias, [layers._bias_use(dys, None)])
    assert torch.equal(grad, row_sums(dys, tree=True).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("units", [1, 2, 8, 16])
def test_a_bias_tree_from_its_weights_launch_has_the_row_sums_bits(
    dtype: torch.dtype, units: int
) -> None:
    """``products(bias=...)``: the bias's tree by extra programs of the weight's launch."""
    g = torch.Generator("cuda").manual_seed(units)
    dys, xs = (torch.randn(units, 96, n, device="cuda", generator=g).to(dtype) for n in (700, 72))
    bias, b_low = torch.empty(700, device="cuda"), torch.empty(700, dtype=dtype, device="cuda")
    w_low = torch.empty(700, 72, dtype=dtype, device="cuda")
    w = gpu_products.products(dys, xs, 0, 700, tree=True, rounded=w_low, bias=bias,
                              bias_rounded=b_low)  # fmt: skip
    assert torch.equal(_bits(w), _bits(gpu_products.products(dys, xs, 0, 700, tree=True)))
    assert torch.equal(_bits(bias), _bits(row_sums(dys, tree=True)))
    assert torch.equal(b_low, bias.to(dtype)) and torch.equal(w_low, w.to(dtype))
    part = torch.empty(599, device="cuda")  # a column layer's slice of the outputs
    gpu_products.products(dys, xs, 100, 699, tree=True, bias=part)
    assert torch.equal(_bits(part), _bits(row_sums(dys[:, :, 100:699], tree=True)))


def test_a_linear_layers_bias_from_its_weights_launch_trains_to_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bf16 ``nn.Linear``'s gradients through the fused launch equal the two launches'."""
    torch.manual_seed(0)
    layer = make_deterministic(torch.nn.Linear(64, 48).cuda().bfloat16())
    x = torch.randn(8, 32, 64, device="cuda").bfloat16()

    def grads() -> list[torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        layer(x).float().square().sum().backward()
        return [p.grad.clone() for p in layer.parameters()]  # type: ignore[union-attr]

    fused = grads()
    alone = layers._bias_use
    monkeypatch.setattr(layers, "_bias_use", lambda dys, split, weight=None: alone(dys, split))
    for a, b in zip(fused, grads(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
