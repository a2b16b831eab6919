"""Tensor-parallel layers: each holds its rank's slice of a dense layer's weights.

Built from the dense layer (``from_dense``), so every layout starts from the numbers one
process would have. Each rank holds about 1/t of every split weight:

- ``ColumnParallelLinear``: the output features (weight rows, bias) split; the input comes in
  whole (``copy_to``) or, under sequence parallelism, as sequence parts gathered here
  (``gather_seq``). A fused weight of ``pieces`` equal blocks (q, k and v in one matrix) is
  split block by block, so each rank holds its heads of each.
- ``RowParallelLinear``: the input features (weight columns) split; the partial products are
  summed (``reduce_from``) or reduce-scattered along the sequence (``scatter_seq``), and the
  bias, whole on every rank, is added once after the sum.
- ``VocabParallelEmbedding``: the vocabulary (rows) split; ids outside this rank's range give
  zeros, and the sum over ranks is the dense lookup.
- ``SequenceParallelNorm``: a norm whose input is split along the sequence; its weights are
  whole on every rank and their gradients summed over the ranks (``copy_to``).

``state_dict()`` of each holds the full tensors (gathered: a collective over the group) and
``load_state_dict()`` takes full tensors and keeps this rank's slice, so a model holding them
saves and loads as the dense model does. For checkpoints each implements the strategy
contract's ``sharded_state_dict()`` (``parallel.contract``): its slices as ``Shard`` boxes of
the dense tensors (a fused weight: one box per piece), no communication; a plain model holding
them composes them, so it checkpoints and reshards into any layout.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn import functional as F

from shardline.comm.group import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel.contract import Box, Shard
from shardline.parallel.tensor import overlap
from shardline.parallel.tensor.regions import (
    copy_to,
    gather_from,
    gather_seq,
    reduce_from,
    scatter_seq,
    split_to,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SequenceParallelNorm",
    "VocabParallelEmbedding",
    "is_conv1d",
]


def _check_divisible(n: int, t: int, what: str) -> None:
    if n % t:
        raise InvalidArgumentError(
            f"tensor parallel: {what} is {n}, not divisible by the {t} ranks of the group; "
            f"use a tp size that divides it"
        )


def _rows(full: torch.Tensor, group: ProcessGroup, pieces: int, replicas: int = 1) -> torch.Tensor:
    """This rank's rows of ``full``: of each of its ``pieces`` equal blocks, the rank's part.

    With ``replicas``, that many consecutive ranks hold the same part.
    """
    parts, r = group.world_size // replicas, group.rank // replicas
    blocks = full.chunk(pieces, dim=0)
    return torch.cat([b.chunk(parts, dim=0)[r] for b in blocks], dim=0)


def _all_rows(
    local: torch.Tensor, group: ProcessGroup, pieces: int, replicas: int = 1
) -> torch.Tensor:
    """The full tensor from every rank's ``_rows`` (a collective)."""
    t = group.world_size
    gathered = torch.empty((t, *local.shape), dtype=local.dtype, device=local.device)
    group.all_gather(gathered, local.detach().contiguous())
    per_rank = [p.chunk(pieces, dim=0) for p in gathered.unbind(0)[::replicas]]
    return torch.cat([part[k] for k in range(pieces) for part in per_rank], dim=0)


def is_conv1d(module: object) -> bool:
    """A transformers ``Conv1D`` (GPT-2's linear layers: weight stored ``(in, out)``)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _dense_weight(module: nn.Module) -> torch.Tensor:
    """``module``'s weight as ``(out, in)``, whether an ``nn.Linear`` or a ``Conv1D``."""
    w: torch.Tensor = module.weight  # type: ignore[assignment]
    return w.t() if is_conv1d(module) else w


_L = TypeVar("_L", bound="_ParallelLinear")


