"""Compressors by name, for ``distribute(..., compression="powersgd")`` (each with defaults)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardline.optim.compression import Compressor
from shardline.optim.powersgd import PowerSGD
from shardline.optim.quantize import FP8, Cast, Int8, OneBit
from shardline.optim.topk import TopK

__all__ = ["BY_NAME"]

BY_NAME: dict[str, Callable[[], Compressor]] = {
    "fp16": lambda: Cast(torch.float16),
    "bf16": lambda: Cast(torch.bfloat16),
    "int8": Int8,
    "fp8": FP8,
    "topk": TopK,
    "powersgd": PowerSGD,
    "onebit": OneBit,
}
