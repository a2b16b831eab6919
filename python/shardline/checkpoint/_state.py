"""What a checkpoint holds, as flat pieces: model and optimizer state of any strategy.

A *piece* is one rank's part of one global tensor, named by a key (``model/<name>``,
``optim/<name>/<state>``): the whole tensor (replicated on every rank: DDP, a plain model,
buffers, scalars), a flat element range of it (a ZeRO shard: elements ``start .. start + n`` of
the tensor flattened in row-major order), or a rectangular block (a tensor-parallel shard,
:class:`BlockShard`). Saving writes pieces; loading asks the index for the byte ranges each
target piece needs, so any layout loads into any other.

A module (or a strategy wrapper) chooses how its state is split by defining
``sharded_state_dict()``: names to tensors (replicated), ``ShardedTensor`` (flat ranges) or
``BlockShard`` (blocks); optimizer state shaped like a block-sharded parameter's block is saved
as the same block.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardline.errors import CheckpointError
from shardline.parallel.ddp import DistributedDataParallel
from shardline.parallel.zero import ShardedDataParallel, ShardedTensor, groups_by_name

__all__ = [
    "DTYPES",
    "BlockShard",
    "Piece",
    "dtype_name",
    "model_pieces",
    "optimizer_pieces",
    "strategy_of",
]

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype, key: str) -> str:
    """The safetensors name of ``dtype``; ``CheckpointError`` for ones it cannot store."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise CheckpointError(
            f"cannot save {key!r}: dtype {dtype} has no safetensors name "
            f"(supported: {', '.join(str(d) for d in DTYPES)})"
        ) from None


@dataclass
class BlockShard:
    """This rank's rectangular block of a tensor, as tensor parallelism splits weights.

    Return it from a module's ``sharded_state_dict()`` for each such tensor: a checkpoint
    then stores the block once per rank, and loads it into any layout (the whole tensor in a
    plain model, flat ZeRO shards, or other blocks).

    Attributes:
        local: The block's values, shaped like the block.
        global_shape: The whole tensor's shape.
        offsets: Where the block starts, per dimension.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def check(self, name: str) -> None:
        """``CheckpointError`` unless the block lies inside the tensor."""
        shape, offs, sizes = tuple(self.global_shape), tuple(self.offsets), tuple(self.local.shape)
        if not (len(shape) == len(offs) == len(sizes)) or any(
            o < 0 or o + n > d for o, n, d in zip(offs, sizes, shape, strict=True)
        ):
            raise CheckpointError(
                f"{name!r}: a block of shape {list(sizes)} at offsets {list(offs)} does not lie "
                f"inside a tensor of shape {list(shape)}"
            )


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

    @classmethod
    def block(cls, key: str, b: BlockShard) -> Piece:
        """The piece of a block."""
        b.check(key)
        shape = tuple(b.global_shape)
        offsets = tuple(b.offsets)
        return cls(key, b.local.detach(), shape, flat_index(shape, offsets), False, offsets)

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


def strategy_of(model: nn.Module | None) -> dict[str, Any]:
    """What ``info()`` reports about how the state was laid out when saved."""
    if isinstance(model, ShardedDataParallel):
        mp = model.mixed_precision
        return {
            "strategy": "fsdp" if model.stage == 3 else f"zero{model.stage}",
            "zero_stage": model.stage,
            "sharding": "FULL_SHARD" if model.stage == 3 else "SHARD_GRAD_OP",
            "shards": model.group.world_size,
            "precision": {
                "param_dtype": str(mp.param_dtype) if mp.param_dtype else None,
                "reduce_dtype": str(mp.reduce_dtype) if mp.reduce_dtype else None,
                "master_weights": mp.master_weights,
            },
            "tp_degree": 1,
            "tp_axis": None,
        }
    name = "ddp" if isinstance(model, DistributedDataParallel) else "replicated"
    return {"strategy": name, "zero_stage": 0, "sharding": "NO_SHARD", "shards": 1,
            "precision": None, "tp_degree": 1, "tp_axis": None}  # fmt: skip


def own_sharded_state_dict(module: nn.Module) -> dict[str, Any] | None:
    """``module.sharded_state_dict()`` when the module defines one (how it splits its state)."""
    fn: Any = getattr(module, "sharded_state_dict", None)
    return dict(fn()) if callable(fn) else None


def _plain(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def model_pieces(model: nn.Module) -> tuple[list[Piece], dict[str, str]]:
    """This rank's model pieces and the aliases (tied tensors: alias key -> stored key).

    Aliases come from the module structure (one tensor object under two names), so every
    rank finds the same ones whatever part of the tensor it holds.
    """
    plain = model.module if isinstance(model, ShardedDataParallel) else _plain(model)
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, value in plain.state_dict(keep_vars=True).items():
        if id(value) in first:
            aliases[f"model/{name}"] = f"model/{first[id(value)]}"
        else:
            first[id(value)] = name
    items: Iterator[tuple[str, Any]]
    own = None if isinstance(model, ShardedDataParallel) else own_sharded_state_dict(plain)
    if isinstance(model, ShardedDataParallel):
        items = iter(model.sharded_state_dict().items())
    elif own is not None:
        items = iter(own.items())
    else:
        items = iter(plain.state_dict(keep_vars=True).items())
    pieces: list[Piece] = []
    for name, value in items:
        key = f"model/{name}"
        if key in aliases:
            continue
        if isinstance(value, ShardedTensor):
            local = value.local
            pieces.append(Piece(key, local, tuple(value.global_shape), value.offset, False))
        elif isinstance(value, BlockShard):
            pieces.append(Piece.block(key, value))
        elif torch.is_tensor(value):
            t = value.detach()
            pieces.append(Piece(key, t, tuple(t.shape)))
        else:
            raise CheckpointError(f"model state {name!r} is a {type(value).__name__}, not a tensor")
    return pieces, aliases


def blocks_of(model: nn.Module) -> dict[str, BlockShard]:
    """The block-sharded tensors of ``model``'s ``sharded_state_dict()``, by name."""
    own = None if isinstance(model, ShardedDataParallel) else own_sharded_state_dict(_plain(model))
    return {n: v for n, v in (own or {}).items() if isinstance(v, BlockShard)}


