"""Gradient compression with error feedback: what strategies send instead of full gradients.

Pass a compressor to ``sl.distribute(..., compression=...)`` (DDP, ZeRO-1 on its all-reduce,
ZeRO-2/3 on the reduce-scatter), or its name (``"int8"``, ``"powersgd"``, ...):

- ``Int8()``, ``FP8()``: 8-bit values with a scale per block (4x fewer bytes);
- ``OneBit()``: signs with a scale per block (about 28x fewer), any optimizer;
- ``TopK(ratio=0.01)``: the largest values and their indices, all-gathered;
- ``PowerSGD(rank=4)``: a low-rank product per gradient matrix, warm-started;
- ``Cast(torch.bfloat16)``: half the bytes (what ``comm_hook="bf16"`` does).

Each keeps what it could not send (error feedback) and starts with a few uncompressed steps.
``codec`` holds the interface (``Compressor``, ``Entry``), to write your own; ``hooks`` the
DDP communication hooks (``fp16``/``bf16`` compression, your own); ``registry`` the names.
"""

from __future__ import annotations

from shardline.compression import hooks
from shardline.compression.codec import Compressor, Entry
from shardline.compression.powersgd import PowerSGD
from shardline.compression.quantize import FP8, Cast, Int8, OneBit, Quantizer
from shardline.compression.registry import resolve
from shardline.compression.topk import TopK

__all__ = [
    "FP8",
    "Cast",
    "Compressor",
    "Entry",
    "Int8",
    "OneBit",
    "PowerSGD",
    "Quantizer",
    "TopK",
    "hooks",
    "resolve",
]
