"""What a checkpoint holds, as flat pieces, taken from the strategy contract.

A *piece* is one rank's part of one global tensor, named by a key (``model/<name>``,
``optim/<name>/<state>``): the whole tensor (a replicated value: every rank has it, one rank
writes it), a flat element range of it, or a rectangular block (the two kinds of ``Shard``
piece), or a rank's own value (``Local``, stored under ``<key>#rank<r>``). Saving writes pieces;
loading asks the index for the byte ranges each target piece needs, so any layout loads into
any other.

Everything here comes from ``shardline.parallel.contract``: the model's
``sharded_state_dict()`` and ``sharded_optim_state_dict(opt)``. Nothing here knows a strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardline import dtypes
from shardline.errors import CheckpointError, InvalidArgumentError
from shardline.parallel import contract
from shardline.parallel.contract import Box, Local, Shard

__all__ = [
    "Piece",
    "Target",
    "dtype_name",
    "local_key",
    "model_pieces",
    "optimizer_pieces",
    "targets_of",
]

# Where a read lands: the tensor to fill, the global shape, the first element or block offsets.
Target = tuple[torch.Tensor, tuple[int, ...], int | tuple[int, ...]]


def dtype_name(dtype: torch.dtype, key: str) -> str:
    """The safetensors name of ``dtype``; ``CheckpointError`` for ones it cannot store."""
    try:
        return dtypes.FILE_DTYPES[dtype]
    except KeyError:
        raise CheckpointError(
            f"cannot save {key!r}: dtype {dtype} has no safetensors name "
            f"(supported: {', '.join(str(d) for d in dtypes.FILE_DTYPES)})"
        ) from None


def local_key(key: str, rank: int) -> str:
    """Where rank ``rank``'s ``Local`` value of ``key`` is stored."""
    return f"{key}#rank{rank}"


def is_local_key(key: str) -> bool:
    """Whether ``key`` holds one rank's ``Local`` value (``local_key``), not the model's."""
    return "#rank" in key


def flat_index(shape: tuple[int, ...], index: tuple[int, ...]) -> int:
    """Row-major position of ``index`` in a tensor of ``shape``."""
    pos = 0
    for i, d in zip(index, shape, strict=True):
        pos = pos * d + i
    return pos


@dataclass
class Piece:
    """One rank's part of one global tensor (see the module docstring)."""

    key: str
    tensor: torch.Tensor  # this rank's values (the whole tensor when replicated)
    shape: tuple[int, ...]  # the global shape
    start: int = 0  # first element of ``tensor`` in the flattened global tensor
    replicated: bool = True
    box: tuple[int, ...] | None = None  # a block's offsets (``tensor`` is shaped like it)

    @property
    def end(self) -> int:
        """One past the last element's position in the flattened global tensor."""
        if self.box is None:
            return self.start + self.numel
        if self.numel == 0:
            return self.start
        last = tuple(o + n - 1 for o, n in zip(self.box, self.tensor.shape, strict=True))
        return flat_index(self.shape, last) + 1

    @property
    def numel(self) -> int:
        """Elements this piece holds."""
        return self.tensor.numel()


def _checked(key: str, shard: Shard) -> Shard:
    try:
        shard.check(key)
    except InvalidArgumentError as exc:
        raise CheckpointError(str(exc)) from None
    return shard


def pieces_of(key: str, value: Any, rank: int) -> list[Piece] | None:
    """The pieces of one state value; ``None`` when it is not a tensor value."""
    if isinstance(value, Shard):
        shape = _checked(key, value).global_shape
        out = []
        for p in value.pieces:
            t = p.tensor.detach()
            if isinstance(p, Box):
                out.append(Piece(key, t, shape, flat_index(shape, p.offsets), False, p.offsets))
            else:
                out.append(Piece(key, t, shape, p.start, False))
        return out
    if isinstance(value, Local):
        t = value.tensor.detach()
        return [Piece(local_key(key, rank), t, tuple(t.shape), 0, False)]
    if torch.is_tensor(value):
        t = value.detach()
        return [Piece(key, t, tuple(t.shape))]
    return None


def model_pieces(model: nn.Module, rank: int) -> tuple[list[Piece], dict[str, str]]:
    """This rank's model pieces and the aliases (tied tensors: alias key -> stored key).

    One value object under two names is one tensor under two names: it is stored once.
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    pieces: list[Piece] = []
    for name, value in contract.sharded_state_dict(model).items():
        key = f"model/{name}"
        if id(value) in first:
            aliases[key] = first[id(value)]
            continue
        first[id(value)] = key
        more = pieces_of(key, value, rank)
        if more is None:
            raise CheckpointError(f"model state {name!r} is a {type(value).__name__}, not a tensor")
        pieces += more
    return pieces, aliases


def optimizer_pieces(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> tuple[list[Piece], dict[str, Any]]:
    """This rank's optimizer pieces, and the JSON part: param groups by name, other values."""
    try:
        sd = contract.sharded_optim_state_dict(model, optimizer)
    except InvalidArgumentError as exc:
        raise CheckpointError(str(exc)) from None
    pieces: list[Piece] = []
    values: dict[str, dict[str, Any]] = {}
    for name, entries in sorted(sd["state"].items()):
        for k, v in entries.items():
            more = pieces_of(f"optim/{name}/{k}", v, rank)
            if more is None:
                values.setdefault(name, {})[k] = v
            else:
                pieces += more
    return pieces, {"param_groups": jsonable_groups(sd["param_groups"]), "values": values}


def jsonable_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups with tensors as numbers or lists and tuples as lists."""
    out = []
    for g in groups:
        entry: dict[str, Any] = {}
        for k, value in g.items():
            v = value
            if torch.is_tensor(v):
                v = v.item() if v.numel() == 1 else v.tolist()
            if isinstance(v, tuple):
                v = list(v)
            entry[k] = v
        out.append(entry)
    return out


def targets_of(key: str, value: Any, rank: int) -> list[tuple[str, Target]]:
    """Where the checkpoint's ``key`` lands in ``value`` (a state value): ``(stored key, target)``.

    A ``Local`` reads its own rank's value; a ``Shard`` one read per piece.
    """
    if isinstance(value, Shard):
        shape = _checked(key, value).global_shape
        return [
            (key, (p.tensor.detach(), shape, p.offsets if isinstance(p, Box) else p.start))
            for p in value.pieces
        ]
    if isinstance(value, Local):
        t = value.tensor.detach()
        return [(local_key(key, rank), (t, tuple(t.shape), 0))]
    t = value.detach()
    return [(key, (t, tuple(t.shape), 0))]


def global_shape(value: Any) -> tuple[int, ...]:
    """The shape of the whole tensor a state value is part of."""
    if isinstance(value, Shard):
        return value.global_shape
    if isinstance(value, Local):
        return tuple(value.tensor.shape)
    return tuple(value.shape)