class _Sliced(nn.Module):
    """Saves full tensors and loads from full tensors (see the module docstring).

    Subclasses slice and gather a weight as ``(out, in)``; with ``transposed`` (a ``Conv1D``'s
    layout, ``(in, out)``) it is stored, saved and loaded the other way round.
    """

    group: ProcessGroup
    transposed: bool = False

    def _canon(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` as ``(out, in)`` (or back): transposed for a ``transposed`` weight."""
        return t.t() if self.transposed and name == "weight" else t

    def _full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _mine(self, name: str, full: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _boxes(self, name: str, local: torch.Tensor) -> tuple[tuple[int, ...], list[Box]]:
        """The dense tensor's shape, and where this rank's ``local`` lies in it."""
        raise NotImplementedError

    def sharded_state_dict(self) -> dict[str, Any]:
        """The strategy contract: this rank's slices as ``Shard`` boxes of the dense tensors."""
        out: dict[str, Any] = {}
        for name, param in self._parameters.items():
            if param is None:
                continue
            shape, boxes = self._boxes(name, self._canon(name, param))
            if boxes and self.transposed and name == "weight":
                shape = shape[::-1]
                boxes = [Box(b.tensor.t(), b.offsets[::-1]) for b in boxes]
            out[name] = param if not boxes else Shard(shape, boxes)
        return out

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        for name, param in self._parameters.items():
            if param is not None:
                full = self._full(name, self._canon(name, param.detach()))
                destination[prefix + name] = self._canon(name, full).contiguous()

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        for name, param in self._parameters.items():
            key = prefix + name
            if param is None:
                continue
            if key not in state_dict:
                missing_keys.append(key)
                continue
            full = state_dict[key]
            try:
                mine = self._canon(name, self._mine(name, self._canon(name, full)))
            except (RuntimeError, InvalidArgumentError, IndexError) as exc:
                error_msgs.append(
                    f"{key}: cannot take this rank's slice of {tuple(full.shape)}: {exc}"
                )
                continue
            if mine.shape != param.shape:
                error_msgs.append(
                    f"{key}: this rank's slice of {tuple(full.shape)} is {tuple(mine.shape)}, "
                    f"the parameter is {tuple(param.shape)}"
                )
                continue
            with torch.no_grad():
                param.copy_(mine)


class _ParallelLinear(_Sliced):
    """What the column- and row-parallel linears share: being built from a dense one."""

    @classmethod
    def from_dense(cls: type[_L], linear: nn.Module, group: ProcessGroup, **options: Any) -> _L:
        """This rank's slice of a linear layer's weights (an ``nn.Linear`` or a ``Conv1D``).

        ``options`` go to the constructor.
        """
        w = _dense_weight(linear)
        bias: torch.Tensor | None = linear.bias  # type: ignore[assignment]
        out = cls(w.shape[1], w.shape[0], group, bias=bias is not None,
                  transposed=is_conv1d(linear), device=w.device, dtype=w.dtype,
                  **options)  # fmt: skip
        with torch.no_grad():
            out.weight.copy_(out._canon("weight", out._mine("weight", w)))  # type: ignore[operator]
            if out.bias is not None and bias is not None:
                out.bias.copy_(out._mine("bias", bias))  # type: ignore[operator]
        return out


class ColumnParallelLinear(_ParallelLinear):
    """A linear layer with its output features split across ``group`` (see the module doc).

    Attributes:
        in_features, out_features: The dense layer's sizes.
        pieces: Equal blocks of the output the weight fuses (3 for q, k, v in one matrix).
        replicas: Consecutive ranks holding the same slice (key/value heads fewer than the
            ranks: each rank holds the head its query heads use); their weight gradients
            are summed over ``share``, the group of those ranks.
        gather_output: Return the whole output (all-gathered) instead of this rank's part.
        sequence_parallel: The input is split along dim 1 (the sequence): gathered here.
        input_shared: The module around this layer brought its input into the region (a
            ``copy_to``, or under sequence parallelism a ``gather_seq``), whose backward
            reduces the input's gradient once for every layer sharing it: taken as it is.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ProcessGroup,
        *,
        bias: bool = True,
        pieces: int = 1,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        transposed: bool = False,
        replicas: int = 1,
        share: ProcessGroup | None = None,
        input_shared: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        t = group.world_size
        if t % replicas or (replicas > 1 and (share is None or share.world_size != replicas)):
            raise InvalidArgumentError(
                f"ColumnParallelLinear: replicas={replicas} must divide tp={t} and come with "
                "share, the group of the ranks holding the same slice"
            )
        _check_divisible(out_features, pieces * t // replicas, "out_features / pieces")
        if gather_output and pieces != 1:
            raise InvalidArgumentError(
                "ColumnParallelLinear: gather_output with a fused weight (pieces > 1) would "
                "give the pieces out of order; gather each piece's output instead"
            )
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.pieces, self.gather_output = pieces, gather_output
        self.sequence_parallel, self.transposed = sequence_parallel, transposed
        self.replicas, self.share, self.input_shared = replicas, share, input_shared
        # Set by the shared input's hook for one call: (its Deferred, this layer's index).
        self.deferred: tuple[overlap.SharedInputCall, int] | None = None
        local = out_features // (t // replicas)
        shape = (in_features, local) if transposed else (local, in_features)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias else None

    def _full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return _all_rows(local, self.group, self.pieces, self.replicas)

    def _mine(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return _rows(full, self.group, self.pieces, self.replicas)

    def _boxes(self, name: str, local: torch.Tensor) -> tuple[tuple[int, ...], list[Box]]:
        rows = local.shape[0] // self.pieces  # of each piece, on this rank
        shape = (self.out_features, *local.shape[1:])
        per_piece = self.out_features // self.pieces
        part = self.group.rank // self.replicas  # replicas list the same piece (equal copies)
        boxes = [
            Box(local[k * rows : (k + 1) * rows],
                (k * per_piece + part * rows,) + (0,) * (local.dim() - 1))
            for k in range(self.pieces)
        ]  # fmt: skip
        return shape, boxes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output features (all of them with ``gather_output``)."""
        if self.sequence_parallel:
            x = gather_seq(x, self.group)
        elif not self.input_shared:
            x = copy_to(x, self.group)
        w = self._canon("weight", self.weight)
        b: torch.Tensor | None = self.bias
        if self.share is not None:  # a slice several ranks hold: gradients summed over them
            w = copy_to(w, self.share)
            b = copy_to(b, self.share) if b is not None else None
        deferred, self.deferred = self.deferred, None
        if (
            deferred is not None
            and self.can_defer()
            and deferred[0].holds(deferred[1], self.weight, self.bias)
        ):  # the weight gradient is left to the shared input's backward (see overlap)
            y = overlap.deferred_linear(x, w, b, *deferred)
        else:
            y = F.linear(x, w, b)
        return gather_from(y, self.group) if self.gather_output else y

    def can_defer(self) -> bool:
        """Whether this layer can leave its weight gradient to a shared input (``overlap``)."""
        return (
            self.input_shared
            and self.share is None
            and not self.transposed
            and not self.sequence_parallel
        )

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(this rank: {self.weight.shape[0]}), pieces={self.pieces}, "
            f"tp={self.group.world_size}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_ParallelLinear):
    """A linear layer with its input features split across ``group`` (see the module doc).

    Attributes:
        in_features, out_features: The dense layer's sizes.
        input_is_parallel: The input arrives as this rank's slice of the features (from a
            ``ColumnParallelLinear``); otherwise the whole input is sliced here.
        sequence_parallel: The output leaves split along dim 1 (the sequence).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ProcessGroup,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        transposed: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        t = group.world_size
        _check_divisible(in_features, t, "in_features")
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.transposed = transposed
        shape = (in_features // t, out_features) if transposed else (out_features, in_features // t)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        )

    def _full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        if name == "bias":
            return local.clone()
        return _all_rows(local.t().contiguous(), self.group, 1).t().contiguous()

    def _mine(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name == "bias":
            return full
        return _rows(full.t(), self.group, 1).t()

    def _boxes(self, name: str, local: torch.Tensor) -> tuple[tuple[int, ...], list[Box]]:
        if name == "bias":  # whole on every rank: replicated
            return tuple(local.shape), []
        cols = local.shape[1]
        return (self.out_features, self.in_features), [Box(local, (0, self.group.rank * cols))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The dense layer's output: whole, or this rank's part of the sequence."""
        if not self.input_is_parallel:
            x = split_to(x, self.group)
        y = F.linear(x, self._canon("weight", self.weight))
        if self.sequence_parallel:
            y = scatter_seq(y, self.group)
            # Each rank adds the bias to its part of the sequence: its gradient is summed.
            return y if self.bias is None else y + copy_to(self.bias, self.group)
        y = reduce_from(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
            f"out_features={self.out_features}, tp={self.group.world_size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(_Sliced):
    """An embedding with its rows (the vocabulary) split across ``group``.

    Attributes:
        num_embeddings, embedding_dim: The dense table's sizes.
        start: The first id this rank holds.
        padding_idx: As in ``nn.Embedding``: that row gets no gradient (on its rank).
        sequence_parallel: The output leaves split along dim 1 (the sequence).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: ProcessGroup,
        *,
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        t = group.world_size
        _check_divisible(num_embeddings, t, "the vocabulary (num_embeddings)")
        self.group, self.num_embeddings, self.embedding_dim = group, num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        rows = num_embeddings // t
        self.start = group.rank * rows
        self.padding_idx = padding_idx
        here = padding_idx is not None and self.start <= padding_idx < self.start + rows
        self._local_pad = padding_idx - self.start if here else None  # type: ignore[operator]
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, device=device, dtype=dtype))

    @classmethod
    def from_dense(
        cls, embedding: nn.Embedding, group: ProcessGroup, **options: Any
    ) -> VocabParallelEmbedding:
        """This rank's rows of ``embedding``'s table."""
        if embedding.max_norm is not None or embedding.sparse:
            raise InvalidArgumentError(
                "VocabParallelEmbedding: max_norm and sparse are not supported; leave this "
                "embedding replicated (out of the plan)"
            )
        w = embedding.weight
        out = cls(w.shape[0], w.shape[1], group, padding_idx=embedding.padding_idx,
                  device=w.device, dtype=w.dtype, **options)  # fmt: skip
        with torch.no_grad():
            out.weight.copy_(_rows(w, group, 1))
        return out

    def _full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return _all_rows(local, self.group, 1)

    def _mine(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return _rows(full, self.group, 1)

    def _boxes(self, name: str, local: torch.Tensor) -> tuple[tuple[int, ...], list[Box]]:
        return (self.num_embeddings, self.embedding_dim), [Box(local, (self.start, 0))]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The dense lookup of ``ids`` (summed over the ranks' rows)."""
        rows = self.weight.shape[0]
        outside = (ids < self.start) | (ids >= self.start + rows)
        local = torch.where(outside, 0, ids - self.start)
        out = F.embedding(local, self.weight, self._local_pad)
        out = out * (~outside).unsqueeze(-1).to(out.dtype)
        if self.sequence_parallel:
            return scatter_seq(out, self.group)
        return reduce_from(out, self.group)

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"{self.num_embeddings}, {self.embedding_dim} (this rank: ids {self.start}.."
            f"{self.start + self.weight.shape[0] - 1}), tp={self.group.world_size}"
        )


class SequenceParallelNorm(nn.Module):
    """A norm on a sequence part: weights whole, their gradients summed over the group.

    It takes over the norm's own parameters under the same names, so the model's state dict
    does not change. ``nn.LayerNorm`` and ``nn.RMSNorm`` run as torch's functions; any other
    norm module without children (a Hugging Face ``LlamaRMSNorm``) runs as itself, called
    with its parameters passed through ``copy_to`` (``torch.func.functional_call``).
    """

    def __init__(self, norm: nn.Module, group: ProcessGroup) -> None:
        super().__init__()
        if any(True for _ in norm.children()):
            raise InvalidArgumentError(
                f"SequenceParallelNorm takes a norm layer without submodules, not "
                f"{type(norm).__name__}"
            )
        self.group = group
        if isinstance(norm, nn.LayerNorm | nn.RMSNorm):
            self.kind = "rms" if isinstance(norm, nn.RMSNorm) else "layer"
            self.normalized_shape = tuple(norm.normalized_shape)
            self.eps = norm.eps
            self.weight = norm.weight
            self.bias = getattr(norm, "bias", None)
            return
        self.kind = "module"
        self.__dict__["_norm"] = norm  # called with our parameters, which are its own
        for name, p in norm.named_parameters(recurse=False):
            self.register_parameter(name, p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of this rank's part of the sequence."""
        if self.kind == "module":
            params = {
                n: copy_to(p, self.group) for n, p in self._parameters.items() if p is not None
            }
            out: torch.Tensor = torch.func.functional_call(self.__dict__["_norm"], params, (x,))
            return out
        weight = copy_to(self.weight, self.group) if self.weight is not None else None
        if self.kind == "rms":
            return F.rms_norm(x, self.normalized_shape, weight, self.eps)
        bias = copy_to(self.bias, self.group) if self.bias is not None else None
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps or 1e-5)
