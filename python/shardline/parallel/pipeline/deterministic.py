"""Deterministic mode in a pipeline: the same parameters, bit for bit, as one process.

A stage's layers, prepared by ``make_deterministic``, give each micro-batch's per-unit
gradients to a held ``Collector`` (one per stage and micro-batch). When the micro-batch's
backward is done, each parameter's units are summed in the canonical tree, and the
micro-batches' sums are added in the canonical tree over micro-batches (``MicroTree``): with
micro-batches of ``2**k`` units, each is a subtree of the tree over the replica's batch, so
the step's gradient is the one process's ``tree_sum`` over the same samples. The gradients are
set at the step's end, before the replicas' reduction, whose group sums in the same tree
(``tree_group``).

A weight tied across stages (an embedding and the output head) is used in several stages, and
one process adds its uses unit by unit before the tree. So its uses are not summed where they
are made: each rank holding a copy sends its stages' uses of a micro-batch, as soon as the
micro-batch's backward is done there, to the rank of the latest such stage (the first use
backward reaches), which at the step's end adds them unit by unit, in backward's order (latest
stage first), and sums them as one process does. The other copies get no gradient of their
own; the tied weights' sum after the step (``tied``) then gives every copy that one
(``x + 0 == x``). That rank keeps the uses (its own, the head's output gradients among them,
and those it received) until the step's end: memory that a tied weight costs in this mode.

The weight gradients are made when a micro-batch's collector is summed: at the end of its
backward, or at the zero-bubble schedule's weight pass, which is then that sum (the input
pass runs the backward, whose layers keep what the sum needs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.errors import ShardlineError
from shardline.parallel.deterministic import collecting
from shardline.parallel.deterministic.collector import Collector, Use, sum_uses, use_of
from shardline.parallel.pipeline import boundary
from shardline.parallel.pipeline.actions import stage_rank
from shardline.parallel.pipeline.tied import Tied

__all__ = ["MicroTree", "StepSums"]


class MicroTree:
    """One parameter's micro-batch gradients, added in the canonical tree as they come.

    ``add(i, g)`` takes micro-batch ``i``'s gradient in any order; whole subtrees are added as
    soon as their micro-batches are in (a binary counter), so at most about ``log2(m)``
    partial sums are held at once.
    """

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []  # (micro-batches, their sum)
        self._next = 0
        self._early: dict[int, torch.Tensor] = {}

    def add(self, i: int, grad: torch.Tensor) -> None:
        """Micro-batch ``i``'s gradient (owned: the sums are made in place)."""
        self._early[i] = grad
        while self._next in self._early:
            g, size = self._early.pop(self._next), 1
            while self._stack and self._stack[-1][0] == size:
                _, left = self._stack.pop()
                g, size = left.add_(g), size * 2
            self._stack.append((size, g))
            self._next += 1

    @property
    def count(self) -> int:
        """Micro-batches added so far."""
        return self._next + len(self._early)

    def total(self) -> torch.Tensor:
        """The sum over micro-batches ``0 .. n-1`` (the canonical tree over ``n``).

        Raises:
            ShardlineError: a micro-batch below the last one added is missing.
        """
        if self._early or not self._stack:
            raise ShardlineError(
                f"deterministic pipeline: micro-batch {self._next}'s gradient never came, "
                f"those of {sorted(self._early)} did"
            )
        acc = self._stack[-1][1]
        for _, left in reversed(self._stack[:-1]):
            acc = left.add_(acc)
        return acc


