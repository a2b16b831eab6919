"""Which optimizers ZeRO can shard, and how: elementwise, whole parameters, or not at all.

ZeRO normally cuts every unit's flat buffer into equal ranges, so a rank holds pieces of
parameters. That is exact for optimizers whose state and update are elementwise (SGD, Adam,
AdamW, Adagrad, RMSprop, ...: each element's update needs only that element). It is not for
optimizers that look at a whole parameter at once:

- *per-parameter* optimizers (Adafactor's factored moments and norm-scaled steps, Muon's
  orthogonalised matrix updates) get whole-parameter sharding: each of their parameters is
  held, stepped and checkpointed by one rank, which broadcasts it, as torch's
  ``ZeroRedundancyOptimizer`` does (``model.plan()`` names these units and their ranks);
- optimizers that look at all parameters together and re-evaluate the loss (L-BFGS), or need
  gradients ZeRO does not produce (SparseAdam), are refused for the ZeRO stages with an error
  that says what works instead.

Every ``torch.optim`` optimizer is in the table below. An optimizer class from elsewhere is
treated as elementwise unless registered with ``register_optimizer(cls, per_parameter=True)``
(or ``refuse="why"``); subclasses inherit the entry of their nearest registered base.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardline.errors import InvalidArgumentError

__all__ = [
    "Layout",
    "OptimizerRule",
    "check_optimizer",
    "fresh_state",
    "register_optimizer",
    "rule_for",
]


class Layout(enum.Enum):
    """How ZeRO shards the parameters an optimizer steps."""

    ELEMENTWISE = "elementwise"  # equal ranges of each unit's flat buffer
    WHOLE = "whole"  # each parameter whole on one rank
    REFUSED = "refused"  # not with ZeRO


@dataclass(frozen=True)
class OptimizerRule:
    """An optimizer class's layout, and why (said in ``model.plan()`` and in errors)."""

    layout: Layout
    reason: str


_RULES: dict[type, OptimizerRule] = {}


def register_optimizer(
    cls: type[torch.optim.Optimizer], *, per_parameter: bool = False, refuse: str | None = None
) -> None:
    """Tells ZeRO how to shard the parameters an optimizer class steps.

    Args:
        cls: The optimizer class (its subclasses follow it unless registered themselves).
        per_parameter: Its state or update looks at a whole parameter (a norm, a factored
            moment, a matrix function): each of its parameters is held whole by one rank.
        refuse: Refuse it for the ZeRO stages, saying this (e.g. what to use instead).

    Raises:
        InvalidArgumentError: ``cls`` is not an optimizer class, or both options are given.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise InvalidArgumentError(
            f"register_optimizer: {cls!r} is not a torch.optim.Optimizer subclass"
        )
    if per_parameter and refuse is not None:
        raise InvalidArgumentError("register_optimizer: give per_parameter or refuse, not both")
    if refuse is not None:
        _RULES[cls] = OptimizerRule(Layout.REFUSED, refuse)
    elif per_parameter:
        _RULES[cls] = OptimizerRule(Layout.WHOLE, "registered as per-parameter")
    else:
        _RULES[cls] = OptimizerRule(Layout.ELEMENTWISE, "registered as elementwise")


def rule_for(cls: type) -> OptimizerRule:
    """The rule of ``cls``: its own entry, its nearest registered base's, else elementwise."""
    for base in cls.__mro__:
        if base in _RULES:
            return _RULES[base]
    return OptimizerRule(Layout.ELEMENTWISE, "not registered: treated as elementwise")


def fresh_state(state: Mapping[Any, Mapping[str, Any]]) -> bool:
    """Whether optimizer state was only created, never stepped (Adagrad makes it eagerly).

    Fresh means every parameter's state has a ``step`` of 0.
    """

    def zero(v: Any) -> bool:
        return float(v) == 0.0 if torch.is_tensor(v) or isinstance(v, int | float) else False

    return all("step" in entries and zero(entries["step"]) for entries in state.values())


def check_optimizer(optimizer: torch.optim.Optimizer, stage: int) -> None:
    """Refuses, before any work, an optimizer ZeRO cannot take.

    Raises:
        InvalidArgumentError: its class is refused (the message says what works instead), or
            it has stepped already (state other than what it made when built).
    """
    rule = rule_for(type(optimizer))
    if rule.layout is Layout.REFUSED:
        raise InvalidArgumentError(
            f"{type(optimizer).__name__} cannot be used with ZeRO (zero{stage}): {rule.reason}"
        )
    if any(optimizer.state.values()) and not fresh_state(optimizer.state):
        raise InvalidArgumentError(
            "distribute(): the optimizer already has state; wrap the model before the first "
            "optimizer step (load optimizer checkpoints with model.load_optim_state_dict)"
        )


def _defaults() -> None:
    optim = torch.optim
    for cls in (
        optim.SGD,
        optim.Adam,
        optim.AdamW,
        optim.Adamax,
        optim.NAdam,
        optim.RAdam,
        optim.Adagrad,
        optim.Adadelta,
        optim.RMSprop,
        optim.Rprop,
        optim.ASGD,
    ):
        _RULES[cls] = OptimizerRule(Layout.ELEMENTWISE, "elementwise state and update")
    per_parameter = {
        "Adafactor": "its second moment is factored over rows and columns and its step size "
        "follows each parameter's norm",
        "Muon": "it orthogonalises each weight matrix's whole update",
    }
    for name, reason in per_parameter.items():
        found: type | None = getattr(optim, name, None)
        if found is not None:
            _RULES[found] = OptimizerRule(Layout.WHOLE, reason)
    _RULES[optim.LBFGS] = OptimizerRule(
        Layout.REFUSED,
        "it re-evaluates the loss through a closure and searches along one direction over all "
        "parameters at once; use strategy='ddp' (replicas step it exactly)",
    )
    _RULES[optim.SparseAdam] = OptimizerRule(
        Layout.REFUSED,
        "it needs sparse gradients and ZeRO reduces dense ones; use torch.optim.Adam",
    )


_defaults()
