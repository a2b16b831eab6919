"""Deterministic per-rank inputs and independent (plain torch, one process) references."""

from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.uint8, torch.int32, torch.int64)
ALL_DTYPES = (*FLOATS, *INTS, torch.bool)


def ops_for(dtype: torch.dtype) -> tuple[str, ...]:
    """Reductions defined on ``dtype`` (avg needs a float)."""
    return (
        ("sum", "avg", "max", "min", "prod")
        if dtype.is_floating_point
        else ("sum", "max", "min", "prod")
    )


def make(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input of ``n`` elements: small values, so sums and products stay exact.

    Signed: -2..2 (|prod| over 5 ranks <= 32); unsigned: 0..2; bool: a rank-dependent pattern.
    """
    i = torch.arange(n, dtype=torch.int64) + 3 * rank + 7 * salt
    if dtype == torch.bool:
        return ((i % (rank + 2)) == 0).to(torch.bool)
    if dtype == torch.uint8:
        return (i % 3).to(dtype)
    values = i % 5 - 2
    if dtype.is_floating_point:
        return (values.to(torch.float64) * 0.5).to(dtype)  # halves: exact in every float dtype
    return values.to(dtype)


def reduce_ref(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of ``inputs`` computed in float64/int64, cast back to their dtype."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stacked = torch.stack(inputs)
        return stacked.any(0) if op in ("sum", "max") else stacked.all(0)
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    stacked = torch.stack([t.to(wide) for t in inputs])
    if op == "sum":
        out = stacked.sum(0)
    elif op == "avg":
        out = stacked.sum(0) / len(inputs)
    elif op == "prod":
        out = stacked.prod(0)
    elif op == "max":
        out = stacked.max(0).values
    elif op == "min":
        out = stacked.min(0).values
    else:
        raise ValueError(op)
    return out.to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Exact for ints/bool/f32/f64 on exact inputs; f16/bf16 within their rounding."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.dtype in (torch.float16, torch.bfloat16):
        torch.testing.assert_close(
            actual, expected, rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}: {m}"
        )
    elif actual.dtype.is_floating_point:
        torch.testing.assert_close(
            actual, expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}"
        )
    else:
        assert torch.equal(actual, expected), f"{what}: {actual.tolist()} != {expected.tolist()}"
