"""Deterministic mode's attention routing (``parallel.deterministic.attention``), on CPU.

On a GPU the mode runs ``scaled_dot_product_attention`` on the memory-efficient kernel with a
fixed backward (its bits are checked by ``tests/gpu/test_deterministic_cuda.py``). Here, where
that kernel does not exist, the same path falls back to the math backend: it must give
exactly what the math backend gives alone, whatever way the model calls the function, also
through a second backward, and leave torch's deterministic-algorithms setting as it was.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardline.parallel.deterministic import attention
from shardline.parallel.deterministic.attention import DeterministicAttention

_sdpa = torch._C._nn.scaled_dot_product_attention  # what F's name refers to


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, 16, 8, generator=g, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("call", [F.scaled_dot_product_attention, _sdpa])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_in_the_mode_is_the_math_backends_where_no_fused_kernel_runs(
    call: object, causal: bool
) -> None:
    q, k, v = _inputs()
    dout = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(1))
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    with DeterministicAttention():
        got = call(q, k, v, is_causal=causal)  # type: ignore[operator]
    assert got.grad_fn is not None
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), want_grads, strict=True):
        assert torch.equal(a, b)
    # Without grad, nothing to route: the forward alone.
    with torch.no_grad(), DeterministicAttention():
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=causal), want)


def test_a_second_backward_through_the_attention_adds_the_same_gradients_again() -> None:
    q, k, v = _inputs()
    with sdpa_kernel(SDPBackend.MATH):
        want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v).square().sum(), q)[0]
    with DeterministicAttention():
        loss = F.scaled_dot_product_attention(q, k, v).square().sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert q.grad is not None and torch.equal(q.grad, want * 2)
    assert not torch.are_deterministic_algorithms_enabled()


def test_the_setting_a_failed_backward_left_on_is_restored_by_the_next_forward() -> None:
    """The kernel's node turns deterministic algorithms on before its backward, off after;
    a backward that raised in between leaves them on until the mode is entered again."""
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        attention._fix(None)  # the node's pre-hook; its backward then raised
        assert torch.are_deterministic_algorithms_enabled()
        with DeterministicAttention():
            assert not torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)  # the user's own choice
        attention._fix(None)
        attention._unfix(None, None)
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


class _FakeEfficientAttention(torch.autograd.Function):
    """A node named as the memory-efficient kernel's (``...EfficientAttentionBackward``)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g * 2


def test_the_kernels_node_is_found_behind_single_input_nodes_only() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    out = _FakeEfficientAttention.apply(x)
    assert attention._kernel_node(out) is out.grad_fn
    sliced = out[:, :6].transpose(0, 1)  # what a padded head size's output goes through
    assert attention._kernel_node(sliced) is out.grad_fn
    assert attention._kernel_node(out + x) is None  # two inputs: not followed
    assert attention._kernel_node(x.exp()) is None
    assert attention._kernel_node(out[:, :6].t().exp().sin(), depth=3) is None
