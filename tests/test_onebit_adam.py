"""1-bit Adam: torch's Adam on the averaged gradient until the freeze, then compressed momenta
with a frozen variance; replicas stay identical and the bytes drop."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.optim import OneBitAdam
from tests._ranks import run_ranks

pytestmark = pytest.mark.usefixtures("native")

_INIT = threading.Lock()
IN, OUT = 32, 8
TEACHER = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(2)) / IN**0.5


def mlp() -> nn.Module:
    with _INIT:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN, 64), nn.Tanh(), nn.Linear(64, OUT))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, IN, generator=g)
    return x, torch.tanh(x @ TEACHER)


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return nn.functional.mse_loss(model(x), y)


def test_before_the_freeze_it_is_ddp_with_torch_adam() -> None:
    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        mine = mlp()
        opt = OneBitAdam(mine.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=100, group=g)
        ref = mlp()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=0.01)
        ddp, _ = sl.distribute(ref, ref_opt, strategy="ddp", group=g)
        for step in range(8):
            for model, o in ((mine, opt), (ddp, ref_opt)):
                o.zero_grad()
                loss_of(model, step, g.rank).backward()
                o.step()
        return mine.state_dict(), ref.state_dict()

    for got, want in run_ranks(3, body):
        for k, value in want.items():
            torch.testing.assert_close(got[k], value, rtol=1e-6, atol=1e-7, msg=k)


def test_after_the_freeze_the_variance_stays_replicas_agree_and_it_keeps_learning() -> None:
    steps, freeze = 80, 10

    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], bool, float, float, float, int]:
        model = mlp()
        opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=freeze, group=g)
        ref = mlp()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        ddp, _ = sl.distribute(ref, ref_opt, strategy="ddp", group=g)
        frozen_v: list[torch.Tensor] = []
        losses, ref_losses = [], []
        for step in range(steps):
            if step == freeze:
                frozen_v = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
                g.reset_traffic()
            for m, o, out in ((model, opt, losses), (ddp, ref_opt, ref_losses)):
                o.zero_grad()
                loss = loss_of(m, step, g.rank)
                loss.backward()
                o.step()
                out.append(float(loss.detach()))
        still = all(
            torch.equal(opt.state[p]["exp_avg_sq"], v)
            for p, v in zip(model.parameters(), frozen_v, strict=True)
        )
        moved = sum(r["sent"] for op, r in g.traffic().items() if op != "all_reduce")
        start = sum(losses[:5]) / 5
        return (
            model.state_dict(),
            still,
            start,
            sum(losses[-10:]) / 10,
            sum(ref_losses[-10:]) / 10,
            moved,
        )

    results = run_ranks(3, body)
    for sd, still, start, end, ref_end, _ in results:
        assert still
        assert end < 0.3 * start
        assert end < 1.5 * ref_end, (end, ref_end)
        for k, value in results[0][0].items():
            torch.testing.assert_close(sd[k], value, rtol=0, atol=0, msg=k)
    numel = sum(p.numel() for p in mlp().parameters())
    dense = (steps - freeze) * 2 * (3 - 1) / 3 * 4 * numel  # a ring all-reduce per step
    assert results[0][5] < dense / 20  # DDP's all-reduces excluded; ours: all_to_all + gather


def test_a_resumed_run_continues_exactly_after_the_freeze() -> None:
    """state_dict carries the moments, the step count and this rank's residuals."""
    freeze, cut, steps = 4, 7, 12

    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        def train(model: nn.Module, opt: OneBitAdam, begin: int, end: int) -> None:
            for step in range(begin, end):
                opt.zero_grad()
                loss_of(model, step, g.rank).backward()
                opt.step()

        model = mlp()
        opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=freeze, group=g)
        train(model, opt, 0, cut)
        saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        train(model, opt, cut, steps)
        resumed = mlp()
        ropt = OneBitAdam(resumed.parameters(), lr=1e-2, freeze_step=freeze, group=g)
        resumed.load_state_dict(saved[0])
        ropt.load_state_dict(saved[1])
        assert ropt.frozen
        train(resumed, ropt, cut, steps)
        return model.state_dict(), resumed.state_dict()

    for straight, resumed in run_ranks(3, body):
        for k, value in straight.items():
            torch.testing.assert_close(resumed[k], value, rtol=0, atol=0, msg=k)


def test_bad_arguments_are_refused() -> None:
    def body(g: ProcessGroup) -> None:
        with pytest.raises(InvalidArgumentError, match="freeze_step"):
            OneBitAdam(mlp().parameters(), freeze_step=0, group=g)

    run_ranks(1, body)
