"""Where each layer's activation lives: the placement policies and who holds what.

A partition's bounds on each rank, layer ids as they travel (``[1, "name"]`` or ``[0, 7]``),
and every rank's holdings as plain lists, turned into the table of owners.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import torch

from shardline import dtypes
from shardline.errors import InvalidArgumentError

__all__ = [
    "POLICIES",
    "REPLICATED",
    "Holding",
    "LayerId",
    "Policy",
    "decode_holdings",
    "decode_id",
    "dtype_from_name",
    "encode_id",
    "holds_part",
    "holds_whole",
    "id_order",
    "numel_of",
    "owner_table",
    "part_bounds",
    "part_size",
]

LayerId: TypeAlias = str | int
Policy: TypeAlias = Literal["local", "first_rank", "partition"]
POLICIES: tuple[str, ...] = ("local", "first_rank", "partition")
REPLICATED = "replicated"  # what register_and_broadcast stores: a full copy on every rank


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a peer named (``shardline.dtypes``); ``InvalidArgumentError`` if unknown."""
    try:
        return dtypes.from_name(name)
    except KeyError:
        raise InvalidArgumentError(f"unknown dtype {name!r} received from a peer") from None


# policy, shape, dtype, whether data is held
Holding: TypeAlias = tuple[str, tuple[int, ...], torch.dtype, bool]


def part_size(numel: int, world_size: int, rank: int) -> int:
    """Elements of a ``numel``-element tensor that ``rank`` keeps under ``partition``."""
    return numel // world_size + (1 if rank < numel % world_size else 0)


def part_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` of ``rank``'s part of the flattened tensor."""
    start = sum(part_size(numel, world_size, r) for r in range(rank))
    return start, start + part_size(numel, world_size, rank)


def numel_of(shape: tuple[int, ...]) -> int:
    """Elements of a tensor of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return n


def encode_id(layer_id: LayerId) -> list[Any]:
    """A layer id as it travels: ``[1, name]`` or ``[0, number]``."""
    return [1, layer_id] if isinstance(layer_id, str) else [0, layer_id]


def decode_id(encoded: list[Any]) -> LayerId:
    """The layer id ``encode_id`` made."""
    tag, value = encoded
    return str(value) if tag == 1 else int(value)


def id_order(layer_id: LayerId) -> tuple[int, int, str]:
    """Sort key: numbered ids first, in order, then names."""
    return (1, 0, layer_id) if isinstance(layer_id, str) else (0, layer_id, "")


def decode_holdings(rows: list[list[Any]]) -> dict[LayerId, Holding]:
    """One rank's holdings, from the rows its ``_holdings()`` sent."""
    return {
        decode_id(k): (str(p), tuple(int(n) for n in shape), dtype_from_name(d), bool(has))
        for k, p, shape, d, has in rows
    }


def holds_whole(held: dict[LayerId, Holding], k: LayerId) -> bool:
    """Whether a rank with ``held`` keeps all of ``k``."""
    h = held.get(k)
    return h is not None and h[3] and h[0] != "partition"


def holds_part(held: dict[LayerId, Holding], k: LayerId) -> bool:
    """Whether a rank with ``held`` keeps its partition part of ``k``."""
    h = held.get(k)
    return h is not None and h[3] and h[0] == "partition"


def owner_table(held: list[dict[LayerId, Holding]]) -> dict[LayerId, tuple[int, ...]]:
    """Layer id -> the ranks holding data of it, from every rank's holdings."""
    ids = sorted({k for h in held for k in h}, key=id_order)
    return {k: tuple(r for r, h in enumerate(held) if k in h and h[k][3]) for k in ids}
