"""The planner's pipeline tests' model: the tiny GPT as a chain of children, and its losses
trained in one process, what a pipeline choice must follow; the pipelines its choices build,
stepped, and the micro-batches a schedule keeps at once."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from shardline.comm import ProcessGroup
from shardline.examples.model import TinyGPT, as_sequential, lm_loss
from shardline.parallel.candidate import Candidate
from shardline.parallel.choice import Meshes, wrap_choice
from shardline.parallel.pipeline import schedules
from shardline.parallel.pipeline_layout import PipelineLayout, WithLoss, with_loss
from tests._ranks import built_once
from tests._tiny_gpt import CFG

__all__ = ["alone_losses", "chain", "check_interleaved", "sgd_losses", "stepped", "walked"]


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


def stepped(
    choices: Iterable[Candidate], g: ProcessGroup, example: Any, batch: Any, meshes: Meshes
) -> list[tuple[int, list[tuple[int, ...]], dict[int, int]]]:
    """Each pipeline choice built on rank ``g`` as ``as_distributed`` builds it (stages
    balanced on ``example``, one rank's batch) and stepped once on ``batch``: its
    micro-batches, the shapes of the parameters this rank holds, and the micro-batches each
    of its stages kept at once."""
    seen = []
    for c in choices:
        stage = wrap_choice(with_loss(chain(), lm_loss), c, g, None, {}, meshes, example)
        stage.step(*batch)
        held = sorted(tuple(p.shape) for p in stage.parameters())
        seen.append((c.microbatches, held, dict(stage.peak_activations)))
    return seen


def walked(schedule: str, pp: int, m: int, rank: int, virtual: int = 1) -> dict[int, int]:
    """The most micro-batches each of ``rank``'s stages keeps at once, by the schedule's own
    actions (a forward keeps one, a backward frees one)."""
    live: dict[int, int] = {}
    most: dict[int, int] = {}
    for a in schedules.build(schedule, pp, m, virtual)[rank]:
        live[a.stage] = live.get(a.stage, 0) + (1 if a.kind == "F" else -1)
        most[a.stage] = max(most.get(a.stage, 0), live[a.stage])
    return most


def check_interleaved(layout: PipelineLayout, stage: int, held: Any, peak: dict[int, int]) -> None:
    """An interleaved layout over 2 ranks, 2 stages each (the chain cut into 4), priced for
    pipeline rank ``stage``, against the pipeline built there (``stepped``): the cut, the
    parameters it holds, the micro-batches each of its stages kept at once (the schedule's
    walk), and the price within that walk with each stage's own activations."""
    assert layout.stage == stage
    assert layout.split == (("embed",), ("block0",), ("block1",), ("head",))
    assert sorted(tuple(p.shape) for p in layout.model.parameters()) == held
    most = walked("interleaved", 2, layout.microbatches, stage, virtual=2)
    assert peak == most and set(peak) == {stage, stage + 2}
    assert max(layout.chunk_kept) <= layout.activations("interleaved")
    assert layout.activations("interleaved") <= sum(
        k * most[s] for s, k in zip((stage, stage + 2), layout.chunk_kept, strict=True)
    )
