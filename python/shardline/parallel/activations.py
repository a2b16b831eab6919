"""What one forward saves for backward, counted on the meta device (the memory planner's).

``estimate_activations`` runs the model's forward on meta tensors of the right shapes and
counts the storages autograd saves; ``planner`` adds them to a strategy's estimate. Two
things differ from a plain meta forward: ``F.scaled_dot_product_attention`` is counted as the
fused kernels that CPUs and GPUs run save it (its meta reference saves the attention
weights), and blocks that recompute in backward count what recomputation keeps, with what
one block makes again in backward apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from shardline.parallel.precision import MixedPrecision
from shardline.parallel.recompute.blocks import kept_under_recompute

__all__ = ["count_activations", "estimate_activations"]


def estimate_activations(
    model: nn.Module,
    example_input: Any,
    mixed_precision: MixedPrecision | None = None,
    recompute: str | None = None,
) -> int:
    """Bytes of tensors autograd saves in one forward of ``example_input``.

    The forward runs on the meta device: parameters and buffers are replaced by meta tensors
    of the same shapes (cast to the compute dtype under ``mixed_precision``, floating inputs
    too), so nothing is allocated or computed. Saved tensors that are parameters (or views of
    them) are skipped, and a tensor saved several times (or through several views) counts once,
    at the size of its storage. ``F.scaled_dot_product_attention`` counts what the fused
    kernels save (inputs, output, a log-sum-exp per query), not the attention weights its
    meta reference saves. Blocks that recompute in backward (``recompute_blocks``, or
    ``recompute`` naming the policy) count what that keeps instead of what they save (what
    they make again in backward is ``MemoryEstimate.recomputed``).

    Args:
        model: The plain model.
        example_input: A tensor, a tuple of positional arguments or a dict of keyword arguments.
        mixed_precision: The policy whose compute dtype the forward runs in.
        recompute: ``"selective"`` or ``"full"``, as given to ``distribute``.
    """
    return count_activations(model, example_input, mixed_precision, recompute)[0]


def count_activations(
    model: nn.Module,
    example_input: Any,
    mixed_precision: MixedPrecision | None = None,
    recompute: str | None = None,
) -> tuple[int, int]:
    """``(kept, made again)``: ``estimate_activations``'s bytes, and more.

    The second is the most that one call of a recomputing block makes again in backward,
    alive while that call's backward runs.
    """

    def meta(t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
        dtype = t.dtype
        if mixed_precision is not None and t.is_floating_point():
            dtype = mixed_precision.compute_dtype(t.dtype)
        out = torch.empty(t.shape, dtype=dtype, device="meta")
        return out.requires_grad_(requires_grad and dtype.is_floating_point)

    params = {n: meta(p, p.requires_grad) for n, p in model.named_parameters()}
    state = {**{n: meta(b) for n, b in model.named_buffers()}, **params}
    param_ids = {id(p) for p in params.values()}
    if isinstance(example_input, Mapping):
        args: tuple[Any, ...] = ()
        kwargs = {k: _map_tensors(v, meta) for k, v in example_input.items()}
    else:
        raw = example_input if isinstance(example_input, tuple) else (example_input,)
        args, kwargs = tuple(_map_tensors(a, meta) for a in raw), {}

    # [Note: saved tensors are kept alive until the count is done, so ids are never reused.]
    saved: dict[int, tuple[torch.Tensor, int]] = {}
    saved_elsewhere: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        if id(base) not in param_ids and id(base) not in saved:
            saved[id(base)] = (base, base.untyped_storage().nbytes())

    # What each block call drops, by call: backward makes one call's again at a time.
    dropped: dict[int, dict[int, int]] = {}
    with kept_under_recompute(model, recompute, keep) as (counted, running):

        def pack(t: torch.Tensor) -> torch.Tensor:
            if counted(t):
                keep(t)
            elif (call := running()) is not None:
                base = t if t._base is None else t._base
                if id(base) not in param_ids:
                    saved_elsewhere.append(base)  # alive until counted: ids stay unique
                    dropped.setdefault(call, {})[id(base)] = base.untyped_storage().nbytes()
            return t

        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            _FusedAttention(),
        ):
            out = torch.func.functional_call(model, state, args, kwargs, strict=False)
    del out
    again = max(
        (sum(n for key, n in call.items() if key not in saved) for call in dropped.values()),
        default=0,
    )
    return sum(nbytes for _, nbytes in saved.values()), again


class _FusedAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` saving what the fused kernels save, on the meta device.

    On the meta device it runs as its reference (the math kernel), which saves the attention
    weights (batch x heads x queries x keys, in float32). The kernels CPUs and GPUs run
    (flash, memory-efficient) save the inputs, the output and a float32 log-sum-exp per query
    instead, so those are what is counted (and a mask, when one is given).
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        extra = (mask,) if isinstance(mask, torch.Tensor) else ()
        return _SavedLikeFused.apply(q, k, v, *extra)


class _SavedLikeFused(torch.autograd.Function):
    """The output of attention over ``q, k, v``, with the fused kernels' saved tensors."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: Any) -> Any:
        if q.dim() == 4:  # the fused kernels write (batch, queries, heads, dim), transposed
            b, h, n, _ = q.shape
            out = q.new_empty((b, n, h, v.shape[-1])).transpose(1, 2)
        else:
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, *mask)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - only ever counted
        raise NotImplementedError("the planner's meta forward has no backward")


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Applies ``fn`` to every tensor in nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, tuple | list):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, Mapping):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value
