"""The planner's pipeline tests' model: the tiny GPT as a chain of children, and its losses
trained in one process, what a pipeline choice must follow."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from shardline.examples.model import TinyGPT, as_sequential, lm_loss
from shardline.parallel.pipeline_layout import WithLoss
from tests._ranks import built_once
from tests._tiny_gpt import CFG

__all__ = ["alone_losses", "chain", "sgd_losses"]


@built_once
def _pristine() -> nn.Sequential:
    torch.manual_seed(0)
    return as_sequential(TinyGPT(CFG))


def chain() -> nn.Sequential:
    """The chain, the same on every rank (threads build it once: the seed is global)."""
    return copy.deepcopy(_pristine())


def sgd_losses(
    step: Callable[..., torch.Tensor], params: Iterable[nn.Parameter], batch: Any, steps: int = 3
) -> list[float]:
    """The losses of ``steps`` SGD steps (lr 0.1), each ``step(*batch)`` then the update."""
    opt = torch.optim.SGD(params, lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        losses.append(float(step(*batch)))
        opt.step()
    return losses


def alone_losses(batch: Any, steps: int = 3) -> list[float]:
    """``sgd_losses`` of the whole chain and its loss in this process, on ``batch``."""
    alone = WithLoss(chain(), lm_loss)

    def step(inputs: Any, target: Any) -> torch.Tensor:
        loss = alone(inputs, target)
        loss.backward()  # type: ignore[no-untyped-call]
        return loss.detach()

    return sgd_losses(step, alone.parameters(), batch, steps)
