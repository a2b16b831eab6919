"""``State``: what training returns to after a failure, committed in host memory.

``state = sl.elastic.State(model=model, optimizer=opt, sampler=sampler, step=0)`` names the
objects; ``state.commit()`` copies their state on this rank into host memory, and
``state.restore()`` puts the last commit back into the same objects, in place (the model's
parameters and the optimizer stay the objects the training loop holds). Extra fields are
attributes (``state.step``), committed and restored with the rest.

What is copied is what the strategy contract says this rank holds (DESIGN decision 7:
``sharded_state_dict`` and ``sharded_optim_state_dict``), so a ZeRO rank commits its shards
only, a pipeline rank its stages, and nothing here knows a strategy's name. A tensor held
under two names (tied weights) is copied once. The sampler's position is its
``state_dict()``, so a restore serves again exactly the samples after the commit.

A commit costs one copy of this rank's state into host memory (pinned where the state is on a
GPU, so the copy runs at the link's speed); ``benches/bench_recovery.py`` measures it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardline.errors import InvalidArgumentError
from shardline.parallel import contract
from shardline.parallel.contract import Box, FlatRange, Local, Shard

__all__ = ["State"]

_OWN = ("model", "optimizer", "sampler")


@dataclass(frozen=True)
class _Held:
    """A committed tensor: its host copy and the device it goes back to."""

    host: torch.Tensor
    device: torch.device


def _map(value: Any, fn: Callable[[Any], Any], memo: dict[int, Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor (or ``_Held``) inside it.

    Structures of the contract (``Shard``, ``Local``) and containers are rebuilt; a value met
    twice (tied weights) maps to one result.
    """
    key = id(value)
    if key in memo:
        return memo[key]
    out: Any
    if isinstance(value, torch.Tensor | _Held):
        out = fn(value)
    elif isinstance(value, Shard):
        out = value.like([_map(p.tensor, fn, memo) for p in value.pieces])
    elif isinstance(value, Local):
        out = Local(_map(value.tensor, fn, memo))
    elif isinstance(value, Box | FlatRange):
        raise AssertionError("pieces are mapped through their Shard")
    elif isinstance(value, dict):
        out = {k: _map(v, fn, memo) for k, v in value.items()}
    elif isinstance(value, list | tuple):
        out = type(value)(_map(v, fn, memo) for v in value)
    else:
        out = copy.deepcopy(value)
    memo[key] = out
    return out


def _to_host(t: Any) -> _Held:
    src = t.detach()
    pin = src.device.type == "cuda"
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
    host.copy_(src, non_blocking=pin)
    return _Held(host, src.device)


def _to_device(held: Any) -> torch.Tensor:
    assert isinstance(held, _Held)
    return held.host.to(held.device, copy=True)


class State:
    """Training state that survives a failure: committed in host memory, restored in place.

    Args:
        model: The (possibly distributed) model; its state on this rank is committed.
        optimizer: Its optimizer (needs ``model``).
        sampler: An object with ``state_dict()`` / ``load_state_dict()`` (``DistributedSampler``).
        **extra: Other fields (``step=0``), read and set as attributes, committed and
            restored as copies.

    Attributes:
        commits: How many commits were made.
        committed_at: ``time.time()`` of the last commit (``None`` before the first).
        last_commit_seconds: How long the last commit took on this rank.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: Any = None,
        **extra: Any,
    ) -> None:
        if optimizer is not None and model is None:
            raise InvalidArgumentError(
                "elastic.State: an optimizer needs its model (its state is kept by the "
                "model's parameter names); pass model= too"
            )
        clash = sorted(set(extra) & {"commit", "restore", "commits", "committed_at"})
        if clash:
            raise InvalidArgumentError(
                f"elastic.State: {', '.join(clash)} is a name State uses; rename the field"
            )
        object.__setattr__(self, "_fields", dict(extra))
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self.commits = 0
        self.committed_at: float | None = None
        self.last_commit_seconds = 0.0
        self._saved: dict[str, Any] | None = None

    # Extra fields read and write as attributes.

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__.get("_fields", {})
        if name in fields:
            return fields[name]
        raise AttributeError(f"elastic.State has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get("_fields", {}):
            self._fields[name] = value
        else:
            object.__setattr__(self, name, value)

    def fields(self) -> dict[str, Any]:
        """The extra fields and their current values."""
        return dict(self._fields)

    def commit(self) -> None:
        """Makes the current state the one ``restore`` returns to (this rank's share).

        Waits for the device's pending work on the copied tensors (a CUDA sync), so call it
        between steps, after ``optimizer.step()``.
        """
        start = time.perf_counter()
        devices: set[torch.device] = set()

        def to_host(t: Any) -> _Held:
            held = _to_host(t)
            devices.add(held.device)
            return held

        # One memo per tree: ids are unique only while their objects live, and each tree
        # lives for its own mapping.
        saved: dict[str, Any] = {"fields": copy.deepcopy(self._fields)}
        if self.model is not None:
            saved["model"] = _map(contract.sharded_state_dict(self.model), to_host, {})
        if self.optimizer is not None:
            assert self.model is not None
            optim = contract.sharded_optim_state_dict(self.model, self.optimizer)
            saved["optimizer"] = _map(optim, to_host, {})
        if self.sampler is not None:
            saved["sampler"] = copy.deepcopy(self.sampler.state_dict())
        for device in devices - {torch.device("cpu")}:
            torch.cuda.synchronize(device)  # the pinned copies ran asynchronously
        self._saved = saved
        self.commits += 1
        self.committed_at = time.time()
        self.last_commit_seconds = time.perf_counter() - start

    def restore(self) -> None:
        """Puts the last commit back into the same model, optimizer, sampler and fields.

        Raises:
            InvalidArgumentError: nothing was committed yet.
        """
        saved = self._saved
        if saved is None:
            raise InvalidArgumentError(
                "elastic.State.restore: nothing was committed yet; call state.commit() once "
                "the state is worth returning to (after the first step, say)"
            )
        if self.model is not None:
            sd = _map(saved["model"], _to_device, {})
            contract.load_sharded_state_dict(self.model, sd)
        if self.optimizer is not None:
            assert self.model is not None
            self.optimizer.state.clear()  # entries of parameters the commit had no state for
            osd = _map(saved["optimizer"], _to_device, {})
            contract.load_sharded_optim_state_dict(self.model, self.optimizer, osd)
        if self.sampler is not None:
            self.sampler.load_state_dict(saved["sampler"])
        self._fields.update(copy.deepcopy(saved["fields"]))

    def __repr__(self) -> str:
        held = [k for k in _OWN if getattr(self, k) is not None]
        return f"elastic.State({', '.join(held + list(self._fields))}; commits={self.commits})"
