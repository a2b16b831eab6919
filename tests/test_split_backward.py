"""The zero-bubble backward split: input pass, then weight pass, equals one backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardline.parallel.pipeline.split_backward import input_pass, weight_pass


def _stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.GELU(),
        nn.Linear(8, 5),
    )  # fmt: skip


@pytest.mark.parametrize("batch", [(4,), (2, 3)], ids=["2d", "3d"])
def test_input_then_weight_pass_equals_one_backward(
    batch: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(*batch, 6)
    grad = torch.randn(*batch, 5)
    ref = _stage()
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(grad)

    mine = _stage()
    xm = x.clone().requires_grad_(True)
    out = mine(xm)
    params = list(mine.parameters())
    (g_in,), state = input_pass([out], [grad], [xm], params)
    assert all(p.grad is None for p in params)  # the input pass computed no weight gradient
    torch.testing.assert_close(g_in, xr.grad)
    # Every parameter hangs off a node on the input's path: the weight pass needs no backward
    # from the output again.
    assert not state.rest and state.nodes
    calls = []
    grad_fn = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or grad_fn(*a, **k))
    weight_pass([out], [grad], state)
    # The linears (with a bias or without) and the norm take the direct path: no autograd.
    assert not calls
    for (name, p), q in zip(mine.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_parameter_off_the_input_path_still_gets_its_gradient() -> None:
    bias = nn.Parameter(torch.randn(3))
    scale = nn.Parameter(torch.randn(3))
    x = torch.randn(2, 3, requires_grad=True)
    out = x * 2 + (scale * bias).tanh()  # scale and bias never meet x
    (g_in,), state = input_pass([out], [torch.ones(2, 3)], [x], [scale, bias])
    torch.testing.assert_close(g_in, torch.full((2, 3), 2.0))
    weight_pass([out], [torch.ones(2, 3)], state)
    expect_scale = 2 * (1 - (scale * bias).tanh() ** 2) * bias
    torch.testing.assert_close(scale.grad, expect_scale.detach())


def test_several_inputs_and_outputs_one_passed_through() -> None:
    """A stage that takes (h, e) and gives (h', e): the residual e passes through unchanged
    and also feeds h'. Both passes together equal one backward from both outputs."""
    torch.manual_seed(1)
    lin = nn.Linear(4, 4)
    h, e = torch.randn(3, 4), torch.randn(3, 4)
    gh, ge = torch.randn(3, 4), torch.randn(3, 4)

    hr, er = h.clone().requires_grad_(True), e.clone().requires_grad_(True)
    torch.autograd.backward([lin(hr).tanh() + er, er], [gh, ge])
    want = [p.grad.clone() for p in lin.parameters() if p.grad is not None]
    lin.zero_grad(set_to_none=True)

    hm, em = h.clone().requires_grad_(True), e.clone().requires_grad_(True)
    outs = [lin(hm).tanh() + em, em]
    got, state = input_pass(outs, [gh, ge], [hm, em], list(lin.parameters()))
    torch.testing.assert_close(got[0], hr.grad)
    torch.testing.assert_close(got[1], er.grad)  # ge through the pass-through, gh through h'
    weight_pass(outs, [gh, ge], state)
    for p, w in zip(lin.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w)


def test_other_weight_nodes_take_autograds_path() -> None:
    """A convolution and an elementwise scale on the input's path are weight nodes with no
    direct formula: the weight pass runs autograd from them, and still equals one backward."""
    torch.manual_seed(2)
    conv, scale = nn.Conv1d(2, 3, 3), nn.Parameter(torch.randn(3, 1))
    x, grad = torch.randn(4, 2, 8), torch.randn(4, 3, 6)
    xr = x.clone().requires_grad_(True)
    (conv(xr) * scale).backward(grad)
    want = [t.grad.clone() for t in (*conv.parameters(), scale) if t.grad is not None]
    for t in (*conv.parameters(), scale):
        t.grad = None
    xm = x.clone().requires_grad_(True)
    out = conv(xm) * scale
    params = [*conv.parameters(), scale]
    (g_in,), state = input_pass([out], [grad], [xm], params)
    assert {type(node).__name__ for node, _ in state.nodes} >= {"ConvolutionBackward0"}
    torch.testing.assert_close(g_in, xr.grad)
    weight_pass([out], [grad], state)
    for t, w in zip(params, want, strict=True):
        torch.testing.assert_close(t.grad, w)
