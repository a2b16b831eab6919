"""DDP's gradient buckets: which parameters share a flat buffer, and in which order.

A bucket packs the gradients of a few parameters of one dtype into one flat buffer reduced by
one collective; a large gradient may be its own ``in_place`` bucket, reduced where autograd left
it. Buckets are reduced in the order they fill up, so no bucket waits behind a later one.
``fill_slot`` puts a gradient where its bucket reduces it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shardline.comm.group import ProcessGroup
from shardline.comm.symmetric import SymmetricArena
from shardline.errors import InvalidArgumentError

__all__ = [
    "Bucket",
    "StepState",
    "build_buckets",
    "dense_permuted",
    "fill_slot",
    "move_bucket_grads",
    "symmetric_buckets",
]


@dataclass
class Bucket:
    """What one collective reduces.

    Either a flat buffer packing the gradients of a few parameters of one dtype, or
    (``in_place``) one large gradient, reduced where autograd left it (no copies).
    """

    index: int
    dtype: torch.dtype
    params: list[int]
    offsets: list[int]
    flat: torch.Tensor
    in_place: bool = False
    pending: int = 0
    finish: Callable[[], None] | None = None

    def view(self, slot: int, param: torch.Tensor) -> torch.Tensor:
        """The slot, shaped (and, for channels_last parameters, strided) like ``param``."""
        start = self.offsets[slot]
        if dense_permuted(param) and not param.is_contiguous():
            return self.flat.as_strided(
                param.shape, param.stride(), self.flat.storage_offset() + start
            )
        return self.flat[start : start + param.numel()].view(param.shape)


def dense_permuted(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` elements in some dimension order."""
    return any(
        t.is_contiguous(memory_format=f)
        for f in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
        if f is torch.contiguous_format or t.dim() == (4 if f is torch.channels_last else 5)
    )


@dataclass
class StepState:
    """What one synchronised backward has seen so far."""

    ready: list[bool]
    order: list[int] = field(default_factory=list)
    next_bucket: int = 0


def build_buckets(
    params: Sequence[torch.Tensor],
    order: list[int],
    in_place_ok: Callable[[torch.Tensor], bool],
    first_bytes: int,
    cap_bytes: int,
    device: torch.device,
    alloc: Callable[[int, torch.dtype], torch.Tensor] | None = None,
) -> tuple[list[Bucket], list[tuple[int, int]]]:
    """Buckets for ``params`` filled in ``order`` (first ready first), and each one's slot.

    The first bucket holds up to ``first_bytes`` (small, so communication starts early), the
    others ``cap_bytes``. ``alloc(numel, dtype)`` gives each packed bucket its zero-filled
    buffer (``torch.zeros`` on ``device`` when ``None``; DDP passes a symmetric arena's
    ``take``). Returns the buckets and, per parameter, ``(bucket, slot)``.
    """
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    closed: list[tuple[torch.dtype, list[int]]] = []
    for i in order:
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if in_place_ok(p):
            closed.append((p.dtype, [i]))
            continue
        members, size = open_.get(p.dtype, ([], 0))
        cap = first_bytes if not closed else cap_bytes
        if members and size + nbytes > cap:
            closed.append((p.dtype, members))
            members, size = [], 0
        open_[p.dtype] = ([*members, i], size + nbytes)
    closed.extend((dt, members) for dt, (members, _) in open_.items() if members)
    # Reduce buckets in the order they fill up (their last gradient arrives): no bucket waits
    # behind one that completes later, and small gradients that arrive between large in-place
    # ones still share a bucket (one collective instead of many).
    rank_in_order = {i: k for k, i in enumerate(order)}
    closed.sort(key=lambda c: max(rank_in_order[i] for i in c[1]))
    buckets: list[Bucket] = []
    slot = [(0, 0)] * len(params)
    for b, (dtype, members) in enumerate(closed):
        offsets, total = [], 0
        for s, i in enumerate(members):
            offsets.append(total)
            total += params[i].numel()
            slot[i] = (b, s)
        if len(members) == 1 and in_place_ok(params[members[0]]):
            # The gradient tensor itself is reduced; ``flat`` is set at every step.
            empty = torch.empty(0, dtype=dtype, device=device)
            buckets.append(Bucket(b, dtype, members, offsets, empty, in_place=True))
            continue
        flat = (
            alloc(total, dtype)
            if alloc is not None
            else torch.zeros(total, dtype=dtype, device=device)
        )
        buckets.append(Bucket(b, dtype, members, offsets, flat))
    return buckets, slot


def fill_slot(
    bucket: Bucket,
    slot: int,
    p: torch.Tensor,
    grad: torch.Tensor | None,
    scale: float,
    *,
    used: bool,
    as_view: bool,
    name: str,
) -> None:
    """Puts ``p``'s gradient times ``scale`` (zeros for none) where ``bucket`` reduces it.

    An ``in_place`` bucket reduces the gradient itself (a copy of one this rank did not
    ``used``); a packed one gets it in ``slot``, which then is ``p.grad`` (``as_view``).
    """
    if bucket.in_place:
        if grad is None:
            bucket.flat = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        elif not used:
            # A stale gradient of a parameter this rank did not use stays untouched
            # unless some rank used it (decided after the reduction).
            bucket.flat = grad.clone(memory_format=torch.contiguous_format)
        else:
            bucket.flat = grad
        return
    view = bucket.view(slot, p)
    if grad is not None and not used and grad.data_ptr() == view.data_ptr():
        # The stale gradient lives in this slot (gradient_as_bucket_view): keep a copy
        # as the parameter's gradient, in case no rank used it.
        grad = grad.clone()
        p.grad = grad
    if grad is None:
        view.zero_()
        return
    if grad.is_sparse:
        raise InvalidArgumentError(
            f"DistributedDataParallel: parameter {name!r} got a sparse gradient; sparse "
            "gradients are not supported"
        )
    # Divide while copying, as torch's reducer does (mul_out by 1/world_size).
    torch.mul(grad, scale, out=view)
    if used and as_view and grad.data_ptr() != view.data_ptr():
        p.grad = view  # as torch's reducer: autograd's tensor freed now, for its memory's reuse


def move_bucket_grads(
    params: Sequence[torch.Tensor],
    old: Sequence[Bucket],
    new: Sequence[Bucket],
    slot: Sequence[tuple[int, int]],
) -> None:
    """Gradients that view ``old`` buckets (``gradient_as_bucket_view``) move into ``new``.

    Their values are kept, and the old buffers are no longer held once the caller drops them.
    """
    held = {b.flat.untyped_storage().data_ptr() for b in old if b.flat.numel()}
    for i, p in enumerate(params):
        g = p.grad
        if g is None or g.untyped_storage().data_ptr() not in held:
            continue
        bucket = new[slot[i][0]]
        if not bucket.in_place:
            view = bucket.view(slot[i][1], p)
            view.copy_(g)
            p.grad = view


def symmetric_buckets(
    params: Sequence[torch.Tensor], group: ProcessGroup, required: bool
) -> tuple[bool, Callable[[int, torch.dtype], torch.Tensor]]:
    """``build_buckets``' ``alloc`` from one symmetric arena with room for every gradient.

    A collective of ``group``. Returns whether the buffers are symmetric: not where some rank
    has no room and ``required`` is false (ordinary ones then, with a warning).
    """
    sizes = [(p.numel(), p.dtype) for p in params]
    arena = SymmetricArena(SymmetricArena.bytes_for(sizes), group=group, required=required)
    return arena.symmetric, arena.take
