"""Parameters a strategy replaced, and the check that no optimizer steps them instead.

A strategy that gives a model new parameter objects (ZeRO's shards, tensor parallelism's
slices) marks the ones it replaced, with their names. An optimizer built before wrapping and
not handed to the strategy still holds those: its steps would change parameters the model no
longer trains with, and nothing would train, silently. So the first step of every optimizer
(and its first after its parameter list changed) checks that it holds none of them, and raises
naming the parameter and the fix otherwise. One global step pre-hook does it, registered with
the first mark; an optimizer it checked costs a length comparison per step.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardline.errors import InvalidArgumentError

__all__ = ["mark_replaced"]

# id(parameter) -> (a weak reference to it, its name, the strategy that replaced it). Tensors
# compare elementwise, so they cannot be keys of a WeakKeyDictionary.
_REPLACED: dict[int, tuple[weakref.ref[nn.Parameter], str, str]] = {}
# optimizer -> how many parameters it held when it was last checked.
_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_hook: Any = None


def mark_replaced(params: Iterable[tuple[str, nn.Parameter]], by: str) -> None:
    """Notes that ``by`` (a strategy's name) replaced these ``(name, parameter)`` pairs."""
    global _hook  # noqa: PLW0603  # one hook per process
    with _LOCK:
        for name, p in params:
            _REPLACED[id(p)] = (weakref.ref(p, _forget(id(p))), name, by)
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_check)


def _forget(key: int) -> Any:
    """The callback that drops a collected parameter's entry."""
    return lambda _ref: _REPLACED.pop(key, None)


def _check(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if _CHECKED.get(optimizer) == len(params):
        return
    for p in params:
        entry = _REPLACED.get(id(p))
        if entry is not None and entry[0]() is p:
            name, by = entry[1], entry[2]
            raise InvalidArgumentError(
                f"{type(optimizer).__name__} steps {name!r}, a parameter that {by} replaced: "
                "it was built from the model before wrapping, so its steps would train "
                "nothing. Pass it to sl.distribute(model, optimizer, ...), which rebinds it, "
                "or build it after wrapping, from the wrapped model's parameters()"
            )
    _CHECKED[optimizer] = len(params)
