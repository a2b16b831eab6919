"""Element types, one table: each torch dtype's name in the engine and in shard files.

The engine moves and reduces the dtypes that have an engine name (``"float32"``, ...); shard
files store every dtype that has a safetensors name (``"F32"``, ...). The Rust side has the
same table in ``rust/src/dtype.rs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DTYPES",
    "ENGINE_DTYPES",
    "FILE_DTYPES",
    "DType",
    "from_file_name",
    "from_name",
    "name_of",
]


@dataclass(frozen=True)
class DType:
    """One element type.

    Attributes:
        torch: The torch dtype.
        name: torch's own name without ``torch.`` (``"bfloat16"``); what peers exchange.
        engine: The engine's name, ``None`` where the engine does not move it.
        file: The safetensors name in shard files.
    """

    torch: torch.dtype
    name: str
    engine: str | None
    file: str


DTYPES: tuple[DType, ...] = (
    DType(torch.float32, "float32", "float32", "F32"),
    DType(torch.float64, "float64", "float64", "F64"),
    DType(torch.float16, "float16", "float16", "F16"),
    DType(torch.bfloat16, "bfloat16", "bfloat16", "BF16"),
    DType(torch.int8, "int8", "int8", "I8"),
    DType(torch.uint8, "uint8", "uint8", "U8"),
    DType(torch.int16, "int16", None, "I16"),
    DType(torch.int32, "int32", "int32", "I32"),
    DType(torch.int64, "int64", "int64", "I64"),
    DType(torch.bool, "bool", "bool", "BOOL"),
    DType(torch.float8_e4m3fn, "float8_e4m3fn", None, "F8_E4M3"),
    DType(torch.float8_e5m2, "float8_e5m2", None, "F8_E5M2"),
)

# torch dtype -> engine name, for the dtypes the engine moves and reduces.
ENGINE_DTYPES: dict[torch.dtype, str] = {d.torch: d.engine for d in DTYPES if d.engine}
# torch dtype -> safetensors name, for every dtype a shard file stores.
FILE_DTYPES: dict[torch.dtype, str] = {d.torch: d.file for d in DTYPES}
_BY_FILE = {d.file: d.torch for d in DTYPES}
_BY_NAME = {d.name: d.torch for d in DTYPES}
_NAMES = {d.torch: d.name for d in DTYPES}


def from_file_name(name: str) -> torch.dtype:
    """The torch dtype of a safetensors name; ``KeyError`` for one not in the table."""
    return _BY_FILE[name]


def from_name(name: str) -> torch.dtype:
    """The torch dtype of its own name (``"bfloat16"``); ``KeyError`` for one not in the table."""
    return _BY_NAME[name]


def name_of(dtype: torch.dtype) -> str:
    """Torch's own name of ``dtype`` (``"bfloat16"``); ``KeyError`` for one not in the table."""
    return _NAMES[dtype]
