"""Hogwild: ranks of one host step one shared copy of the parameters, with no messages."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.parallel.replica.hogwild import HogwildSGD
from tests._ranks import run_ranks

pytestmark = pytest.mark.usefixtures("native")

_INIT = threading.Lock()


def model() -> nn.Module:
    with _INIT:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def test_one_rank_is_plain_sgd() -> None:
    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        mine, ref = model(), model()
        opt = torch.optim.SGD(mine.parameters(), lr=0.1)
        wrapped, opt = sl.distribute(mine, opt, strategy="hogwild", group=g)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        assert opt is not None
        for step in range(5):
            for m, o in ((wrapped, opt), (ref, ref_opt)):
                x, y = batch(step, 0)
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
        assert isinstance(wrapped, HogwildSGD)
        wrapped.close()
        return wrapped.state_dict(), ref.state_dict()

    ((got, want),) = run_ranks(1, body)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


def test_a_step_on_one_rank_is_seen_by_the_others_without_a_message() -> None:
    def body(g: ProcessGroup) -> list[float]:
        lin = model()
        opt = torch.optim.SGD(lin.parameters(), lr=1.0)
        wrapped, opt = sl.distribute(lin, opt, strategy="hogwild", group=g)
        assert opt is not None and isinstance(wrapped, HogwildSGD)
        before = float(lin[0].bias.detach()[0])
        sent = wrapped.comm_stats()["sent"]
        g.barrier()
        if g.rank == 0:
            lin[0].bias.grad = torch.zeros_like(lin[0].bias)
            lin[0].bias.grad[0] = 1.0
            for p in lin.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            opt.step()
        g.barrier()
        seen = float(lin[0].bias.detach()[0])
        assert wrapped.comm_stats()["sent"] == sent  # the step sent nothing
        wrapped.close()
        return [before, seen]

    for before, seen in run_ranks(3, body):
        assert seen == pytest.approx(before - 1.0)


def test_ranks_train_one_model_and_end_identical(tmp_path: Path) -> None:
    steps = 15

    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], dict[int, int], float, float]:
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        wrapped, opt = sl.distribute(net, opt, strategy="hogwild", group=g)
        assert opt is not None and isinstance(wrapped, HogwildSGD)
        data = [batch(i, 0) for i in range(3)]  # one regression problem for every rank

        def probe() -> float:
            with torch.no_grad():
                return sum(float(nn.functional.mse_loss(net(x), y)) for x, y in data)

        first = probe()
        for step in range(steps):
            x, y = data[step % 3]
            opt.zero_grad()
            nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()
        wrapped.close()
        return wrapped.state_dict(), wrapped.staleness(), first, probe()

    results = run_ranks(3, body)
    for sd, ages, first, last in results:
        assert sum(ages.values()) == steps
        assert last < first
        for k, v in results[0][0].items():
            torch.testing.assert_close(sd[k], v, rtol=0, atol=0, msg=k)
    assert not list(Path("/dev/shm").glob("shardline-*-hogwild-*"))
