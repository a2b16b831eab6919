"""The layers whose parameters get per-unit gradients: linear, layer norm, embedding.

Each patched layer runs its usual forward outside a deterministic forward (evaluation, no
grad). Inside one it runs an autograd function that computes the input's gradient as torch
does and hands the parameters' per-unit gradients to the forward's ``Collector``, which
returns their tree sum as the parameter's gradient once its last use has given.

The tensor-parallel layers (column, row, vocabulary) run the same functions on their slices.
A linear layer with a ``Split`` (``_sl_split``: set on the dense layer with ``blocks``, and on
its tensor-parallel slice) cuts its split sum into fixed blocks (``split``) and adds the ranks'
sums in its group's tree, where the tensor-parallel layer's own regions would all-reduce.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardline import _native
from shardline.comm.tree import built_kernels, tree_sum
from shardline.errors import InvalidArgumentError
from shardline.parallel.deterministic import kernels
from shardline.parallel.deterministic.collector import (
    Collector,
    Dense,
    Lookups,
    Products,
    Rows,
    Summed,
    Use,
)
from shardline.parallel.deterministic.split import Split, column_input_grad, row_output
from shardline.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shardline.parallel.tensor.regions import gather_from, reduce_from

__all__ = ["ACTIVE", "LAYERS", "check_layer"]

ACTIVE = threading.local()  # .collector: that of the deterministic forward on this thread


def _collector(x: torch.Tensor, layer: nn.Module) -> Collector | None:
    c: Collector | None = getattr(ACTIVE, "collector", None)
    if c is None or not torch.is_grad_enabled():
        return None
    if x.dim() == 0 or x.shape[0] != c.batch:
        where = f"nn.{type(layer).__name__} {layer._sl_name!r}"
        raise InvalidArgumentError(
            f"deterministic mode: {where} got an input of shape {list(x.shape)}, whose first "
            f"dimension is not the batch's {c.batch} samples. Its gradient would be summed "
            "over the samples by autograd, in an order that depends on the batch size; give "
            "it one row per sample (for positions: torch.arange(n).expand(batch, n))"
        )
    return c


def _row_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, split: Split
) -> torch.Tensor:
    """A row layer's output: its blocks' sum, the ranks' sum in the tree, then the bias."""
    y = row_output(x, weight, split.blocks)
    if split.group is not None:  # in place of the row layer's reduce_from
        split.group.all_reduce(y)
    return y if bias is None else y.add_(bias)


