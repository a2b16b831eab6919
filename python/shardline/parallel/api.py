"""``distribute()``: wrap a model and its optimizer for a parallel strategy in one call."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel.ddp import DistributedDataParallel
from shardline.parallel.zero import ShardedDataParallel

__all__ = ["STRATEGIES", "distribute"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strategy: str = "ddp",
    group: ProcessGroup | None = None,
    **options: Any,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Wraps ``model`` (and ``optimizer``) for data-parallel training on ``group``.

    Args:
        model: A plain ``nn.Module``, already on its device.
        optimizer: A plain optimizer over ``model``'s parameters, or ``None``.
        strategy: ``"ddp"``; ``"zero1"``, ``"zero2"``, ``"zero3"`` (``"fsdp"`` is zero3): see
            ``ShardedDataParallel``.
        group: The ranks to train on; the default group when ``None``.
        **options: Passed to the strategy (for DDP: ``bucket_cap_mb``, ``broadcast_buffers``,
            ``comm_hook``, ...; for ZeRO: ``unit_mb``, ``prefetch``, ``mixed_precision``).

    Returns:
        ``(wrapped_model, optimizer)``. For DDP the optimizer is returned as is: it already
        holds the parameters that the wrapper keeps in sync. For ZeRO it is the same object,
        its param groups (and their hyperparameters) now holding this rank's shards.

    Raises:
        InvalidArgumentError: an unknown strategy, or an optimizer over other parameters.
    """
    name = strategy.lower()
    if name not in STRATEGIES:
        raise InvalidArgumentError(
            f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}"
        )
    if name != "ddp":
        stage = {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[name]
        sharded = ShardedDataParallel(model, stage=stage, group=group, **options)
        if optimizer is not None:
            sharded.bind_optimizer(optimizer)
        return sharded, optimizer
    if optimizer is not None:
        owned = {id(p) for p in model.parameters()}
        foreign = [p for grp in optimizer.param_groups for p in grp["params"] if id(p) not in owned]
        if foreign:
            raise InvalidArgumentError(
                f"distribute(): the optimizer holds {len(foreign)} tensors that are not "
                "parameters of the model; build the optimizer from model.parameters()"
            )
    return DistributedDataParallel(model, group=group, **options), optimizer
