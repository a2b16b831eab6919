"""The parameter server of asynchronous SGD: one shard of the flat parameters and its rounds.

A server holds a contiguous slice of the model's flattened parameters, an optimizer over it,
and a *version* (rounds applied). Workers push a gradient computed on some version and get
back the current parameters. A round averages ``n`` gradients (``n`` workers) and steps the
optimizer once, so a round is a synchronous step's update.

- ``on_stale="wait"`` (stale synchronous parallel): round ``c`` is exactly one gradient of
  every worker's clock ``c`` (its ``c``-th push), and a worker's reply waits until the version
  reaches ``c + 1 - staleness``: no worker runs more than ``staleness`` rounds ahead of the
  slowest, every applied gradient is at most ``staleness`` versions old, and ``staleness=0`` is
  synchronous SGD.
- ``on_stale="drop"``: nobody waits. A gradient more than ``staleness`` versions old is
  dropped and its worker gets the current parameters; a round is the next ``n`` gradients
  accepted, from whichever workers; one slow worker never holds the others.

``handle`` is thread-safe: the server's own worker calls it directly, and one thread per remote
worker calls it for messages received on that pair's group (``async_sgd.AsyncSGD``). On CUDA
the server's arithmetic runs on a stream of its own, ordered after the caller's stream (where
the gradient was made) and before what the caller queues next (which reads the reply): the
callers' streams never wait on each other, so one thread blocked on its receive cannot hold up
another's send.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardline.errors import InvalidArgumentError

__all__ = ["Reply", "ShardServer"]


@dataclass
class Reply:
    """What a worker gets back for a push."""

    version: int
    accepted: bool
    params: torch.Tensor


@dataclass
class _Round:
    total: torch.Tensor
    count: int = 0
    computed_on: list[int] = field(default_factory=list)


class ShardServer:
    """One shard's parameters, optimizer and rounds (see the module docstring).

    Args:
        shard: The initial values of this shard (copied).
        make_optimizer: The optimizer class the server steps its shard with.
        hyper: Its hyperparameters (``lr``, ``momentum``, ...).
        workers: ``n``, the gradients in a round.
        staleness: The bound ``s`` (versions).
        on_stale: ``"wait"`` or ``"drop"``.
        timeout: Seconds a reply may wait (``"wait"``) before the server gives up.
    """

    def __init__(
        self,
        shard: torch.Tensor,
        make_optimizer: type[torch.optim.Optimizer] | None,
        hyper: dict[str, Any],
        *,
        workers: int,
        staleness: int,
        on_stale: str,
        timeout: float,
    ) -> None:
        if make_optimizer is None:
            raise InvalidArgumentError("the parameter server needs an optimizer class")
        self.param = nn.Parameter(shard.detach().clone())
        self.optimizer = make_optimizer([self.param], **hyper)
        self.workers = workers
        self.staleness = staleness
        self.on_stale = on_stale
        self.timeout = timeout
        self.version = 0
        self.ages: dict[int, int] = {}  # versions old -> gradients applied that old
        self.dropped = 0
        self._rounds: dict[int, _Round] = {}  # wait: by clock; drop: one open round (key 0)
        self._cond = threading.Condition()
        self._stream = torch.cuda.Stream(shard.device) if shard.is_cuda else None  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def _on_own_stream(self, grad: torch.Tensor) -> Iterator[None]:
        """Runs the body on the server's stream (CUDA), ordered between the caller's work."""
        stream = self._stream
        if stream is None:
            yield
            return
        caller = torch.cuda.current_stream(stream.device)
        stream.wait_stream(caller)  # the gradient is ready
        grad.record_stream(stream)  # the caller may free it before the server reads it
        with torch.cuda.stream(stream):
            yield
        caller.wait_stream(stream)  # the reply is ready

    def handle(self, clock: int, computed_on: int, grad: torch.Tensor) -> Reply:
        """Takes worker's ``clock``-th gradient, computed on version ``computed_on``."""
        with self._on_own_stream(grad):
            reply = self._handle(clock, computed_on, grad)
        if self._stream is not None:  # made on the server's stream, read on the caller's
            reply.params.record_stream(torch.cuda.current_stream(self._stream.device))
        return reply

    def _handle(self, clock: int, computed_on: int, grad: torch.Tensor) -> Reply:
        with self._cond:
            if self.on_stale == "drop":
                if self.version - computed_on > self.staleness:
                    self.dropped += 1
                    return self._reply(False)
                self._add(0, grad, computed_on)
                if self._rounds[0].count == self.workers:
                    self._apply(0)
                return self._reply(True)
            self._add(clock, grad, computed_on)
            while self._rounds.get(self.version) is not None and (
                self._rounds[self.version].count == self.workers
            ):
                self._apply(self.version)
            deadline = time.monotonic() + self.timeout
            while self.version < clock + 1 - self.staleness:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"parameter server: waited {self.timeout:g} s for round "
                        f"{clock - self.staleness} (version {self.version}): a worker stopped "
                        "pushing; every rank must take the same number of steps under "
                        'on_stale="wait"'
                    )
                self._cond.wait(left)
            return self._reply(True)

    def flush(self) -> None:
        """Applies a round still open at the end (``"drop"``: fewer than ``n`` gradients)."""
        with self._cond, self._on_own_stream(self.param):
            for key in sorted(self._rounds):
                self._apply(key)

    def _add(self, key: int, grad: torch.Tensor, computed_on: int) -> None:
        r = self._rounds.get(key)
        if r is None:
            r = self._rounds[key] = _Round(torch.zeros_like(self.param, dtype=torch.float32))
        r.total.add_(grad)
        r.count += 1
        r.computed_on.append(computed_on)

    def _apply(self, key: int) -> None:
        r = self._rounds.pop(key)
        self.param.grad = (r.total / self.workers).to(self.param.dtype)
        self.optimizer.step()
        self.param.grad = None
        for v in r.computed_on:  # how old each gradient is now, as it is applied
            age = self.version - v
            self.ages[age] = self.ages.get(age, 0) + 1
        self.version += 1
        self._cond.notify_all()

    def _reply(self, accepted: bool) -> Reply:
        return Reply(self.version, accepted, self.param.detach().clone())
