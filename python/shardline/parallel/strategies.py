"""The strategy names users pass, in one table: name -> wrapper, ZeRO stage, planner layout.

``distribute(strategy=...)``, ``as_distributed`` and the memory planner all read this table, so
a new strategy is one row here (and a wrapper implementing the contract in
``shardline.parallel.contract``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

from shardline.errors import InvalidArgumentError
from shardline.parallel.data.ddp import DistributedDataParallel
from shardline.parallel.data.zero import ShardedDataParallel
from shardline.parallel.replica.async_sgd import AsyncSGD
from shardline.parallel.replica.hogwild import HogwildSGD
from shardline.parallel.replica.local_sgd import LocalSGD

__all__ = ["BY_MEMORY", "STRATEGIES", "Strategy", "options_of", "strategy"]


@dataclass(frozen=True)
class Strategy:
    """One strategy name.

    Attributes:
        name: What users pass (``"zero2"``).
        wrapper: The class that wraps the model.
        stage: The ZeRO stage the wrapper is built with; 0 for DDP and local SGD.
        planned_as: The layout the memory planner estimates (``"fsdp"`` is planned as zero3).
    """

    name: str
    wrapper: type[nn.Module]
    stage: int
    planned_as: str

    def wrap(self, model: nn.Module, **options: Any) -> nn.Module:
        """The wrapped model (``options`` as the wrapper takes them)."""
        if self.stage:
            return self.wrapper(model, stage=self.stage, **options)
        return self.wrapper(model, **options)

    def options(self) -> list[str]:
        """The keyword options its wrapper takes (``group`` and ``stage`` are set by callers)."""
        return options_of(self.wrapper)


_TABLE = (
    Strategy("ddp", DistributedDataParallel, 0, "ddp"),
    Strategy("zero1", ShardedDataParallel, 1, "zero1"),
    Strategy("zero2", ShardedDataParallel, 2, "zero2"),
    Strategy("zero3", ShardedDataParallel, 3, "zero3"),
    Strategy("fsdp", ShardedDataParallel, 3, "zero3"),
    Strategy("local_sgd", LocalSGD, 0, "ddp"),
    Strategy("async", AsyncSGD, 0, "ddp"),
    Strategy("hogwild", HogwildSGD, 0, "ddp"),
)

STRATEGIES: tuple[str, ...] = tuple(s.name for s in _TABLE)
# From least to most sharded: what ``as_distributed`` tries in turn.
BY_MEMORY: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3")
_BY_NAME = {s.name: s for s in _TABLE}


def strategy(name: str) -> Strategy:
    """The row for ``name`` (case-insensitive).

    Raises:
        InvalidArgumentError: an unknown name; the message lists the known ones.
    """
    row = _BY_NAME.get(name.lower())
    if row is None:
        hint = _ELSEWHERE.get(name.lower(), "")
        raise InvalidArgumentError(
            f"unknown strategy {name!r}; use one of {', '.join(STRATEGIES)}{hint}"
        )
    return row


# Layouts that are not a data-parallel strategy of their own: where they are asked for.
_MESH = (
    "; pipeline and tensor parallelism compose on a mesh: sl.distribute(model, opt, "
    "mesh=sl.DeviceMesh({'dp': 2, 'pp': 2, 'tp': 2}), strategy={'dp': 'zero2', 'pp': '1f1b', "
    "'tp': 'auto'}, microbatches=8, loss_fn=loss_fn)"
)
_ELSEWHERE = {
    **dict.fromkeys(
        ("pp", "pipeline", "gpipe", "1f1b", "interleaved", "zero_bubble", "zero_bubble_h2"),
        f"{_MESH}, or alone with sl.pipeline(model, group, schedule='1f1b', ...)",
    ),
    **dict.fromkeys(
        ("tp", "tensor", "tensor_parallel", "megatron"),
        f"{_MESH}, or alone with sl.tensor_parallel(model, group)",
    ),
}


def options_of(wrapper: type[nn.Module]) -> list[str]:
    """The keyword-only options of ``wrapper``'s constructor, but ``group`` and ``stage``."""
    params = inspect.signature(wrapper.__init__).parameters
    return [
        n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in ("group", "stage")
    ]