class StepSums:
    """One pipeline rank's deterministic sums (see the module docstring).

    Args:
        unit: Samples per unit (``make_deterministic``'s).
        module: The rank's pipeline module (its parameters, under the model's names).
        tied: The weights tied across stages; their ``group`` is set.
        rank, p: This rank in the pipeline, and the pipeline's ranks.
        microbatches: Micro-batches per step.
    """

    def __init__(
        self, unit: int, module: nn.Module, tied: list[Tied], rank: int, p: int,
        microbatches: int,
    ) -> None:  # fmt: skip
        self.unit, self.rank, self.p, self.m = unit, rank, p, microbatches
        params = dict(nn.Module.named_parameters(module, remove_duplicate=False))
        # The tied weights this rank holds a copy of, by the copy's id, in the model's order,
        # with their index in ``tied`` (the same on every rank: part of their messages' tags).
        self._tied_of: dict[int, tuple[int, Tied, torch.Tensor]] = {}
        for k, t in enumerate(tied):
            copy = next((params[n] for n in t.names if n in params), None)
            if copy is not None:
                self._tied_of[id(copy)] = (k, t, copy)
        self._stages = 1 + max((s for t in tied for s in t.stages), default=0)
        self._collectors: dict[tuple[int, int], Collector] = {}
        self._trees: dict[int, tuple[torch.Tensor, MicroTree]] = {}
        self._uses: dict[tuple[int, int, int], list[Use]] = {}  # (param id, stage, mb) -> uses
        self._sends: list[tuple[Any, torch.Tensor]] = []  # uses on their way to the owner

    def begin(self) -> None:
        """A step starts: whatever a failed step left is dropped."""
        self._collectors.clear()
        self._trees.clear()
        self._uses.clear()
        self._sends.clear()

    @contextlib.contextmanager
    def forward(self, s: int, i: int, batch: int, device: torch.device) -> Iterator[None]:
        """Around stage ``s``'s forward of micro-batch ``i`` (``batch`` samples) in training."""
        with collecting(batch, self.unit, held=True, device=device) as c:
            self._collectors[(s, i)] = c
            yield

    def backward_done(self, s: int, i: int) -> None:
        """Stage ``s``'s backward of micro-batch ``i`` is done: its weights' sums are made."""
        for param, uses in self._collectors.pop((s, i)).finish():
            tied = self._tied_of.get(id(param))
            if tied is None:
                grad = sum_uses(param, uses)
                self._trees.setdefault(id(param), (param, MicroTree()))[1].add(i, grad)
                continue
            k, t, _ = tied
            # Tied across stages: the owner adds the stages' uses at the step's end; those of
            # another rank are sent now, so that they wait there while this rank works on.
            owner = self._owner(t)
            if owner == self.rank:
                self._uses[(id(param), s, i)] = uses
                continue
            assert t.group is not None
            self._sends += _send_uses(t.group, t.ranks.index(owner), uses, param.device,
                                      self._tag(k, s, i))  # fmt: skip

    def _owner(self, t: Tied) -> int:
        """The rank of the tied weight's latest stage, where its uses are summed."""
        return stage_rank(max(t.stages), self.p)

    def _tag(self, k: int, s: int, i: int) -> int:
        """The tag of stage ``s``'s uses of tied weight ``k`` in micro-batch ``i``.

        One per message stream: the owner receives them in an order of its own.
        """
        return _TAGS + (k * self._stages + s) * self.m + i

    def finish(self) -> None:
        """At the step's end, on every rank of the pipeline: every gradient set.

        Each parameter's ``.grad`` gets the step's sum added (set where it had none). Each
        tied weight's owner first receives its other stages' uses and sums them all.
        """
        for k, t, copy in self._tied_of.values():
            if self._owner(t) == self.rank:
                self._tied_sum(k, t, copy)
        for work, _ in self._sends:  # (the tensors sent are kept alive until here)
            work.wait()
        self._sends.clear()
        with torch.no_grad():
            for param, tree in self._trees.values():
                if tree.count != self.m:
                    self._trees.clear()
                    raise ShardlineError(
                        f"deterministic pipeline: a parameter of shape {list(param.shape)} got "
                        f"gradients from {tree.count} of the step's {self.m} micro-batches; "
                        "its sum over the batch would not be one process's. Use every "
                        "trained parameter in every micro-batch (or freeze it)"
                    )
                grad = tree.total()
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
        self._trees.clear()
        if self._collectors or self._uses:
            left = sorted(self._collectors) or sorted({(s, i) for _, s, i in self._uses})
            self._collectors.clear()
            self._uses.clear()
            raise ShardlineError(
                f"deterministic pipeline: the weight sums of (stage, micro-batch) {left} were "
                "never made; the schedule ran a forward without its backward"
            )

    def _tied_sum(self, k: int, t: Tied, param: torch.Tensor) -> None:
        """The owner: every stage's uses of each micro-batch added, latest stage first."""
        order = sorted(t.stages, reverse=True)  # backward reaches the latest stage first
        tree = MicroTree()
        for i in range(self.m):
            uses: list[Use] = []
            for s in order:
                rank = stage_rank(s, self.p)
                if rank == self.rank:
                    uses += self._uses.pop((id(param), s, i))
                else:
                    assert t.group is not None
                    src = t.ranks.index(rank)
                    uses += _recv_uses(t.group, src, param.device, self._tag(k, s, i))
            tree.add(i, sum_uses(param, uses))
        self._trees[id(param)] = (param, tree)


_TAGS = 1 << 20  # the tags of the tied weights' uses start here (the tied group's own)


def _send_uses(
    group: ProcessGroup, dst: int, uses: list[Use], device: torch.device, tag: int
) -> list[tuple[Any, torch.Tensor]]:
    """One micro-batch's uses of a weight, sent to rank ``dst`` of ``group`` (``_recv_uses``).

    Returns the sends started, with their tensors, to wait for.
    """
    messages = [torch.tensor([len(uses)], device=device)]
    for use in uses:
        tensors = [t.to(device) for t in use.tensors()]
        messages.append(boundary.encode(boundary.specs_of(tensors), device, "a tied weight's use"))
        messages.append(boundary.pack(tensors))
    return [(group.send(m, dst, async_op=True, tag=tag), m) for m in messages]


def _recv_uses(group: ProcessGroup, src: int, device: torch.device, tag: int) -> list[Use]:
    count = torch.zeros(1, dtype=torch.int64, device=device)
    group.recv(count, src, tag=tag)
    uses = []
    for _ in range(int(count)):
        meta = torch.zeros(boundary.META_LEN, dtype=torch.int64, device=device)
        group.recv(meta, src, tag=tag)
        buf, views = boundary.empty(boundary.decode(meta), device)
        group.recv(buf, src, tag=tag)
        uses.append(use_of(views))
    return uses
