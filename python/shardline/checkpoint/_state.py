"""What a checkpoint holds, as flat pieces: model and optimizer state of any strategy.

A *piece* is one rank's part of one global tensor, named by a key (``model/<name>``,
``optim/<name>/<state>``): either the whole tensor (replicated on every rank: DDP, a plain
model, buffers, scalars) or a flat element range of it (a ZeRO shard: elements ``start ..
start + n`` of the tensor flattened in row-major order). Saving writes pieces; loading asks the
index for the byte ranges each target piece needs, so any layout loads into any other.
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

__all__ = ["DTYPES", "Piece", "dtype_name", "model_pieces", "optimizer_pieces", "strategy_of"]

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
class Piece:
    """One rank's part of one global tensor (see the module docstring)."""

    key: str
    tensor: torch.Tensor  # this rank's values (the whole tensor when replicated)
    shape: tuple[int, ...]  # the global shape
    start: int = 0  # first element of ``tensor`` in the flattened global tensor
    replicated: bool = True

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
    if isinstance(model, ShardedDataParallel):
        items: Iterator[tuple[str, Any]] = iter(model.sharded_state_dict().items())
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
        elif torch.is_tensor(value):
            t = value.detach()
            pieces.append(Piece(key, t, tuple(t.shape)))
        else:
            raise CheckpointError(f"model state {name!r} is a {type(value).__name__}, not a tensor")
    return pieces, aliases


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
            if isinstance(v, ShardedTensor):
                pieces.append(Piece(key, v.local, tuple(v.global_shape), v.offset, False))
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
