"""Asynchronous SGD through the sharded parameter server: staleness 0 is synchronous SGD (DDP
with the same optimizer), the staleness bound holds, stale gradients are dropped, and a slow
rank does not hold the others under ``on_stale="drop"``."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel.replica.async_sgd import AsyncOptimizer, AsyncSGD
from tests._ranks import run_ranks

pytestmark = pytest.mark.usefixtures("native")

_INIT = threading.Lock()
IN, OUT = 10, 4
TEACHER = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(11)) / IN**0.5


def mlp() -> nn.Module:
    with _INIT:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, IN, generator=g)
    return x, torch.tanh(x @ TEACHER)


def train(
    g: ProcessGroup,
    steps: int,
    strategy: str,
    *,
    slow: float = 0.0,
    make_opt: type[torch.optim.Optimizer] = torch.optim.SGD,
    **options: object,
) -> tuple[nn.Module, list[float]]:
    model = mlp()
    hyper = {"lr": 0.1, "momentum": 0.9} if make_opt is torch.optim.SGD else {"lr": 0.01}
    opt = make_opt(model.parameters(), **hyper)
    wrapped, opt = sl.distribute(model, opt, strategy=strategy, group=g, **options)
    assert opt is not None
    losses = []
    for step in range(steps):
        x, y = batch(step, g.rank)
        opt.zero_grad()
        loss = nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        if slow and g.rank == 0:
            time.sleep(slow)
        opt.step()
        losses.append(float(loss.detach()))
    if isinstance(wrapped, AsyncSGD):
        wrapped.close()
    return wrapped, losses


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("make_opt", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
def test_staleness_zero_is_synchronous_sgd(
    servers: int, make_opt: type[torch.optim.Optimizer]
) -> None:
    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], object]:
        ps, _ = train(g, 6, "async", make_opt=make_opt, staleness=0, servers=servers)
        ddp, _ = train(g, 6, "ddp", make_opt=make_opt)
        assert isinstance(ps, AsyncSGD)
        return params(ps), params(ddp), ps.staleness()

    results = run_ranks(3, body)
    for got, want, _ in results:
        for k, value in want.items():
            torch.testing.assert_close(got[k], value, rtol=1e-5, atol=1e-6, msg=k)
    # every gradient applied was computed on the version it was applied to
    assert results[0][2] == {0: 3 * 6}
    assert servers == 1 or results[1][2] == {0: 3 * 6}


def test_no_applied_gradient_is_older_than_the_bound_with_a_slow_rank() -> None:
    def body(g: ProcessGroup) -> tuple[dict[int, int], list[float], int]:
        model, losses = train(g, 12, "async", slow=0.05, staleness=2, on_stale="wait")
        assert isinstance(model, AsyncSGD)
        return model.staleness(), losses, model.dropped

    results = run_ranks(3, body)
    ages = results[0][0]
    assert sum(ages.values()) == 3 * 12  # nothing dropped under "wait"
    assert max(ages) <= 2
    assert max(ages) > 0  # the fast ranks did run ahead of the slow one
    assert all(dropped == 0 for _, _, dropped in results)


def test_drop_discards_stale_gradients_and_the_fast_ranks_keep_their_pace() -> None:
    """Rank 0 holds its first gradient until the other ranks have taken every step: under
    ``"drop"`` they never wait for it (a wait would leave ``fast_done`` unset), and its gradient,
    now many versions old, is dropped. No wall clock: the order is forced, not timed."""
    steps = 10
    fast_done = threading.Event()
    finished = [0]
    lock = threading.Lock()

    def body(g: ProcessGroup) -> tuple[dict[int, int], int]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped, opt = sl.distribute(
            model, opt, strategy="async", group=g, staleness=1, on_stale="drop"
        )
        assert isinstance(wrapped, AsyncSGD) and isinstance(opt, AsyncOptimizer)
        for step in range(steps):
            x, y = batch(step, g.rank)
            opt.zero_grad()
            nn.functional.mse_loss(wrapped(x), y).backward()
            if g.rank == 0 and step == 0:
                assert fast_done.wait(30), "the fast ranks waited for the slow one"
            opt.step()
        if g.rank != 0:
            with lock:
                finished[0] += 1
                if finished[0] == g.world_size - 1:
                    fast_done.set()
        wrapped.close()
        return wrapped.staleness(), wrapped.dropped

    results = run_ranks(3, body)
    ages, slow_dropped = results[0]
    assert max(ages) <= 1  # the bound holds for every gradient applied
    assert slow_dropped >= 1  # computed on version 0, pushed after >= 2 rounds
    # every gradient pushed was either applied (at most 1 version old) or dropped
    assert sum(ages.values()) + sum(dropped for _, dropped in results) == 3 * steps


def test_replicas_end_identical_after_close() -> None:
    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        model, _ = train(g, 5, "async", staleness=1, on_stale="drop", servers=2)
        return params(model)

    results = run_ranks(3, body)
    for other in results[1:]:
        for k, value in results[0].items():
            torch.testing.assert_close(other[k], value, rtol=0, atol=0, msg=k)


def test_bad_arguments_are_refused() -> None:
    def body(g: ProcessGroup) -> None:
        with pytest.raises(InvalidArgumentError, match="on_stale"):
            sl.distribute(mlp(), strategy="async", group=g, on_stale="skip")
        with pytest.raises(InvalidArgumentError, match="servers"):
            sl.distribute(mlp(), strategy="async", group=g, servers=3)
        with pytest.raises(InvalidArgumentError, match="staleness"):
            sl.distribute(mlp(), strategy="async", group=g, staleness=-1)

    run_ranks(2, body)
