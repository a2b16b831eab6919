"""Micro-batch mode: every layout's bits the same, on the model's own kernels.

``deterministic=True`` makes a sample's gradient the same bits whatever batch it is in, by
per-sample gradients on kernels of its own: on a GPU those cost far more than the model's.
Yet a kernel given the same shapes and values on the same hardware gives the same bits
(torch's deterministic algorithms and a fixed cuBLAS workspace, as ``deterministic="repeat"``
sets). So fix the unit instead of the kernels (``deterministic="microbatch"``):

1. Each step's global batch is cut into micro-batches of the same ``size`` samples in every
   layout. A rank's backward is one micro-batch, run by the model's own kernels: the same
   shapes and values everywhere, so the same gradient bits whichever rank runs it.
2. At the ``k``-th backward of a step, rank ``r`` of ``W`` holds micro-batch ``k * W + r``
   (``rank_microbatches``), and the group adds the ranks' gradients in the canonical tree
   (``tree_group``, the group itself over two ranks or one: two ranks' sum is one addition
   whatever the algorithm): the ``W`` consecutive micro-batches of that backward, a subtree.
3. The backwards' sums are added in the same tree as they come (a binary counter holds one
   sum per level), and the whole sum is the gradient the optimizer steps on. With ``W`` a
   power of two, the blocks of ``W`` micro-batches are subtrees of the tree over all of
   them, so every layout adds the micro-batches in one tree: ``W`` ranks with ``S``
   backwards a step give the bits of one process with ``W * S``.
4. Means need nothing: a micro-batch's loss is its mean divided by the backwards a step,
   the group's ``avg`` divides by ``W``; powers of two, which scale without rounding.

The bits still depend on the micro-batch's size and on the kernels (the GPU model, torch's
and cuBLAS's versions; on CPU the threads a process runs, which cut torch's sums); not on the
world size, the strategy or the number of backwards. Any model, layers and recompute: its
kernels are its own.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.comm.world import default_group
from shardline.errors import InvalidArgumentError

__all__ = ["MicrobatchSums", "rank_microbatches"]


def rank_microbatches(batch: Any, size: int, group: ProcessGroup | None = None) -> list[Any]:
    """This rank's micro-batches of a step's global ``batch``, in the order to run them.

    ``batch`` is the whole step's batch (a tensor, or a tuple or list of tensors cut alike),
    the same on every rank, its samples along dim 0. Rank ``r`` of the group's ``W`` gets
    micro-batches ``r``, ``W + r``, ``2W + r``, ... of ``size`` samples each: one per
    backward, each the loss's mean divided by their number.

    Raises:
        InvalidArgumentError: the batch is not a whole number of ``W * size`` samples.
    """
    g = group if group is not None else default_group()
    parts = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    n = int(parts[0].shape[0])
    per_step = g.world_size * size
    if size < 1 or n % per_step or any(int(p.shape[0]) != n for p in parts):
        raise InvalidArgumentError(
            f"rank_microbatches: a batch of {[int(p.shape[0]) for p in parts]} samples does "
            f"not cut into micro-batches of {size} for {g.world_size} ranks; give each step "
            f"a multiple of {per_step} samples (every part alike)"
        )
    out = []
    for k in range(n // per_step):
        lo = (k * g.world_size + g.rank) * size
        cut = tuple(p[lo : lo + size] for p in parts)
        out.append(cut if isinstance(batch, (tuple, list)) else cut[0])
    return out


class MicrobatchSums:
    """Adds each step's backwards' gradients in the canonical tree (see the module's text).

    Watches ``model`` (the strategy's wrapper: its ``parameters()`` are what ``optimizer``
    steps). A forward after a backward keeps that backward's gradients (a copy; ``.grad``
    becomes ``None``, as after ``zero_grad``, so the strategy starts the next one afresh);
    the optimizer's step adds the last one and writes the whole sum into each ``.grad`` (in
    place: a strategy's views of its buffers stay its views); its ``zero_grad`` drops what is
    kept. One backward a step keeps nothing. A gradient is a backward's when it is new since
    the last ``zero_grad`` (another tensor, or the same one written since), so gradients
    zeroed in place (``zero_grad(set_to_none=False)``) count for none.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._levels: list[tuple[int, list[torch.Tensor | None]]] = []  # (leaves, sums)
        # Each gradient ``zero_grad`` left in place (zeroed), as (id, version): not a backward's.
        self._zeroed: dict[int, tuple[int, int]] = {}
        self._handles = [
            model.register_forward_pre_hook(self._before_forward),
            optimizer.register_step_pre_hook(self._before_step),
        ]
        zero_grad = optimizer.zero_grad

        def zero_grad_and_drop(*args: Any, **kwargs: Any) -> None:
            self._levels.clear()
            zero_grad(*args, **kwargs)
            self._zeroed = {
                i: (id(p.grad), p.grad._version)
                for i, p in enumerate(self._params)
                if p.grad is not None
            }

        optimizer.zero_grad = zero_grad_and_drop  # type: ignore[method-assign]
        if callable(getattr(model, "no_sync", None)):
            # Each backward's gradients must be the group's sum before they are kept: under
            # ``no_sync`` they would be this rank's alone, and the step silently wrong.
            model.__dict__["no_sync"] = _refuse_no_sync  # (found before the class's method)

    @property
    def backwards(self) -> int:
        """The backwards kept since the last step (the current gradients not counted)."""
        return sum(n for n, _ in self._levels)

    def _fresh(self) -> bool:
        """Whether a backward wrote gradients since the last ``zero_grad`` or ``_take``."""
        zeroed = self._zeroed
        for i, p in enumerate(self._params):
            g = p.grad
            if g is not None and zeroed.get(i) != (id(g), g._version):
                return True
        return False

    def _take(self) -> list[torch.Tensor | None] | None:
        """The gradients of the last backward (``None``: there was none since)."""
        if not self._fresh():
            return None
        grads = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        self._zeroed = {}
        # A copy: a strategy may hand out views of buffers it fills again next backward.
        return [None if g is None else g.detach().clone() for g in grads]

    def _push(self, leaf: list[torch.Tensor | None]) -> None:
        """Adds one backward's gradients to the counter: equal subtrees join, left + right."""
        size, sums = 1, leaf
        while self._levels and self._levels[-1][0] == size:
            _, left = self._levels.pop()
            sums, size = self._join(left, sums), size * 2
        self._levels.append((size, sums))

    @staticmethod
    def _join(
        left: list[torch.Tensor | None], right: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for a, b in zip(left, right, strict=True):
            if a is None or b is None:  # a parameter a backward left without a gradient
                out.append(b if a is None else a)  # adds zeros, as the group's sum does
                continue
            out.append(a.add_(b))  # ``a`` is this counter's own (a copy, or a sum)
        return out

    def _before_forward(self, _module: nn.Module, _args: Any) -> None:
        if torch.is_grad_enabled():
            leaf = self._take()
            if leaf is not None:
                self._push(leaf)

    def _before_step(self, _opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if not self._levels:  # one backward: its gradients are the sum already
            return
        fresh = self._fresh()
        total = self.backwards + fresh
        if total & (total - 1):
            raise InvalidArgumentError(
                f"deterministic='microbatch': {total} backwards before this step; run a "
                "power of two of micro-batches a step (each loss divided by their number, "
                "which then scales without rounding); the gradients are kept as they are"
            )
        if fresh:  # no copy: the last leaf is only ever a right operand, never added into
            self._push([None if p.grad is None else p.grad.detach() for p in self._params])
        for p, g in zip(self._params, self._fold(), strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:  # the strategy's own tensor (a view of its buffer), written in place
                p.grad.copy_(g)

    def _fold(self) -> list[torch.Tensor | None]:
        """The whole sum of the kept backwards (at least one), which are then dropped.

        The counter holds the canonical tree's left subtrees, largest first: adding them from
        the right gives the tree over any number of leaves.
        """
        levels, self._levels = self._levels, []
        _, sums = levels[-1]
        for _, left in reversed(levels[:-1]):
            sums = self._join(left, sums)
        return sums

    def remove(self) -> None:
        """Stops watching (the gradients kept so far are dropped)."""
        for h in self._handles:
            h.remove()
        self._levels.clear()


def _refuse_no_sync() -> None:
    raise InvalidArgumentError(
        "deterministic='microbatch': no_sync() would keep a backward's gradients unreduced; "
        "the mode reduces every backward (one micro-batch each) and adds them in the step's "
        "tree: run the micro-batches' backwards without it"
    )


def check_power_of_two(world_size: int) -> None:
    """Refuses a world size whose blocks of micro-batches are not subtrees of the tree."""
    if world_size & (world_size - 1):
        raise InvalidArgumentError(
            f"distribute(deterministic='microbatch'): {world_size} ranks; the ranks' "
            "micro-batches are a subtree of the step's tree only for a power of two of ranks "
            f"(use {2 ** int(math.log2(world_size))} or {2 ** math.ceil(math.log2(world_size))})"
        )
