"""Local SGD and DiLoCo: each rank steps alone, and replicas meet every ``sync_every`` steps.

``sl.distribute(model, opt, strategy="local_sgd", sync_every=H)`` wraps the model; nothing is
communicated in backward. After every ``H``-th step of an optimizer over the model's
parameters, the replicas are made equal again, in one of two ways:

- ``outer_optimizer=None`` (local SGD, Stich 2019; post-local SGD): the parameters are
  averaged. With ``H = 1`` and plain SGD this is exactly DDP.
- ``outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9,
  nesterov=True)`` (DiLoCo, Douillard et al. 2023): each rank's *pseudo-gradient* (the global
  parameters at the last meeting minus its own now) is averaged and handed to the outer
  optimizer, which steps the global parameters; every replica then restarts from them.

Float buffers (BatchNorm statistics) are averaged at each meeting. One collective per
meeting moves the whole model (``H`` times fewer bytes than DDP over the same steps);
``comm_stats()`` counts them. The global parameters are kept as a copy (one model's worth of
memory), so a checkpoint holds them as the model's state (any layout loads it) and each rank's
drifted replica and step count as ``Local`` values (restored into the same layout only).

``staleness()`` reports, for the steps since the start, how many local steps each one was
taken away from the last global model: at most ``H - 1``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from shardline.comm import traffic
from shardline.comm.coalesced import broadcast_coalesced
from shardline.comm.group import ProcessGroup
from shardline.comm.world import default_group
from shardline.errors import InvalidArgumentError
from shardline.parallel import contract
from shardline.parallel._common import check_same_model
from shardline.parallel.contract import Local
from shardline.parallel.replica.base import Replica, split_like

__all__ = ["LocalSGD"]

_MIB = 1 << 20
_PREFIX = "_local_sgd/"

# One hook for the process, installed once: optimizers' global hook table must not change
# while another thread (a rank, in tests) iterates it in a step.
_WRAPPERS: weakref.WeakSet[LocalSGD] = weakref.WeakSet()
_HOOK_LOCK = threading.Lock()
_hooked = False


def _after_any_step(opt: torch.optim.Optimizer, *_: Any) -> None:
    for wrapper in list(_WRAPPERS):
        if wrapper._steps_mine(opt):
            wrapper._after_step()


def _watch(wrapper: LocalSGD) -> None:
    global _hooked  # noqa: PLW0603 (one hook per process)
    with _HOOK_LOCK:
        if not _hooked:
            register_optimizer_step_post_hook(_after_any_step)
            _hooked = True
        _WRAPPERS.add(wrapper)


class LocalSGD(Replica):
    """Replicas that train alone and meet every ``sync_every`` optimizer steps.

    Args:
        module: The plain model, on its device.
        group: The ranks holding replicas; the default group when ``None``.
        sync_every: Optimizer steps between meetings (``H``), at least 1.
        outer_optimizer: ``None`` to average parameters at each meeting, or a function
            building the outer optimizer from a list of parameters (DiLoCo).
        init_sync: Broadcast rank 0's parameters and buffers first.

    Raises:
        InvalidArgumentError: ``sync_every < 1``, an ``outer_optimizer`` that is not callable,
            or different models on different ranks.
    """

    strategy = "local_sgd"

    def __init__(
        self,
        module: nn.Module,
        *,
        group: ProcessGroup | None = None,
        sync_every: int = 8,
        outer_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        init_sync: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise InvalidArgumentError(
                f"LocalSGD: sync_every must be an integer >= 1, not {sync_every!r}"
            )
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise InvalidArgumentError(
                "LocalSGD: outer_optimizer must be a function params -> optimizer, e.g. "
                "lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)"
            )
        self.module = module
        self.group = group if group is not None else default_group()
        self.sync_every = sync_every
        seen: set[int] = set()
        named = []
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        if not named:
            raise InvalidArgumentError("LocalSGD: the model has no trainable parameters")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._ids = frozenset(id(p) for p in self._params)
        self._buffers_list = [b for b in module.buffers() if b.is_floating_point() and b.numel()]
        check_same_model(self.group, self._names, self._params, "LocalSGD")
        if init_sync:
            with traffic.charged_to(self._traffic):
                tensors = [p.data for p in self._params] + [
                    b for b in module.buffers() if b.numel()
                ]
                broadcast_coalesced(self.group, tensors, 0, 25 * _MIB)
        # The global model at the last meeting: what the outer optimizer steps.
        self._global = [nn.Parameter(p.detach().clone()) for p in self._params]
        self._outer = outer_optimizer(self._global) if outer_optimizer is not None else None
        self.local_steps = 0  # optimizer steps since the last meeting
        self.meetings = 0
        self._steps = 0
        self._staleness: dict[int, int] = {}  # local steps away from the global model -> count
        _watch(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward (nothing is communicated)."""
        return self.module(*args, **kwargs)

    # -- meetings -----------------------------------------------------------------------------

    def _steps_mine(self, opt: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._ids for g in opt.param_groups for p in g["params"])

    def _after_step(self) -> None:
        self._staleness[self.local_steps] = self._staleness.get(self.local_steps, 0) + 1
        self.local_steps += 1
        self._steps += 1
        if self.local_steps >= self.sync_every:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Makes the replicas equal now (a collective: every rank must call it)."""
        n = self.group.world_size
        with traffic.charged_to(self._traffic):
            if self._outer is None:
                flat = torch.cat([p.detach().reshape(-1) for p in self._params])
                self.group.all_reduce(flat, "sum")
                flat.div_(n)
                self._unflatten(flat, self._params)
                self._unflatten(flat, self._global)
            else:
                flat = torch.cat(
                    [(g - p).reshape(-1) for g, p in zip(self._global, self._params, strict=True)]
                )
                self.group.all_reduce(flat, "sum")
                flat.div_(n)
                for g, grad in zip(self._global, split_like(flat, self._global), strict=True):
                    g.grad = grad
                self._outer.step()
                self._outer.zero_grad(set_to_none=True)
                for p, g in zip(self._params, self._global, strict=True):
                    p.copy_(g)
            if self._buffers_list:
                bufs = torch.cat([b.reshape(-1).float() for b in self._buffers_list])
                self.group.all_reduce(bufs, "sum")
                bufs.div_(n)
                self._unflatten(bufs, self._buffers_list)
        self.local_steps = 0
        self.meetings += 1

    @staticmethod
    def _unflatten(flat: torch.Tensor, into: list[torch.Tensor] | list[nn.Parameter]) -> None:
        for t, value in zip(into, split_like(flat, into), strict=True):
            t.data.copy_(value)

    def staleness(self) -> dict[int, int]:
        """``{local steps since the last meeting: number of optimizer steps taken then}``."""
        return dict(sorted(self._staleness.items()))

    def _report_steps(self) -> int:
        return self._steps

    def _report_extra(self) -> dict[str, Any]:
        return {"meetings": self.meetings}

    # -- plumbing ------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads into the replica and makes it the global model."""
        out = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        with torch.no_grad():
            for g, p in zip(self._global, self._params, strict=True):
                g.copy_(p)
        self.local_steps = 0
        return out

    # -- the strategy contract -----------------------------------------------------------------

    def sharded_state_dict(self) -> dict[str, Any]:
        """The global model (replicated), plus this rank's replica and step count (``Local``)."""
        out = contract.sharded_state_dict(self.module)
        for name, g in zip(self._names, self._global, strict=True):
            out[name] = g.detach()
        for name, p in zip(self._names, self._params, strict=True):
            out[f"{_PREFIX}replica/{name}"] = Local(p.detach())
        out[f"{_PREFIX}local_steps"] = Local(torch.tensor([self.local_steps], dtype=torch.int64))
        return out

    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        """Takes ``sharded_state_dict()``'s shape back.

        Without this rank's replica (another layout), every replica starts from the global
        model and the count of local steps from zero.
        """
        own = {k: v for k, v in sd.items() if not k.startswith(_PREFIX)}
        with torch.no_grad():
            for name, g in zip(self._names, self._global, strict=True):
                value = own.pop(name, None)
                if value is not None and value.data_ptr() != g.data_ptr():
                    g.copy_(value)
            contract.load_sharded_state_dict(self.module, own)
            replicas = [sd.get(f"{_PREFIX}replica/{name}") for name in self._names]
            steps = sd.get(f"{_PREFIX}local_steps")
            self.local_steps = 0
            if all(r is not None for r in replicas) and steps is not None:
                for p, r in zip(self._params, replicas, strict=True):
                    t = r.tensor if isinstance(r, Local) else r
                    assert t is not None
                    if t.data_ptr() != p.data_ptr():  # else the checkpoint filled it in place
                        p.copy_(t)
                t = steps.tensor if isinstance(steps, Local) else steps
                self.local_steps = int(t.reshape(-1)[0])
            else:
                for p, g in zip(self._params, self._global, strict=True):
                    p.copy_(g)

    def sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The inner optimizer's state by parameter names.

        Inner optimizers drift apart between meetings; a checkpoint keeps one rank's state
        (see the compression guide's limits).
        """
        return super().sharded_optim_state_dict(optimizer)
