"""An optimizer built before wrapping and not handed to the strategy is refused at its first
step, not left to train nothing; one passed to ``distribute``, or built after, trains.

Ranks run as threads (``run_ranks``), two of them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError
from tests._ranks import run_ranks, seeded

pytestmark = pytest.mark.usefixtures("native")


def _model() -> nn.Module:
    with seeded(0):
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_an_optimizer_over_the_parameters_zero_replaced_is_refused(strategy: str) -> None:
    def body(g: ProcessGroup) -> str:
        plain = _model()
        early = torch.optim.SGD(plain.parameters(), lr=0.1)  # built before, not passed in
        model, _ = sl.distribute(plain, None, strategy=strategy, group=g)
        with pytest.raises(InvalidArgumentError, match=r"SGD steps '0\.weight', a parameter") as e:
            _step(model, early, g.rank)
        before = _full(model)
        late = torch.optim.SGD(model.parameters(), lr=0.1)  # built after: trains
        _step(model, late, g.rank)
        assert any(not torch.equal(v, _full(model)[k]) for k, v in before.items())
        return str(e.value)

    for text in run_ranks(2, body):
        assert f"strategy='{strategy}'" in text and "sl.distribute(model, optimizer" in text


def test_an_optimizer_passed_to_distribute_is_rebound_and_trains() -> None:
    def body(g: ProcessGroup) -> bool:
        plain = _model()
        model, opt = sl.distribute(
            plain, torch.optim.SGD(plain.parameters(), lr=0.1), strategy="zero3", group=g
        )
        assert opt is not None
        before = _full(model)
        _step(model, opt, g.rank)
        return any(not torch.equal(v, _full(model)[k]) for k, v in before.items())

    assert run_ranks(2, body) == [True, True]


def test_an_optimizer_over_the_layers_tensor_parallel_replaced_is_refused() -> None:
    def body(g: ProcessGroup) -> None:
        model = _model()
        early = torch.optim.AdamW(model.parameters())
        sl.tensor_parallel(model, g, plan={"0": "colwise", "2": "rowwise"})
        with pytest.raises(InvalidArgumentError, match=r"AdamW steps '0\.weight'.*tensor_parallel"):
            _step(model, early, g.rank)
        _step(model, torch.optim.AdamW(model.parameters()), g.rank)

    run_ranks(2, body)
