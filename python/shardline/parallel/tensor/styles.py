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
    # split along the sequence and gathered here); "shared": the module around it brought the
    # input into the region once for the column layers sharing it, and reduces its gradient
    # once (its "shared_input" or "sequence_gather" hook).
    input: str | None = None


@dataclass(frozen=True)
class Rowwise:
    """``nn.Linear`` -> ``RowParallelLinear`` (input features split)."""

    input_is_parallel: bool = True
