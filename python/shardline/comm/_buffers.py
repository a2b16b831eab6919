"""Checks and zero-copy views at the API edge: what a collective may be handed.

Every collective accepts contiguous CPU ``torch.Tensor``s or C-contiguous ``numpy.ndarray``s.
Numpy arrays become tensors over the same memory (``torch.from_numpy``), so backends see one
kind of object; the native backend hands the engine the tensor itself (data_ptr, nbytes).
A group whose backend has a CUDA ``device`` (nccl) accepts CUDA tensors on that device instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shardline import dtypes
from shardline.errors import InvalidArgumentError

__all__ = [
    "REDUCE_OPS",
    "SUPPORTED_DTYPES",
    "TensorLike",
    "as_tensor",
    "check_same_dtype",
    "dtype_name",
    "parse_op",
]

TensorLike = torch.Tensor | np.ndarray[Any, Any]

# torch dtype -> the engine's name, for the dtypes it moves (``shardline.dtypes``).
SUPPORTED_DTYPES: dict[torch.dtype, str] = dtypes.ENGINE_DTYPES

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")
_OP_ALIASES = {"mean": "avg", "product": "prod"}


def dtype_name(t: torch.Tensor) -> str:
    """The engine's name for ``t``'s dtype (``"float32"``, ...)."""
    return SUPPORTED_DTYPES[t.dtype]


def parse_op(op: object, *, dtype: torch.dtype, what: str, rank: int) -> str:
    """Normalises a reduction (``"sum"``, ``torch.distributed.ReduceOp.SUM``, ...) to a name.

    Raises:
        InvalidArgumentError: unknown op, or ``avg`` on a non-float dtype.
    """
    if op == "sum":  # the common case, without string work
        return "sum"
    name = str(op).rsplit(".", 1)[-1].lower() if not isinstance(op, str) else op.lower()
    name = _OP_ALIASES.get(name, name)
    if name not in REDUCE_OPS:
        raise InvalidArgumentError(
            f"{what} on rank {rank}: unknown op {op!r}; use one of {', '.join(REDUCE_OPS)}"
        )
    if name == "avg" and not dtype.is_floating_point:
        raise InvalidArgumentError(
            f"{what} on rank {rank}: op=avg is not defined for {dtype}; use op='sum' and divide, "
            "or cast to a float dtype"
        )
    return name


def as_tensor(
    value: object, *, what: str, rank: int, device: torch.device | None = None
) -> torch.Tensor:
    """Checks a collective's argument and returns it as a tensor over the same memory.

    Args:
        value: A torch tensor or numpy array.
        what: ``"all_reduce(out)"``-style name of the argument, for messages.
        rank: This rank, for messages.
        device: The group's CUDA device (nccl backend); ``None`` for CPU groups.

    Raises:
        InvalidArgumentError: wrong type, device, dtype, layout, or a read-only array.
    """
    if isinstance(value, torch.Tensor) and _fast_ok(value, device):
        return value.detach() if value.requires_grad else value
    if isinstance(value, np.ndarray) and device is not None:
        raise InvalidArgumentError(
            f"{what} on rank {rank}: got a numpy array, but the nccl backend works on CUDA "
            f"tensors on this rank's {device}; pass torch.from_numpy(a).to('{device}')"
        )
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:
            raise InvalidArgumentError(
                f"{what} on rank {rank}: numpy array is not C-contiguous; call "
                "np.ascontiguousarray() (the .contiguous() of numpy) first"
            )
        if not value.flags.writeable:
            raise InvalidArgumentError(
                f"{what} on rank {rank}: numpy array is read-only; pass a writable copy"
            )
        try:
            value = torch.from_numpy(value)
        except TypeError as exc:
            raise InvalidArgumentError(
                f"{what} on rank {rank}: unsupported numpy dtype {value.dtype}; use one of "
                f"{', '.join(SUPPORTED_DTYPES.values())}"
            ) from exc
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(
            f"{what} on rank {rank}: expected a torch.Tensor or numpy.ndarray, "
            f"got {type(value).__name__}"
        )
    t = value
    if device is not None:
        _check_cuda_device(t, what, rank, device)
    elif t.device.type == "cuda":
        raise InvalidArgumentError(
            f"{what} on rank {rank}: tensor is on {t.device}, but this group's backend works on "
            "CPU tensors; CUDA tensors need the NCCL backend: shardline.init(backend='nccl') "
            "(the default where CUDA is available), or move the tensor to CPU with .cpu()"
        )
    elif t.device.type != "cpu":
        raise InvalidArgumentError(
            f"{what} on rank {rank}: tensor is on device {t.device}; shardline's native backend "
            "works on CPU tensors, call .cpu() first"
        )
    if t.layout != torch.strided:
        raise InvalidArgumentError(
            f"{what} on rank {rank}: {t.layout} tensors are not supported; call .to_dense()"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(
            f"{what} on rank {rank}: unsupported dtype {t.dtype}; use one of "
            f"{', '.join(SUPPORTED_DTYPES.values())}"
        )
    if not t.is_contiguous():
        raise InvalidArgumentError(
            f"{what} on rank {rank}: tensor of shape {tuple(t.shape)} is not contiguous; "
            "call .contiguous() first"
        )
    if t.is_conj() or t.is_neg():
        raise InvalidArgumentError(
            f"{what} on rank {rank}: tensor has a lazy conj/neg bit; call .resolve_conj() / "
            ".resolve_neg() first"
        )
    # [Note: autograd] collectives write through .detach(), as torch.distributed does, so
    # DDP can broadcast parameters that require grad.
    return t.detach()


def _check_cuda_device(t: torch.Tensor, what: str, rank: int, device: torch.device) -> None:
    if t.device == device:
        return
    if t.device.type == "cuda":
        raise InvalidArgumentError(
            f"{what} on rank {rank}: tensor is on {t.device} but this rank's NCCL group runs on "
            f"{device} (one GPU per rank, LOCAL_RANK or SHARDLINE_DEVICE); move it with "
            f".to('{device}')"
        )
    raise InvalidArgumentError(
        f"{what} on rank {rank}: tensor is on {t.device}, but the nccl backend works on CUDA "
        f"tensors on this rank's {device}; move it with .to('{device}'), or use "
        "backend='native' (SHARDLINE_DEVICE=cpu) for CPU training"
    )


def _fast_ok(t: torch.Tensor, device: torch.device | None = None) -> bool:
    """The common case in one pass (~0.5 µs): a dense, contiguous tensor we can reduce."""
    return (
        (t.is_cpu if device is None else t.device == device)
        and t.layout == torch.strided
        and t.dtype in SUPPORTED_DTYPES
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    )


def check_same_dtype(what: str, rank: int, expected: torch.Tensor, actual: torch.Tensor) -> None:
    """Raises unless ``actual`` has ``expected``'s dtype."""
    if expected.dtype != actual.dtype:
        raise InvalidArgumentError(
            f"{what} on rank {rank}: dtype mismatch, expected {expected.dtype} (the input's) "
            f"but got {actual.dtype}"
        )


def check_numel(
    what: str, rank: int, expected: int, actual: torch.Tensor, hint: str | Callable[[], str]
) -> None:
    """Raises unless ``actual`` holds ``expected`` elements.

    ``hint`` says where ``expected`` came from; hot paths pass a lambda, so the text is built
    only on failure.
    """
    if actual.numel() != expected:
        text = hint if isinstance(hint, str) else hint()
        raise InvalidArgumentError(
            f"{what} on rank {rank}: expected {expected} elements ({text}) but got "
            f"{actual.numel()} (shape {tuple(actual.shape)})"
        )
