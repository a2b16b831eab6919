"""The styles of a tensor-parallel plan that take options (``"colwise"`` is ``Colwise()``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Colwise", "Rowwise"]


@dataclass(frozen=True)
class Colwise:
    """``nn.Linear`` -> ``ColumnParallelLinear`` (output features split)."""

    pieces: int = 1
    gather_output: bool = False
    replicas: int = 1  # consecutive ranks holding the same slice (key/value heads < tp)
    # How its input arrives: None as tensor_parallel's sequence_parallel says (whole, or
    # split along the sequence and gathered here); "gathered": the module around it gathered
    # the sequence already (its "sequence_gather" hook sums the input's gradient).
    input: str | None = None


@dataclass(frozen=True)
class Rowwise:
    """``nn.Linear`` -> ``RowParallelLinear`` (input features split)."""

    input_is_parallel: bool = True
