"""The Rust CPU optimizers against torch's own: AdamW, Adam and SGD over several steps, state
dicts that load into torch's classes and back, ZeRO with them, and the errors."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.optim import CPUSGD, CPUAdam, CPUAdamW
from tests._ranks import run_ranks

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
_INIT = threading.Lock()


def params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    # Sizes across the kernel's pieces (32 Ki values) and a scalar.
    return [nn.Parameter(torch.randn(shape, generator=g)) for shape in [(300, 257), (7,), ()]]


def train(make: Make, steps: int = 10) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    ps = params()
    opt = make(ps)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        if step == 3:  # a parameter without a gradient is skipped, as torch does
            ps[1].grad = None
        opt.step()
    return [p.detach().clone() for p in ps], opt


CASES: dict[str, tuple[Make, Make]] = {
    "adamw": (
        lambda ps: CPUAdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    ),
    "adamw-fused": (
        lambda ps: CPUAdamW(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, fused=True),
    ),
    "adam-l2": (
        lambda ps: CPUAdam(ps, lr=1e-2, weight_decay=0.05),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05, foreach=False),
    ),
    "sgd": (
        lambda ps: CPUSGD(ps, lr=0.05),
        lambda ps: torch.optim.SGD(ps, lr=0.05, foreach=False),
    ),
    "sgd-momentum": (
        lambda ps: CPUSGD(ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
        lambda ps: torch.optim.SGD(
            ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, foreach=False
        ),
    ),
    "sgd-nesterov": (
        lambda ps: CPUSGD(ps, lr=0.05, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=False),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_steps_equal_torchs(case: str) -> None:
    ours, theirs = CASES[case]
    got, opt = train(ours)
    want, ref = train(theirs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    mine, torchs = opt.state_dict()["state"], ref.state_dict()["state"]
    for i in range(len(got)):
        kept = {k: v for k, v in torchs.get(i, {}).items() if v is not None}
        assert mine.get(i, {}).keys() == kept.keys(), i
        for k, value in kept.items():
            torch.testing.assert_close(mine[i][k], value, rtol=1e-5, atol=1e-6, msg=f"{i}/{k}")


def test_state_dicts_move_between_ours_and_torchs() -> None:
    """Train 5 steps with ours, continue 5 with torch's from our state dict, and the reverse."""
    straight, _ = train(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False))

    def handover(first: Make, second: Make) -> list[torch.Tensor]:
        ps = params()
        opt = first(ps)
        for step in range(10):
            if step == 5:
                sd = copy.deepcopy(opt.state_dict())
                opt = second(ps)
                opt.load_state_dict(sd)
            g = torch.Generator().manual_seed(100 + step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            if step == 3:
                ps[1].grad = None
            opt.step()
        return [p.detach() for p in ps]

    ours = lambda ps: CPUAdamW(ps, lr=1e-2)  # noqa: E731
    torchs = lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)  # noqa: E731
    for got in (handover(ours, torchs), handover(torchs, ours)):
        for a, b in zip(got, straight, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("native")
def test_zero2_with_cpu_adamw_equals_zero2_with_torchs() -> None:
    def body(g: ProcessGroup) -> list[dict[str, torch.Tensor]]:
        out = []
        for make in (
            lambda ps: CPUAdamW(ps, lr=1e-2),
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
        ):
            with _INIT:  # rank threads share torch's global generator
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
            opt = make(list(model.parameters()))
            net, _ = sl.distribute(model, opt, strategy="zero2", group=g, unit_mb=0.002)
            for step in range(5):
                gen = torch.Generator().manual_seed(10 * step + g.rank)
                x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
                opt.zero_grad()
                nn.functional.mse_loss(net(x), y).backward()
                opt.step()
            out.append({k: v.detach().clone() for k, v in net.state_dict().items()})
        return out

    for ours, theirs in run_ranks(2, body):
        for k, value in theirs.items():
            torch.testing.assert_close(ours[k], value, rtol=1e-5, atol=1e-6, msg=k)


def test_what_it_cannot_step_is_refused_with_the_reason() -> None:
    p = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    p.grad = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match=r"parameter 0 is torch\.float64 on cpu"):
        CPUAdamW([p]).step()
    q = nn.Parameter(torch.zeros(4, 4).t())
    q.grad = torch.zeros(4, 4)
    with pytest.raises(InvalidArgumentError, match="not contiguous"):
        CPUSGD([q], lr=0.1).step()
    with pytest.raises(InvalidArgumentError, match="betas"):
        CPUAdam([p], betas=(0.9, 1.0))
    with pytest.raises(InvalidArgumentError, match="nesterov"):
        CPUSGD([p], nesterov=True)
