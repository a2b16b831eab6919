"""Deterministic mode's GPU kernels on CPU, under Triton's interpreter: their trees and slices.

The interpreter runs a kernel's code with numpy, so the bits are not the GPU's; what it checks
anywhere Triton is installed is the kernels' logic: the binary counter's tree over any number
of units (``tree_cuda.push``, ``fold``) is the canonical tree (``tree._torch_tree``) of the same
kernel's per-unit results (``gpu_products``' products, ``gpu_rows``' row and norm sums); the
masks at the edges of the rows, outputs and inputs and at a slice of the outputs; that a
unit's product does not change with the number of units; the trees' roundings to a lower
precision made in their launch (``rounded``), which equal ``Tensor.to``'s; and a linear
layer's bias's tree made by its weight's launch, which equals ``row_sums``'. The GPU's bits are
checked by ``tests/gpu/test_gpu_sums.py``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Looked for, not imported: Triton imported here reports leaks when pytest exits.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="needs Triton (installed with torch's CUDA builds)",
)

_CHECK = textwrap.dedent(
    """
    import torch
    from shardline.comm import tree
    from shardline.parallel.deterministic import gpu_products as gp, gpu_rows as gr

    def bits(t):
        return t.contiguous().view(torch.int32)

    g = torch.Generator().manual_seed(0)
    # (units, rows, outputs, inputs): a partial K block, edges of both tiles, one unit,
    # trees that are not perfect (3, 5, 6, 7)
    for units, rows, outs, ins in [(8, 40, 70, 33), (6, 17, 64, 64), (7, 32, 5, 130),
                                   (1, 3, 9, 9), (5, 64, 65, 20), (3, 8, 8, 8)]:
        d = torch.randn(units, rows, outs, generator=g).half()
        x = torch.randn(units, rows, ins, generator=g).half()
        per = gp.products(d, x, 0, outs, tree=False)
        want = torch.bmm(d.double().transpose(1, 2), x.double())
        torch.testing.assert_close(per.double(), want, rtol=1e-5, atol=1e-5)
        whole = gp.products(d, x, 0, outs, tree=True)
        assert torch.equal(bits(whole), bits(tree._torch_tree(per.clone()))), units
        # A slice of the outputs: the masks and offsets (the interpreter's products are
        # numpy's, whose bits may follow a value's place in the tile, as the GPU's do not)
        lo, hi = outs // 3, outs - 1
        close = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gp.products(d, x, lo, hi, tree=False), per[:, lo:hi], **close)
        torch.testing.assert_close(gp.products(d, x, lo, hi, tree=True), whole[lo:hi], **close)
        r = torch.empty(outs, ins, dtype=torch.half)  # the tree rounded in the same launch
        assert torch.equal(bits(gp.products(d, x, 0, outs, tree=True, rounded=r)), bits(whole))
        assert torch.equal(r, whole.half())
        if units & (units - 1) == 0:  # a bias's tree by the same launch: row_sums' bits
            bias, b_low, w_low = torch.empty(outs), torch.empty(outs).half(), torch.empty_like(r)
            w = gp.products(d, x, 0, outs, tree=True, rounded=w_low, bias=bias, bias_rounded=b_low)
            assert torch.equal(bits(w), bits(whole)) and torch.equal(w_low, r)
            assert torch.equal(bits(bias), bits(gr.row_sums(d, tree=True)))
            assert torch.equal(b_low, bias.half())
            part = torch.empty(hi - lo)
            gp.products(d, x, lo, hi, tree=True, bias=part)
            assert torch.equal(bits(part), bits(gr.row_sums(d[:, :, lo:hi], tree=True)))
        few = max(1, units // 2)
        assert torch.equal(bits(gp.products(d[:few], x[:few], 0, outs, tree=False)),
                           bits(per[:few]))
    for units, rows, width in [(8, 19, 300), (2, 8, 129), (4, 3, 5), (1, 9, 64), (16, 16, 200)]:
        d = torch.randn(units, rows, width, generator=g)
        per = gr.row_sums(d)
        assert torch.equal(bits(gr.row_sums(d, tree=True)), bits(tree._torch_tree(per.clone())))
        x, dy = (torch.randn(units * rows, width, generator=g) for _ in range(2))
        mean, rstd = x.mean(1), 1 / x.std(1)
        w, b = gr.norm_sums(x, mean, rstd, dy, [width], units, True, True)
        want = ((x - mean[:, None]) * rstd[:, None] * dy).reshape(units, rows, width).sum(1)
        torch.testing.assert_close(w, want, rtol=1e-5, atol=1e-5)
        tw, tb = gr.norm_sums(x, mean, rstd, dy, [width], units, True, True, tree=True)
        assert torch.equal(bits(tw), bits(tree._torch_tree(w.clone())))
        assert torch.equal(bits(tb), bits(tree._torch_tree(b.clone())))
        none, alone = gr.norm_sums(x, mean, rstd, dy, [width], units, False, True, tree=True)
        assert none is None and torch.equal(bits(alone), bits(tb))
        r = torch.empty(width, dtype=torch.half)  # rounded in the trees' launch
        assert torch.equal(bits(gr.row_sums(d, tree=True, rounded=r)), bits(tree._torch_tree(per)))
        assert torch.equal(r, gr.row_sums(d, tree=True).half())
        r = torch.empty(2, width, dtype=torch.half)
        gr.norm_sums(x, mean, rstd, dy, [width], units, True, True, tree=True, rounded=r)
        assert torch.equal(r, torch.stack([tw, tb]).half())
        r = torch.empty(1, width, dtype=torch.half)
        gr.norm_sums(x, mean, rstd, dy, [width], units, False, True, tree=True, rounded=r)
        assert torch.equal(r[0], tb.half())
    print("checked")
    """
)


@pytest.mark.timeout(120)
def test_the_kernels_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT)])}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=110,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "checked" in proc.stdout, proc.stdout + proc.stderr
