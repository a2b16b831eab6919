"""Hogwild (Niu et al., 2011): the ranks of one host step one shared copy of the parameters.

They do it without locks and without messages.

``sl.distribute(model, opt, strategy="hogwild")`` maps the model's parameters onto one
shared-memory buffer of the host: every rank's parameters are views of it, so every
``opt.step()`` (the user's own optimizer, unchanged) writes where every other rank reads. No
collective runs during training. Updates race: a rank may read parameters another rank is
half-way through writing, and two read-modify-writes of one value may lose one, which is
Hogwild's bet (harmless when updates are sparse or small).

A version counter in the same buffer counts steps; ``staleness()`` tells, for each step, how
many other ranks' steps landed between this rank's forward and its update. ``close()``
(every rank) gives each rank a private copy of the final parameters, the same everywhere.

Limits: all ranks on one host (the native engine's shared-memory transport); parameters of one
floating dtype on the CPU; optimizer state stays per rank (plain SGD is the usual choice).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Any

import torch
from torch import nn

from shardline.comm import traffic
from shardline.comm.coalesced import broadcast_coalesced
from shardline.comm.group import ProcessGroup
from shardline.comm.objects import broadcast_object
from shardline.comm.world import default_group
from shardline.errors import InvalidArgumentError
from shardline.parallel._common import check_same_model
from shardline.parallel.replica.base import Replica, split_like

__all__ = ["HogwildSGD"]

_MIB = 1 << 20


class HogwildSGD(Replica):
    """Replicas whose parameters are one shared buffer of the host (see the module docstring).

    Args:
        module: The plain model, on the CPU.
        group: The ranks (all on one host); the default group when ``None``.

    Raises:
        InvalidArgumentError: ranks on several hosts, parameters not on the CPU or of several
            dtypes.
    """

    strategy = "hogwild"

    def __init__(self, module: nn.Module, *, group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group if group is not None else default_group()
        if self.group.transport not in ("shm", "single"):
            raise InvalidArgumentError(
                f"hogwild: the ranks must share one host (shared memory), but group "
                f"{self.group.name!r} talks over {self.group.transport!r}; use "
                'strategy="async" across hosts'
            )
        self.module = module
        named = [(k, p) for k, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise InvalidArgumentError("hogwild: the model has no trainable parameters")
        dtypes = {p.dtype for _, p in named}
        devices = {p.device.type for _, p in named}
        if len(dtypes) != 1 or devices != {"cpu"}:
            raise InvalidArgumentError(
                "hogwild: parameters must be CPU tensors of one floating dtype, got "
                f"{sorted(map(str, dtypes))} on {sorted(devices)}"
            )
        self._names = [k for k, _ in named]
        self._params = [p for _, p in named]
        check_same_model(self.group, self._names, self._params, "hogwild")
        with traffic.charged_to(self._traffic):
            tensors = [p.data for p in self._params] + [b for b in module.buffers() if b.numel()]
            broadcast_coalesced(self.group, tensors, 0, 25 * _MIB)
            self._shared, self._counter = self._map(next(iter(dtypes)))
        self._seen = 0  # the version this rank's forward read
        self._staleness: dict[int, int] = {}
        self.steps = 0
        self._closed = False

    def _map(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank maps one ``/dev/shm`` file: the parameters, then an int64 version."""
        total = sum(p.numel() for p in self._params)
        itemsize = torch.empty((), dtype=dtype).element_size()
        body = -(-total * itemsize // 8) * 8  # the version starts 8-byte aligned
        path = broadcast_object(
            f"/dev/shm/shardline-{os.getpid()}-hogwild-{secrets.token_hex(6)}"
            if self.group.rank == 0
            else None,
            src=0,
            group=self.group,
        )
        if self.group.rank == 0:
            with open(path, "wb") as f:
                f.truncate(body + 8)
        self.group.barrier()
        raw = torch.from_file(path, shared=True, size=body + 8, dtype=torch.uint8)
        flat = raw[: total * itemsize].view(dtype)
        version = raw[body : body + 8].view(torch.int64)
        if self.group.rank == 0:
            for part, p in zip(split_like(flat, self._params), self._params, strict=True):
                part.copy_(p.detach())
            version.zero_()
        self.group.barrier()  # every rank has mapped it and rank 0 has filled it
        if self.group.rank == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # the mappings keep the memory; nothing is left behind
        with torch.no_grad():
            for p, part in zip(self._params, split_like(flat, self._params), strict=True):
                p.data = part
        return flat, version

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on the shared parameters (notes the version it read)."""
        self._seen = int(self._counter.item())
        return self.module(*args, **kwargs)

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Counts ``optimizer``'s steps (returned unchanged: it steps the shared parameters)."""
        optimizer.register_step_post_hook(lambda *_: self._after_step())
        return optimizer

    def _after_step(self) -> None:
        now = int(self._counter.item())
        age = max(0, now - self._seen)
        self._staleness[age] = self._staleness.get(age, 0) + 1
        self._counter.add_(1)  # not atomic: a lost count only understates staleness
        self.steps += 1

    def staleness(self) -> dict[int, int]:
        """``{other ranks' steps between this rank's forward and its update: steps}``."""
        return dict(sorted(self._staleness.items()))

    def _report_steps(self) -> int:
        return self.steps

    @torch.no_grad()
    def close(self) -> None:
        """Ends training (a collective): each rank keeps a private copy of the final model."""
        if self._closed:
            return
        self._closed = True
        self.group.barrier()  # every rank's last step has landed
        for p in self._params:
            p.data = p.data.clone()
        self.group.barrier()
