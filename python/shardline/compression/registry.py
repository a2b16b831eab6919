"""Compressors by name, for ``distribute(..., compression="powersgd")`` (each with defaults).

``resolve`` turns a name, a compressor or ``None`` into a compressor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardline.compression.codec import Compressor
from shardline.compression.powersgd import PowerSGD
from shardline.compression.quantize import FP8, Cast, Int8, OneBit
from shardline.compression.topk import TopK
from shardline.errors import InvalidArgumentError

__all__ = ["BY_NAME", "resolve"]

BY_NAME: dict[str, Callable[[], Compressor]] = {
    "fp16": lambda: Cast(torch.float16),
    "bf16": lambda: Cast(torch.bfloat16),
    "int8": Int8,
    "fp8": FP8,
    "topk": TopK,
    "powersgd": PowerSGD,
    "onebit": OneBit,
}


def resolve(value: str | Compressor | None) -> Compressor | None:
    """A compressor from ``None``, a compressor, or a name.

    Names: ``"fp16"``, ``"bf16"``, ``"int8"``, ``"fp8"``, ``"topk"``, ``"powersgd"``,
    ``"onebit"`` (each with its defaults).

    Raises:
        InvalidArgumentError: an unknown name or another kind of value.
    """
    if value is None or isinstance(value, Compressor):
        return value
    if isinstance(value, str):
        make = BY_NAME.get(value.lower())
        if make is None:
            raise InvalidArgumentError(
                f"unknown compression {value!r}; use one of {', '.join(sorted(BY_NAME))} "
                "or a shardline.compression compressor such as sl.compression.PowerSGD(rank=4)"
            )
        return make()
    raise InvalidArgumentError(
        "compression must be a name or a shardline.compression compressor, not "
        f"{type(value).__name__}"
    )