def _evaluated(m: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """A row layer's output without grad, as in training (the same bits in every layout).

    ``None``: run the layer's own forward (no split sum here, or autograd recording one).
    """
    split: Split | None = getattr(m, "_sl_split", None)
    if split is None or split.role != "row" or torch.is_grad_enabled():
        return None
    return _row_forward(x, m.weight, m.bias, split)  # type: ignore[arg-type]


def _per_unit_sum(dys: torch.Tensor, split: Split | None = None) -> torch.Tensor:
    """``dys`` (``[units, rows, *features]``) summed over rows: a bias's or norm's per-unit part.

    ``dys.sum(1)`` vectorises across the features and adds the last few (the tail past the
    vector width) another way, so on CPU a feature's bits depend on where it sits, which a
    column layer's slice of the output features changes; on a GPU the reduction's strategy
    follows the whole tensor's shape, so they depend on the number of units too. There each
    unit's rows are added in order in one kernel (``gpu_rows``, Triton), or without Triton in
    the tree, a row at a time (elementwise adds); either gives the same bits at any width and
    any number of units, in float32 for low-precision rows.
    """
    rows = _gpu_rows(dys.device) if dys.is_cuda else None
    if rows is not None:
        sums: torch.Tensor = rows.row_sums(dys)  # each unit's rows in order
        return sums
    if dys.dtype in (torch.bfloat16, torch.float16):
        dys = dys.float()
    if dys.dtype == torch.float32 and not dys.is_cuda:  # the engine: each unit's rows in order
        out = dys.new_empty(dys.shape[:1] + dys.shape[2:])
        _native.unit_row_sums(dys.contiguous(), out, dys.shape[0], out[0].numel(), _threads(dys))
        return out
    if dys.is_cuda or (split is not None and split.role == "column"):
        return tree_sum(dys, dim=1)
    return dys.sum(1)


def _bias_use(dys: torch.Tensor, split: Split | None, weight: Products | None = None) -> Use:
    """A bias's per-unit gradients: its output gradient summed over each unit's rows.

    ``weight``: the layer's weight's use; on a GPU, where its launch can, it makes the bias's
    tree too (``Products.bias_summed``), with the same bits.
    """
    rows = _gpu_rows(dys.device) if dys.is_cuda else None
    if rows is None:
        return Dense(_per_unit_sum(dys, split))
    if weight is not None and weight.bias_fits and rows.tree_fits(dys.shape[0]):
        weight.with_bias = True

    def make(tree: bool, low: torch.dtype | None) -> Summed:
        if tree and weight is not None and weight.with_bias:
            return weight.bias_summed(low)
        rounded = None if low is None else dys.new_empty(dys.shape[2:], dtype=low)
        return rows.row_sums(dys, tree=tree, rounded=rounded), rounded

    return Rows(make, rows.tree_fits(dys.shape[0]))


_THREADED_ROWS = 1 << 18  # elements from which the engine's row sums run on torch's threads
# The same for the layer norm's pass: about ten operations an element, where the row sums do
# one. On 16 x 64 rows of 64 (65,536), two threads took 28 us against 40 on one (2-core VM).
_THREADED_NORM = 1 << 15


def _threads(t: torch.Tensor, threaded: int = _THREADED_ROWS) -> int:
    """Torch's intra-op threads for a tensor of ``threaded`` elements or more, else one."""
    return torch.get_num_threads() if t.numel() >= threaded else 1


_GPU_ROWS: list[Any] = []  # ``gpu_rows`` once looked for ([None]: no Triton here)


def _gpu_rows(device: torch.device) -> Any:
    """``shardline.parallel.deterministic.gpu_rows``, or ``None`` (see ``built_kernels``)."""
    if _GPU_ROWS:  # looked for already: every backward asks
        return _GPU_ROWS[0]

    def load() -> Any:
        from shardline.parallel.deterministic import gpu_rows  # noqa: PLC0415  (Triton)

        return gpu_rows

    def trial(module: Any) -> None:
        z = torch.zeros(1, 1, 1, device=device)
        module.row_sums(z)
        module.norm_sums(z, z[..., 0], z[..., 0], z, [1], 1, True, True)

    return built_kernels(_GPU_ROWS, load, trial, "row-sum kernels")


def _autocast(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs a matrix product on ``x``'s device in here, or ``None``."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        c: Collector,
        split: Split | None,
    ) -> torch.Tensor:
        ctx.keys = (c.use(weight), None if bias is None else c.use(bias))
        low = _autocast(x)
        if low is not None:  # as autocast runs F.linear: in its dtype, the backward too
            x, weight = x.to(low), weight.to(low)
            bias = None if bias is None else bias.to(low)
        ctx.save_for_backward(x, weight)
        ctx.c, ctx.split = c, split
        if split is None or split.role != "row":
            return kernels.product(x, weight, bias) if x.is_cuda else F.linear(x, weight, bias)
        return _row_forward(x, weight, bias, split)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        c: Collector = ctx.c
        split: Split | None = ctx.split
        dx = None
        if ctx.needs_input_grad[0] and split is not None and split.role == "column":
            dx = column_input_grad(dy, weight, split.pieces, split.blocks)
            if split.group is not None:  # the ranks' sums (a column layer's copy_to)
                split.group.all_reduce(dx)
        elif ctx.needs_input_grad[0]:
            dx = kernels.product(dy, weight.t(), None) if dy.is_cuda else dy.matmul(weight)
        dys = dy.reshape(c.units, -1, dy.shape[-1])
        weight_use = Products(dys, x.reshape(c.units, -1, x.shape[-1]))
        bias_use = None if ctx.keys[1] is None else _bias_use(dys, split, weight_use)
        dw = c.give(ctx.keys[0], weight_use)
        db = None if bias_use is None else c.give(ctx.keys[1], bias_use)
        return dx, dw, db, None, None


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        shape: list[int],
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        c: Collector,
    ) -> torch.Tensor:
        if _autocast(x) is not None:  # autocast runs layer norms in float32
            x = x.float()
        out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.shape, ctx.c = shape, c
        ctx.keys = tuple(None if p is None else c.use(p) for p in (weight, bias))
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, rstd, weight, bias = ctx.saved_tensors
        c: Collector = ctx.c
        want_x, want_w, want_b = ctx.needs_input_grad[0], *(k is not None for k in ctx.keys)
        native = x.dtype == dy.dtype == torch.float32 and not dy.is_cuda
        if native and (weight is None or weight.dtype == torch.float32):
            # The engine: the input's gradient and the per-unit sums in one pass over the rows.
            dx = torch.empty(x.shape, dtype=x.dtype) if want_x else None  # x may be strided
            w = x.new_empty(c.units, *ctx.shape) if want_w else None
            b = x.new_empty(c.units, *ctx.shape) if want_b else None
            features = x.shape[-len(ctx.shape) :].numel()
            gamma = None if weight is None else weight.reshape(-1)
            _native.unit_norm_backward(
                x.contiguous(), mean.contiguous(), rstd.contiguous(), dy.contiguous(), w, b,
                c.units, features, _threads(x, _THREADED_NORM), gamma=gamma, dx=dx,
            )  # fmt: skip
            dw = None if w is None else c.give(ctx.keys[0], Dense(w))
            db = None if b is None else c.give(ctx.keys[1], Dense(b))
            return dx, None, dw, db, None, None
        dx = None
        if want_x:
            dx = torch.ops.aten.native_layer_norm_backward(
                dy, x, ctx.shape, mean, rstd, weight, bias, [True, False, False]
            )[0]
        dw = db = None
        rows = _gpu_rows(dy.device) if dy.is_cuda else None
        if rows is not None:  # both sums in one launch (and both trees in one more)
            made: dict[Any, tuple[tuple[Any, Any], torch.Tensor | None]] = {}
            kinds = int(want_w) + int(want_b)

            def make(tree: bool, low: torch.dtype | None, which: int) -> Summed:
                if (tree, low) not in made:  # both parameters' at the first one's call
                    rounded = None if low is None else dy.new_empty(kinds, *ctx.shape, dtype=low)
                    sums = rows.norm_sums(x, mean, rstd, dy, ctx.shape, c.units, want_w, want_b,
                                          tree=tree, rounded=rounded)  # fmt: skip
                    made[tree, low] = sums, rounded
                sums, rounded = made[tree, low]
                at = min(which, kinds - 1)  # the bias alone: the buffer's first
                return sums[which], None if rounded is None else rounded[at]

            if want_w:
                dw = c.give(ctx.keys[0], Rows(functools.partial(make, which=0), tree_fits=True))
            if want_b:
                db = c.give(ctx.keys[1], Rows(functools.partial(make, which=1), tree_fits=True))
            return dx, None, dw, db, None, None
        dys = dy.reshape(c.units, -1, *dy.shape[-len(ctx.shape) :])
        if want_w:
            products = torch.sub(x, mean).mul_(rstd).mul_(dy)  # x-hat times dy
            dw = c.give(ctx.keys[0], Dense(_per_unit_sum(products.reshape(dys.shape))))
        if want_b:
            db = c.give(ctx.keys[1], Dense(_per_unit_sum(dys)))
        return dx, None, dw, db, None, None