def param_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for the parameters an optimizer of ``model`` steps."""
    return {id(p): n for n, p in _plain(model).named_parameters(remove_duplicate=True)}


def optimizer_pieces(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[Piece], dict[str, Any]]:
    """This rank's optimizer pieces, and the JSON part: param groups by name, scalars.

    State tensors shaped like their parameter become pieces (sharded like it under ZeRO);
    0-d tensors (``step``) become replicated pieces; other values go into the JSON part.
    """
    pieces: list[Piece] = []
    values: dict[str, dict[str, Any]] = {}
    blocks = blocks_of(model)
    if isinstance(model, ShardedDataParallel):
        sd = model.sharded_optim_state_dict(optimizer)
        state, groups = sd["state"], sd["param_groups"]
    else:
        names = param_names(model)
        state = {}
        for p, entries in optimizer.state.items():
            if id(p) not in names:
                raise CheckpointError(
                    "the optimizer holds state for a tensor that is not a parameter of the model"
                )
            state[names[id(p)]] = dict(entries)
        groups = groups_by_name(optimizer, names)
    for name, entries in sorted(state.items()):
        for k, v in entries.items():
            key = f"optim/{name}/{k}"
            b = blocks.get(name)
            if isinstance(v, ShardedTensor):
                pieces.append(Piece(key, v.local, tuple(v.global_shape), v.offset, False))
            elif b is not None and torch.is_tensor(v) and v.dim() and v.shape == b.local.shape:
                pieces.append(Piece.block(key, BlockShard(v, b.global_shape, b.offsets)))
            elif torch.is_tensor(v):
                pieces.append(Piece(key, v.detach(), tuple(v.shape)))
            else:
                values.setdefault(name, {})[k] = v
    return pieces, {"param_groups": _jsonable_groups(groups), "values": values}


def _jsonable_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
