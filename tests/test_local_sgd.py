"""Local SGD and DiLoCo against their references: DDP (H = 1), and replicas simulated in one
process with torch's own optimizers."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import checkpoint
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel.replica.local_sgd import LocalSGD
from tests._ranks import run_ranks

pytestmark = pytest.mark.usefixtures("native")

_INIT = threading.Lock()
IN, OUT = 12, 6
TEACHER = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(3)) / IN**0.5


def mlp() -> nn.Module:
    with _INIT:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN, 24), nn.Tanh(), nn.Linear(24, OUT))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, IN, generator=g)
    return x, torch.tanh(x @ TEACHER)


def step_once(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def run(g: ProcessGroup, steps: int, strategy: str = "local_sgd", **options: object) -> nn.Module:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    wrapped, _ = sl.distribute(model, opt, strategy=strategy, group=g, **options)
    for step in range(steps):
        step_once(wrapped, opt, step, g.rank)
    return wrapped


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k, value in a.items():
        torch.testing.assert_close(value, b[k], rtol=tol, atol=tol, msg=k)


def test_sync_every_step_is_ddp() -> None:
    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return params(run(g, 6, sync_every=1)), params(run(g, 6, strategy="ddp"))

    for local, ddp in run_ranks(3, body):
        close(local, ddp)


def simulate(
    n: int, steps: int, h: int, outer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None
) -> dict[str, torch.Tensor]:
    """The reference: n replicas in one process, each with its own SGD, meeting every h steps."""
    global_model = mlp()
    replicas = [copy.deepcopy(global_model) for _ in range(n)]
    opts = [torch.optim.SGD(r.parameters(), lr=0.2) for r in replicas]
    global_params = [nn.Parameter(p.detach().clone()) for p in global_model.parameters()]
    outer_opt = outer(global_params) if outer is not None else None
    for step in range(steps):
        for rank in range(n):
            step_once(replicas[rank], opts[rank], step, rank)
        if (step + 1) % h:
            continue
        with torch.no_grad():
            for i, gp in enumerate(global_params):
                mine = [list(r.parameters())[i] for r in replicas]
                if outer_opt is None:
                    gp.copy_(torch.stack([p.detach() for p in mine]).mean(0))
                else:
                    gp.grad = torch.stack([gp - p.detach() for p in mine]).mean(0)
            if outer_opt is not None:
                outer_opt.step()
            for r in replicas:
                for p, gp in zip(r.parameters(), global_params, strict=True):
                    p.copy_(gp)
    return params(replicas[0])


def nesterov(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)


@pytest.mark.parametrize("outer", [None, nesterov], ids=["average", "diloco-nesterov"])
def test_matches_replicas_simulated_in_one_process(
    outer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None,
) -> None:
    n, steps, h = 3, 12, 4
    want = simulate(n, steps, h, outer)

    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        return params(run(g, steps, sync_every=h, outer_optimizer=outer))

    for got in run_ranks(n, body):
        close(got, want, tol=1e-5)


def test_an_outer_sgd_of_rate_one_is_plain_averaging() -> None:
    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        plain = params(run(g, 8, sync_every=4))
        outer = params(
            run(g, 8, sync_every=4, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
        )
        return plain, outer

    for plain, outer in run_ranks(2, body):
        close(outer, plain, tol=1e-6)


def test_meetings_move_h_times_fewer_bytes_and_staleness_is_reported() -> None:
    def body(g: ProcessGroup) -> tuple[dict[str, object], dict[str, object], dict[int, int]]:
        local = run(g, 8, sync_every=4)
        ddp = run(g, 8, strategy="ddp")
        assert isinstance(local, LocalSGD)
        return local.comm_stats(), ddp.comm_stats(), local.staleness()

    for local, ddp, staleness in run_ranks(2, body):
        assert local["meetings"] == 2 and local["steps"] == 8
        moved = local["by_op"]["all_reduce"]["sent"]  # type: ignore[index]
        dense = ddp["by_op"]["all_reduce"]["sent"]  # type: ignore[index]
        assert 3.5 < dense / moved < 4.5
        assert staleness == {0: 2, 1: 2, 2: 2, 3: 2}


def test_a_checkpoint_mid_period_resumes_exactly_and_reshards_from_the_global_model(
    tmp_path: Path,
) -> None:
    def body(g: ProcessGroup) -> None:
        whole = params(run(g, 8, sync_every=4))
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        wrapped, _ = sl.distribute(model, opt, strategy="local_sgd", group=g, sync_every=4)
        for step in range(6):  # two local steps past the meeting at 4
            step_once(wrapped, opt, step, g.rank)
        checkpoint.save(tmp_path / "ck", model=wrapped, optimizer=opt, group=g)
        fresh = mlp()
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.2)
        again, _ = sl.distribute(fresh, fopt, strategy="local_sgd", group=g, sync_every=4)
        checkpoint.load(tmp_path / "ck", model=again, optimizer=fopt, group=g)
        assert isinstance(again, LocalSGD) and again.local_steps == 2
        for step in range(6, 8):
            step_once(again, fopt, step, g.rank)
        close(params(again), whole)

    run_ranks(2, body)

    def other_size(g: ProcessGroup) -> dict[str, torch.Tensor]:
        model = mlp()
        wrapped, _ = sl.distribute(model, strategy="local_sgd", group=g, sync_every=4)
        checkpoint.load(tmp_path / "ck", model=wrapped, group=g)
        assert isinstance(wrapped, LocalSGD) and wrapped.local_steps == 0
        return params(wrapped)

    def meeting(g: ProcessGroup) -> dict[str, torch.Tensor]:
        return params(run(g, 4, sync_every=4))

    global_at_4 = run_ranks(2, meeting)[0]
    for got in run_ranks(3, other_size):
        close(got, global_at_4)


def test_bad_arguments_are_refused() -> None:
    def body(g: ProcessGroup) -> None:
        with pytest.raises(InvalidArgumentError, match="sync_every"):
            sl.distribute(mlp(), strategy="local_sgd", group=g, sync_every=0)
        with pytest.raises(InvalidArgumentError, match="outer_optimizer"):
            sl.distribute(mlp(), strategy="local_sgd", group=g, outer_optimizer="nesterov")

    run_ranks(1, body)
