"""Messages between pipeline stages: routing, asynchronous sends, receives in the peer's order.

See [Note: messages between stages] in ``runtime``. ``StageMessages`` is the part of
``PipelineModule`` that moves tensors; ``Step`` is what one step keeps between actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shardline.comm.group import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel.pipeline import boundary
from shardline.parallel.pipeline.actions import Action, stage_rank
from shardline.parallel.pipeline.boundary import Spec
from shardline.parallel.pipeline.clock import StepTimes
from shardline.parallel.pipeline.deferred import WeightStore
from shardline.parallel.pipeline.split_backward import InputPass

__all__ = ["Key", "StageMessages", "Step"]

Key = tuple[str, int, int]  # ("meta" | "act" | "grad", stage boundary, micro-batch)


@dataclass
class Inbox:
    """Messages from one peer on one communicator: their order, and those taken early."""

    order: list[Key]
    next: int = 0
    early: dict[Key, list[torch.Tensor]] = field(default_factory=dict)


@dataclass
class Step:
    """What one step keeps between actions."""

    train: bool
    inputs: list[tuple[torch.Tensor, ...]] | None  # per micro-batch, the model's inputs
    targets: list[Any] | None
    inbox: dict[tuple[str, int], Inbox]
    shapes: dict[int, list[Spec]] = field(default_factory=dict)  # per boundary (its specs)
    # (stage, micro-batch) -> (its inputs, None on the first stage; its outputs)
    saved: dict[tuple[int, int], tuple[list[torch.Tensor] | None, list[torch.Tensor]]] = field(
        default_factory=dict
    )
    grads_out: dict[tuple[int, int], list[torch.Tensor] | None] = field(default_factory=dict)
    split: dict[tuple[int, int], InputPass] = field(default_factory=dict)
    # (stage, micro-batch) -> its layers' deferred weight gradients (``deferred``)
    stores: dict[tuple[int, int], WeightStore] = field(default_factory=dict)
    local: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    loss_sum: torch.Tensor | None = None
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    sends: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    live: dict[int, int] = field(default_factory=dict)
    peak: dict[int, int] = field(default_factory=dict)
    # recompute under an active activation manager: the ids it keeps per (stage, micro-batch)
    kept: dict[tuple[int, int], tuple[Any, list[str]]] = field(default_factory=dict)
    times: StepTimes | None = None  # when each action computed and waited


class StageMessages:
    """Routing and messages of a rank's stages (mixed into ``PipelineModule``)."""

    _p: int
    _group: ProcessGroup
    _comms: dict[str, ProcessGroup | None]
    _orders: dict[bool, dict[tuple[str, int], list[Key]]]
    _actions: list[list[Action]]
    _device: torch.device
    num_stages: int

    # -- routing -----------------------------------------------------------------------------

    def _route(self, key: Key) -> tuple[str, int, int]:
        """(communicator, sender, receiver) of message ``key``."""
        kind, boundary, _ = key
        p = self._p
        if kind == "grad":  # for stage `boundary`'s output, from stage boundary + 1
            src, dst = stage_rank(boundary + 1, p), stage_rank(boundary, p)
            return ("bwd_wrap" if src == 0 and p > 1 and dst == p - 1 else "bwd"), src, dst
        src, dst = stage_rank(boundary - 1, p), stage_rank(boundary, p)  # into stage boundary
        return ("fwd_wrap" if src == p - 1 and dst == 0 and p > 1 else "fwd"), src, dst

    def _sent_by(self, action: Action, first: set[int], train: bool) -> list[Key]:
        """The messages ``action`` sends, in order.

        ``first`` holds the boundaries whose shape was announced already in this step.
        """
        out: list[Key] = []
        if action.kind == "F" and action.stage < self.num_stages - 1:
            boundary = action.stage + 1
            if boundary not in first:
                first.add(boundary)
                out.append(("meta", boundary, 0))
            out.append(("act", boundary, action.mb))
        if train and action.kind in ("B", "I") and action.stage > 0:
            out.append(("grad", action.stage - 1, action.mb))
        return out

    def _inboxes(self, actions: list[list[Action]], train: bool) -> dict[tuple[str, int], Inbox]:
        """This step's inboxes: for each (communicator, peer), its messages in send order."""
        orders = self._orders.get(train) if actions is self._actions else None
        if orders is None:
            orders = self._message_orders(actions, train)
            if actions is self._actions:
                self._orders[train] = orders
        return {where: Inbox(order) for where, order in orders.items()}

    def _message_orders(
        self, actions: list[list[Action]], train: bool
    ) -> dict[tuple[str, int], list[Key]]:
        mine = self._group.rank
        orders: dict[tuple[str, int], list[Key]] = {}
        for src, acts in enumerate(actions):
            first: set[int] = set()
            for a in acts:
                for key in self._sent_by(a, first, train):
                    comm, sender, dst = self._route(key)
                    assert sender == src
                    if dst == mine and src != mine:
                        orders.setdefault((comm, src), []).append(key)
        return orders

    # -- messages ----------------------------------------------------------------------------

    def _send(self, st: Step, key: Key, value: list[torch.Tensor] | torch.Tensor) -> None:
        """Sends a boundary's tensors (one message: ``boundary.pack``) or a meta message."""
        comm, src, dst = self._route(key)
        if dst == src:  # a stage of this rank: handed over in memory (shapes are shared)
            if key[0] != "meta":
                assert isinstance(value, list)
                st.local[key] = value
            return
        group = self._comms[comm]
        assert group is not None
        t = boundary.pack(value) if isinstance(value, list) else value.detach().contiguous()
        # Sends that are done let go of their tensors now (their errors still raise here),
        # so an activation is not kept past its micro-batch's backward until the step's end.
        pending = []
        for work, sent in st.sends:
            if work.is_completed():
                work.wait()  # at once; raises the send's error, if any
            else:
                pending.append((work, sent))
        st.sends = pending
        st.sends.append((group.send(t, dst, async_op=True), t))

    def _recv(self, st: Step, key: Key) -> list[torch.Tensor]:
        comm, src, dst = self._route(key)
        if src == dst:
            return st.local.pop(key)
        box = st.inbox[(comm, src)]
        group = self._comms[comm]
        assert group is not None
        times = st.times
        if times is None:
            return self._take(st, box, group, key, src)
        t0 = times.mark()
        try:
            return self._take(st, box, group, key, src)
        finally:
            times.waits.append((t0, times.mark()))

    def _take(
        self, st: Step, box: Inbox, group: ProcessGroup, key: Key, src: int
    ) -> list[torch.Tensor]:
        while key not in box.early:
            if box.next >= len(box.order):
                raise InvalidArgumentError(f"pipeline: {key} never comes from rank {src}")
            nxt = box.order[box.next]
            box.next += 1
            if nxt[0] == "meta":
                meta = torch.empty(boundary.META_LEN, dtype=torch.int64, device=self._device)
                group.recv(meta, src)
                st.shapes[nxt[1]] = boundary.decode(meta)
                continue
            if nxt[0] == "act":
                specs = st.shapes[nxt[1]]
            else:  # the gradient of activations this rank produced
                _, outs = st.saved[(nxt[1], nxt[2])]
                specs = boundary.grad_specs(boundary.specs_of(outs))
            buf, views = boundary.empty(specs, self._device)
            group.recv(buf, src)
            box.early[nxt] = views
        return box.early.pop(key)
