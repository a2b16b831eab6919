"""Cross-entropy over logits split along the vocabulary, never gathering them (Megatron's).

Each rank holds ``logits[..., start : start + V/t]``. The loss needs three sums over the whole
vocabulary, each an all-reduce of one number per token: the maximum (for a stable softmax),
the sum of exponentials, and the target's logit (on the rank that holds it, zero elsewhere).
The gradient is this rank's part of ``softmax - one_hot(target)``, with no communication.
Computed in float32 whatever the logits' dtype.

Deterministic mode (``blocks``): the sum of exponentials is cut into ``blocks`` equal parts of
each rank's slice, added in the canonical tree (``shardline.comm.tree``), so one process
(``group=None``) and every tensor-parallel size that divides the blocks (each rank ``blocks /
t`` of them, the group a ``tree_group``) make the same sum, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from shardline.comm.group import ProcessGroup
from shardline.comm.tree import tree_sum
from shardline.errors import InvalidArgumentError

__all__ = ["causal_lm_loss", "vocab_parallel_cross_entropy", "vocab_parallel_loss"]


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: ProcessGroup | None,
        ignore: int,
        blocks: int,
    ) -> torch.Tensor:
        z = logits.float()
        rows = z.shape[-1]
        start = 0 if group is None else group.rank * rows
        top = z.max(dim=-1).values
        if group is not None:
            group.all_reduce(top, op="max")
        z = z - top.unsqueeze(-1)
        here = (target >= start) & (target < start + rows)
        local = torch.where(here, target - start, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * here
        exp = z.exp()
        # Each block's sum, then the blocks' in the tree (one block: its sum, as it is).
        parts = exp.view(*exp.shape[:-1], blocks, rows // blocks).sum(dim=-1)
        total = tree_sum(parts.movedim(-1, 0).contiguous(), fresh=True)
        if group is not None:
            group.all_reduce(picked)
            group.all_reduce(total)
        keep = target != ignore
        loss = (total.log() - picked) * keep
        exp /= total.unsqueeze(-1)  # the softmax, this rank's part
        ctx.save_for_backward(exp, local, here & keep, keep)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, local, hit, keep = ctx.saved_tensors
        out = softmax * keep.unsqueeze(-1)
        out.scatter_add_(-1, local.unsqueeze(-1), -hit.to(out.dtype).unsqueeze(-1))
        out *= grad.unsqueeze(-1)
        return out.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup | None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    blocks: int = 1,
) -> torch.Tensor:
    """``F.cross_entropy`` of the whole logits, from this rank's vocabulary slice of them.

    Args:
        logits: ``(..., V / t)``: this rank's slice (rank ``r`` holds ids ``r V/t ..``).
        target: ``(...)``: ids into the whole vocabulary.
        group: The tensor-parallel group the vocabulary is split over (``None``: one
            process, the logits whole).
        ignore_index: A target id that counts for nothing (as in ``F.cross_entropy``).
        reduction: ``"mean"`` (over the targets not ignored), ``"sum"`` or ``"none"``.
        blocks: Parts of this rank's slice whose sums of exponentials are added in the
            canonical tree (deterministic mode; see the module's text).
    """
    if logits.shape[:-1] != target.shape:
        raise InvalidArgumentError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
            f"{tuple(target.shape)} disagree; target must be logits' shape without the last dim"
        )
    if reduction not in ("mean", "sum", "none"):
        raise InvalidArgumentError(f"reduction={reduction!r}: use 'mean', 'sum' or 'none'")
    if blocks < 1 or logits.shape[-1] % blocks:
        raise InvalidArgumentError(
            f"vocab_parallel_cross_entropy: blocks={blocks} must be >= 1 and divide this "
            f"rank's {logits.shape[-1]} logits"
        )
    loss: torch.Tensor = _VocabCrossEntropy.apply(logits, target, group, ignore_index, blocks)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum().clamp(min=1)


def vocab_parallel_loss(
    logits: torch.Tensor, targets: torch.Tensor, *, group: ProcessGroup | None, blocks: int = 1
) -> torch.Tensor:
    """A language model's mean loss (``(batch, seq, V / t)`` logits), for a ``loss_fn``."""
    return vocab_parallel_cross_entropy(logits, targets, group, blocks=blocks)


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    *,
    group: ProcessGroup,
    **_: Any,
) -> torch.Tensor:
    """Hugging Face's causal-LM loss (``ForCausalLMLoss``) from vocabulary-split logits.

    The same arguments and the same result: labels shifted left (each token predicts the
    next), ``ignore_index`` skipped, the mean, or the sum over ``num_items_in_batch``.
    """
    if shift_labels is None:
        padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = padded[..., 1:]
    target = shift_labels.to(logits.device)
    if num_items_in_batch is None:
        return vocab_parallel_cross_entropy(logits, target, group, ignore_index=ignore_index)
    total = vocab_parallel_cross_entropy(
        logits, target, group, ignore_index=ignore_index, reduction="sum"
    )
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
