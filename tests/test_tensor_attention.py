"""Tensor-parallel ``nn.MultiheadAttention`` against the dense module (ranks are threads).

``ParallelMultiheadAttention`` at t = 2 and 4 gives the dense output, attention weights
(averaged, or per head) and input gradients, with padding and causal masks, batch-first or
not, self- and cross-attention; its weight gradients are the dense ones' slices. A model of
``nn.TransformerEncoderLayer``s under ``tensor_parallel(plan="auto")`` trains as one process
and its checkpoint loads into the dense model.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import checkpoint
from shardline.comm import ProcessGroup
from shardline.parallel.tensor import ParallelMultiheadAttention
from tests._ranks import built_once, run_ranks

TIMEOUT = 120


@built_once
def _pristine_mha(batch_first: bool) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(16, 4, batch_first=batch_first)


def _inputs(batch_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 16, generator=gen)  # (batch, length, embedding)
    mem = torch.randn(3, 7, 16, generator=gen)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True  # the second sequence's last keys are padding
    if not batch_first:
        x, mem = x.transpose(0, 1).contiguous(), mem.transpose(0, 1).contiguous()
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True: not allowed
    return x, mem, pad, causal


def _run(mha: nn.Module, batch_first: bool) -> list[torch.Tensor]:
    x, mem, pad, causal = _inputs(batch_first)
    x, mem = x.requires_grad_(), mem.requires_grad_()
    y1, w1 = mha(x, x, x, attn_mask=causal, need_weights=True)
    y2, w2 = mha(x, mem, mem, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
    y3, _ = mha(x, mem, mem, key_padding_mask=pad, need_weights=False)
    (y1.square().sum() + y2.sum() + 2 * y3.sum()).backward()
    assert x.grad is not None and mem.grad is not None
    return [y1, w1, y2, w2, y3, x.grad, mem.grad]


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("batch_first", [True, False])
def test_parallel_attention_equals_the_dense_module(t: int, batch_first: bool) -> None:
    dense = copy.deepcopy(_pristine_mha(batch_first))
    want = _run(dense, batch_first)
    assert dense.in_proj_weight.grad is not None
    w_grad = dense.in_proj_weight.grad.view(3, t, -1, 16)  # q, k, v; rank; its rows

    def body(g: ProcessGroup) -> tuple[list[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
        mha = ParallelMultiheadAttention.from_dense(copy.deepcopy(_pristine_mha(batch_first)), g)
        got = _run(mha, batch_first)
        assert mha.in_proj_weight.grad is not None
        return got, mha.in_proj_weight.grad, mha.state_dict()

    for rank, (got, grad, state) in enumerate(run_ranks(t, body, timeout=TIMEOUT)):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(grad.view(3, -1, 16), w_grad[:, rank], atol=1e-5, rtol=1e-4)
        assert {k: v.shape for k, v in state.items()} == {
            k: v.shape for k, v in dense.state_dict().items()
        }


@built_once
def _pristine_encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.Embedding(32, 16), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
        nn.Linear(16, 32),
    )  # fmt: skip


def _train(model: nn.Module) -> list[float]:
    # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by
    # all keys): rounding noise, which Adam with a tiny eps turns into full steps; a larger
    # eps keeps it at the noise's size (as in test_tensor_parallel).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 32, (4, 6), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_a_transformer_encoder_trains_as_one_process_under_plan_auto(tmp_path: Path) -> None:
    """plan='auto' splits each encoder layer's attention heads and its MLP (linear1 by
    output, linear2 by input); three AdamW steps equal one process, the state dict is the
    dense one, and the checkpoint loads into the dense model bit for bit."""
    dense = copy.deepcopy(_pristine_encoder())
    want_losses = _train(dense)
    want = dense.state_dict()

    def body(g: ProcessGroup) -> tuple[list[float], dict[str, torch.Tensor], str]:
        model = sl.tensor_parallel(copy.deepcopy(_pristine_encoder()), g)
        losses = _train(model)
        checkpoint.save(tmp_path / "ck", model=model, group=g)
        return losses, model.state_dict(), model.plan()

    results = run_ranks(2, body, timeout=TIMEOUT)
    for losses, state, plan in results:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, msg=key)
        assert "1.layers.0.self_attn: attention" in plan
        assert "1.layers.1.linear1: Colwise" in plan
    plain = copy.deepcopy(_pristine_encoder())
    checkpoint.load(tmp_path / "ck", model=plain)
    for key, value in results[0][1].items():
        assert torch.equal(plain.state_dict()[key], value), key


def test_attention_that_cannot_split_is_refused_by_name() -> None:
    def body(g: ProcessGroup) -> None:
        odd = nn.Sequential(nn.MultiheadAttention(12, 3))
        with pytest.raises(sl.InvalidArgumentError, match="0 has 3 heads"):
            sl.tensor_parallel(odd, g)
        kv = nn.Sequential(nn.MultiheadAttention(8, 2, kdim=4, vdim=4))
        with pytest.raises(sl.InvalidArgumentError, match="kdim/vdim"):
            sl.tensor_parallel(kv, g, plan={"0": "attention"})

    run_ranks(2, body, timeout=TIMEOUT)