class _EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        idx: torch.Tensor,
        weight: torch.Tensor,
        padding_idx: int | None,
        c: Collector,
        here: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(idx, here)
        ctx.padding_idx, ctx.rows, ctx.c = padding_idx, weight.shape[0], c
        ctx.key = c.use(weight)
        out = F.embedding(idx, weight, padding_idx)
        # ``here``: the ids this rank's rows hold (a vocabulary slice); the others give zeros.
        return out if here is None else out.masked_fill_(~here.unsqueeze(-1), 0)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        idx, here = ctx.saved_tensors
        c: Collector = ctx.c
        flat, rows = idx.reshape(-1), dy.reshape(-1, dy.shape[-1])
        unit = torch.arange(c.units, device=idx.device).repeat_interleave(flat.numel() // c.units)
        keep = None if here is None else here.reshape(-1)
        if ctx.padding_idx is not None:  # the padding row gets no gradient
            pad = flat != ctx.padding_idx
            keep = pad if keep is None else keep & pad
        if keep is not None:
            flat, rows, unit = flat[keep], rows[keep], unit[keep]
        dw = c.give(ctx.key, Lookups(c.units, unit, flat, rows, ctx.rows))
        return None, dw, None, None, None


def _linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    c = _collector(x, self)
    if c is None:
        y = _evaluated(self, x)
        return F.linear(x, self.weight, self.bias) if y is None else y
    out: torch.Tensor = _LinearFn.apply(
        x, self.weight, self.bias, c, getattr(self, "_sl_split", None)
    )
    return out


def _column(self: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """A column-parallel slice: its input whole, its input's gradient summed in blocks."""
    c = _collector(x, self)
    if c is None:
        return type(self).forward(self, x)
    out: torch.Tensor = _LinearFn.apply(x, self.weight, self.bias, c, self._sl_split)
    return gather_from(out, self.group) if self.gather_output else out


def _row(self: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel slice: its part of the output's sum in blocks, then the ranks' sum."""
    c = _collector(x, self)
    if c is None:
        y = _evaluated(self, x)
        return type(self).forward(self, x) if y is None else y
    out: torch.Tensor = _LinearFn.apply(x, self.weight, self.bias, c, self._sl_split)
    return out


def _vocab_embedding(self: VocabParallelEmbedding, ids: torch.Tensor) -> torch.Tensor:
    """A vocabulary slice's lookup: zeros for the ids it does not hold, summed over ranks."""
    c = _collector(ids, self)
    if c is None:
        return type(self).forward(self, ids)
    rows = self.weight.shape[0]
    here = (ids >= self.start) & (ids < self.start + rows)
    local = torch.where(here, ids - self.start, 0)
    out: torch.Tensor = _EmbeddingFn.apply(local, self.weight, self._local_pad, c, here)
    # One rank's row and zeros: x + 0 == x in any order (for every x but -0.0, read as +0.0).
    return reduce_from(out, self.group)


def _layer_norm(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    c = _collector(x, self)
    shape = list(self.normalized_shape)
    if c is None:
        return F.layer_norm(x, shape, self.weight, self.bias, self.eps)
    out: torch.Tensor = _LayerNormFn.apply(x, shape, self.weight, self.bias, self.eps, c)
    return out


def _embedding(self: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    c = _collector(idx, self)
    if c is None:
        return F.embedding(idx, self.weight, self.padding_idx)
    out: torch.Tensor = _EmbeddingFn.apply(idx, self.weight, self.padding_idx, c, None)
    return out


# The layer types (exactly these, not subclasses, whose forward may differ) and their forwards.
LAYERS: dict[type, Callable[..., torch.Tensor]] = {
    nn.Linear: _linear,
    nn.LayerNorm: _layer_norm,
    nn.Embedding: _embedding,
    ColumnParallelLinear: _column,
    RowParallelLinear: _row,
    VocabParallelEmbedding: _vocab_embedding,
}


def check_layer(name: str, m: nn.Module) -> None:
    """Refuses the layer options deterministic mode does not handle."""
    if isinstance(m, nn.Embedding) and (m.max_norm is not None or m.scale_grad_by_freq or m.sparse):
        raise InvalidArgumentError(
            f"deterministic mode: nn.Embedding {name!r} uses max_norm, scale_grad_by_freq or "
            "sparse gradients, which it does not support; turn them off"
        )
    sequence = getattr(m, "sequence_parallel", False)
    if isinstance(m, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding) and (
        sequence
        or getattr(m, "transposed", False)
        or getattr(m, "replicas", 1) > 1
        or getattr(m, "input_shared", False)
        or not getattr(m, "input_is_parallel", True)
    ):
        raise InvalidArgumentError(
            f"deterministic mode: {type(m).__name__} {name!r} is split with sequence "
            "parallelism, a Conv1D weight, key/value heads shared by ranks, a shared input "
            "or an input split here, which it does not support; split it as plan='auto' "
            "does without sequence_parallel"
        )
