"""What crosses a stage boundary: one or more tensors, described once and moved as one message.

A boundary's value is a list of tensors: an ``nn.Sequential``'s stages pass one, a traced
stage may pass several (the hidden state and a residual kept from an earlier layer, a mask).
Their *specs* (dtype and shape of each) travel once per boundary per step, in a fixed-size
int64 message (``encode``/``decode``). Each micro-batch's value is then one message: the tensor
itself when there is one, else every tensor's bytes packed end to end (each padded to 16
bytes), received into one buffer and viewed back as tensors without a copy.

Gradients go back the same way for the floating-point tensors of a boundary, in order. A
boundary that has none sends a one-element placeholder, so that the messages a schedule
implies never depend on dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardline.dtypes import DTYPES
from shardline.errors import InvalidArgumentError

__all__ = [
    "META_LEN",
    "Spec",
    "decode",
    "describe",
    "empty",
    "encode",
    "grad_specs",
    "pack",
    "specs_of",
]

MAX_TENSORS = 8
MAX_DIMS = 8
_PER = 2 + MAX_DIMS  # dtype code, ndim, dims
META_LEN = 1 + MAX_TENSORS * _PER
_ALIGN = 16
_CODES = {d.torch: i for i, d in enumerate(DTYPES)}

Spec = tuple[torch.Size, torch.dtype]


def specs_of(tensors: Sequence[torch.Tensor]) -> list[Spec]:
    """Each tensor's shape and dtype."""
    return [(t.shape, t.dtype) for t in tensors]


def describe(specs: Sequence[Spec]) -> str:
    """``[(4, 8) float32, (4,) int64]`` for messages."""
    return "[" + ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}" for s, d in specs) + "]"


def encode(specs: Sequence[Spec], device: torch.device, where: str) -> torch.Tensor:
    """The specs as the fixed-size int64 message; ``where`` names the boundary for errors."""
    if len(specs) > MAX_TENSORS:
        raise InvalidArgumentError(
            f"pipeline: {len(specs)} tensors cross {where}; at most {MAX_TENSORS} can"
        )
    values = [len(specs)]
    for shape, dtype in specs:
        if len(shape) > MAX_DIMS:
            raise InvalidArgumentError(
                f"pipeline: a tensor of {len(shape)} dimensions crosses {where}; at most "
                f"{MAX_DIMS} are supported"
            )
        if dtype not in _CODES:
            raise InvalidArgumentError(f"pipeline: a {dtype} tensor crosses {where}; unsupported")
        row = [_CODES[dtype], len(shape), *shape]
        values += row + [0] * (_PER - len(row))
    values += [0] * (META_LEN - len(values))
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    # From pinned memory without waiting: a plain copy from a list synchronises the stream,
    # which would stall this rank's CPU until the forward it just queued has run.
    return host.pin_memory().to(device, non_blocking=True)


def decode(meta: torch.Tensor) -> list[Spec]:
    """The specs ``encode`` wrote."""
    values = meta.tolist()
    out: list[Spec] = []
    for k in range(values[0]):
        code, ndim, *dims = values[1 + k * _PER : 1 + (k + 1) * _PER]
        out.append((torch.Size(dims[:ndim]), DTYPES[code].torch))
    return out


def grad_specs(specs: Sequence[Spec]) -> list[Spec]:
    """The specs of a boundary's gradient message.

    Its floating-point tensors, in order, or the one-element placeholder when it has none.
    """
    floats = [(s, d) for s, d in specs if d.is_floating_point]
    return floats or [(torch.Size([1]), torch.float32)]


def _padded(spec: Spec) -> int:
    shape, dtype = spec
    n = shape.numel() * dtype.itemsize
    return -(-n // _ALIGN) * _ALIGN


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One message for ``tensors``: the tensor itself when there is one, else their bytes."""
    if len(tensors) == 1:
        return tensors[0].detach().contiguous()
    total = sum(_padded(spec) for spec in specs_of(tensors))
    buf = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            buf[offset : offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        offset += _padded((t.shape, t.dtype))
    return buf


def empty(specs: Sequence[Spec], device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A buffer to receive a message for ``specs`` into, and the tensors it holds (views)."""
    if len(specs) == 1:
        shape, dtype = specs[0]
        t = torch.empty(shape, dtype=dtype, device=device)
        return t, [t]
    buf = torch.empty(sum(_padded(s) for s in specs), dtype=torch.uint8, device=device)
    views, offset = [], 0
    for shape, dtype in specs:
        n = shape.numel() * dtype.itemsize
        views.append(buf[offset : offset + n].view(dtype).view(shape))
        offset += _padded((shape, dtype))
    return buf, views
