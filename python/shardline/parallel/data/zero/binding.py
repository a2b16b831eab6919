"""Optimizers bound to ZeRO's units: their parameters pointed at the shards, and kept whole.

``bind_optimizer`` points an optimizer built over the plain model's parameters at the local
shards; ``apply_layout`` keeps the parameters of an optimizer that looks at whole parameters
whole (``optimizers``: the rules), re-laying the units out (``layout``) when it must.
"""

from __future__ import annotations

import logging
import weakref

import torch

from shardline.errors import InvalidArgumentError
from shardline.parallel.data.zero.base import ZeroBase
from shardline.parallel.data.zero.layout import UnitLayout
from shardline.parallel.data.zero.optimizers import Layout, check_optimizer, rule_for
from shardline.parallel.joining import is_joining

__all__ = ["OptimizerBinding"]

_log = logging.getLogger("shardline")


class OptimizerBinding:
    """Binds optimizers to a wrapper's units (see the module docstring).

    A part of ``ShardedDataParallel``, which delegates to it: it reads the wrapper's units
    (the fields of ``base.ZeroBase``) through a weak reference, so the wrapper is freed as
    before, and re-lays them out through their ``UnitLayout``.
    """

    def __init__(self, wrapper: ZeroBase, layout: UnitLayout) -> None:
        self._wrapper = weakref.ref(wrapper)
        self._layout = layout  # the wrapper's: re-lays the units out

    @property
    def _w(self) -> ZeroBase:
        """The wrapper whose units optimizers are bound to."""
        w = self._wrapper()
        assert w is not None, "the ShardedDataParallel of this binding was freed"
        return w

    def bind_optimizer(
        self, optimizer: torch.optim.Optimizer, *, shared: bool = False
    ) -> torch.optim.Optimizer:
        """``ShardedDataParallel.bind_optimizer``: see its documentation."""
        w = self._w
        check_optimizer(optimizer, w.stage)
        local_of = {id(p): loc for u in w._units for p, loc in zip(u.params, u.locals, strict=True)}
        for g in optimizer.param_groups:
            foreign = [p for p in g["params"] if id(p) not in local_of]
            if foreign and not shared:
                raise InvalidArgumentError(
                    f"distribute(): the optimizer holds {len(foreign)} tensors that are not "
                    "parameters of the model; build the optimizer from model.parameters()"
                )
        built = {id(p): dict(entries) for p, entries in optimizer.state.items() if entries}
        for g in optimizer.param_groups:
            g["params"] = [local_of.get(id(p), p) for p in g["params"]]
        for p in [p for p in optimizer.state if id(p) in local_of]:
            del optimizer.state[p]
        w._optimizer = optimizer
        self.apply_layout(optimizer, stepping=False)
        for u in w._units:  # the layout is final now: cut the built state to it
            for p, loc, (a, b) in zip(u.params, u.locals, u.local_ranges, strict=True):
                entries = built.get(id(p))
                if entries is None or (u.owner is not None and u.owner != u.rank):
                    continue
                optimizer.state[loc] = {
                    k: v.detach().reshape(-1)[a:b].clone().view(loc.shape)
                    if torch.is_tensor(v) and v.shape == p.shape and v.dim() > 0
                    else v
                    for k, v in entries.items()
                }
        return optimizer

    def apply_layout(self, optimizer: torch.optim.Optimizer, *, stepping: bool) -> None:
        """Keeps the parameters of a per-parameter optimizer whole (a collective re-layout).

        Runs when ``distribute()`` binds the optimizer, or before its first step (a global
        step pre-hook) for one built after wrapping; optimizers over other parameters are
        ignored.
        """
        w = self._w
        names = {id(loc): n for u in w._units for n, loc in zip(u.names, u.locals, strict=True)}
        mine = [names[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in names]
        rule = rule_for(type(optimizer))
        if mine and rule.layout is Layout.REFUSED:
            check_optimizer(optimizer, w.stage)  # raises, saying what works instead
        w._checked_optimizers.add(optimizer)
        if not mine or rule.layout is not Layout.WHOLE:
            return
        want = w._whole | frozenset(mine)
        if want == w._whole:
            return
        if stepping and any(optimizer.state.values()):
            raise InvalidArgumentError(
                f"{type(optimizer).__name__} needs whole parameters ({rule.reason}), but it "
                "already holds state for the shards; pass it to shardline.distribute(model, "
                "optimizer, ...) or build it before its first step"
            )
        w._whole_reasons[type(optimizer).__name__] = rule.reason
        if is_joining() and not stepping:
            # Joining a running elastic job: the values come with the restore, and the ranks
            # already there lay the same plan out in regroup() without communicating.
            self._layout._reinstall(want)
        else:
            self._layout._relayout(w._order, want)
        if w.group.rank == 0:
            _log.info("%s", self._layout.plan())

    def forget_shards(self) -> frozenset[str]:
        """Before ``regroup`` lays the units out again: optimizers forget the old shards.

        Their state for the old shards is dropped, and the parameters kept whole are the bound
        optimizer's, as ``bind_optimizer`` leaves a fresh wrapper; another optimizer is
        checked again before its next step.

        Returns:
            The names of the parameters to keep whole.
        """
        w = self._w
        opt = w._optimizer
        for known in {*w._checked_optimizers, *([opt] if opt is not None else [])}:
            for loc in w.parameters():
                known.state.pop(loc, None)  # shaped for the old shards
        w._whole_reasons = {}
        w._checked_optimizers = weakref.WeakSet()
        if opt is None:
            return frozenset()
        w._checked_optimizers.add(opt)
        rule = rule_for(type(opt))
        if rule.layout is not Layout.WHOLE:
            return frozenset()
        names = {id(loc): n for n, loc in w.named_parameters()}
        w._whole_reasons[type(opt).__name__] = rule.reason
        return frozenset(names[id(p)] for g in opt.param_groups for p in g["params"]
                         if id(p) in names)  # fmt: skip
