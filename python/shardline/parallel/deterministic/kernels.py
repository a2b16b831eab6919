"""On GPUs: the kernel settings under which a sample's bits do not depend on the batch around it.

Deterministic mode fixes the order of every sum over samples; on CPU the kernels underneath
already give a sample the same bits whatever the batch. On an H200 three kinds do not (fp32 and
bf16; 16 samples against their first 8, 4, 2 and 1, ``benches/gpu_batch_invariance.py``):

- **cuBLAS** splits the reduction dimension of a product across thread blocks (split-K) when
  the output is small (few rows: a small batch; or few columns: a small vocabulary), and adds
  the parts in its workspace, so a sample's output rows depend on how many samples share the
  product. cuBLASLt without a workspace never splits (``CUBLASLT_WORKSPACE_SIZE=0``,
  ``cublas_env``, read when the process first multiplies on the GPU), and the layers' products
  whose rows are samples go through it, as a product with a bias (``product``). cuBLAS itself
  keeps its workspace: without one every call waited for its product (the host blocked, 80 us
  a call on an H200) and a product with a bias ran 3.5x slower. The batched per-sample
  products (``torch.bmm``) stay on cuBLAS: each sample's product has the same shape in every
  layout, and they measured batch-invariant with the workspace.
- **Attention**: the flash kernel's gradients depend on the batch and the run;
  the memory-efficient kernel's backward adds with atomics (the order changes from run to
  run) unless torch's deterministic algorithms are on. Deterministic forwards run each
  ``scaled_dot_product_attention`` on the memory-efficient kernel with its backward under
  those algorithms (``attention.DeterministicAttention``), and any call that does not see on
  the math backend (batched products and a row-wise softmax: slower, and the scores kept).
- **index_add_** (an embedding's per-unit gradients) adds with atomics unless torch's
  deterministic algorithms are on; they are, around it (``algorithms``).

On CPUs, **MKL** (torch's BLAS on x86) picks its kernels' code path by the data's memory
alignment on CPUs with AVX-512, unless its strict reproducible mode is on: a batched product's
second matrix then rounds differently from the same product alone. ``mkl_strict`` turns that
mode on (``MKL_CBWR=AUTO,STRICT``) before MKL's first product, or refuses once it is too late.

(A fourth, ``sum(1)`` over a sample's rows, whose strategy follows the whole tensor's shape,
is avoided where the layers sum a bias's or a norm's rows: ``layers._per_unit_sum``.)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardline import config
from shardline.errors import InvalidArgumentError

__all__ = ["CUBLAS_ENV", "algorithms", "attention", "cublas_env", "mkl_strict", "product"]

# cuBLASLt without a workspace: no split-K, so no sum that depends on the shape.
CUBLAS_ENV = {"CUBLASLT_WORKSPACE_SIZE": "0"}
_ZEROS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T`` (plus ``bias``) on a GPU, through cuBLASLt's product with a bias.

    Without a bias it adds zeros (``x + 0 == x``; a ``-0.0`` comes out ``+0.0``): torch sends
    a product with a bias to cuBLASLt, whose workspace ``cublas_env`` empties.
    """
    if bias is None:
        key = (weight.shape[0], weight.dtype, weight.device)
        bias = _ZEROS.get(key)
        if bias is None:
            bias = _ZEROS[key] = torch.zeros(key[0], dtype=key[1], device=key[2])
    return F.linear(x, weight, bias)


def cublas_env() -> None:
    """Sets ``CUBLAS_ENV`` in this process's environment (those not set yet).

    torch reads them when the process first multiplies on the GPU, so this must run before
    that: ``make_deterministic`` of a model on a GPU and each deterministic forward there
    call it.

    Raises:
        InvalidArgumentError: one of them is set to another value.
    """
    for name, value in CUBLAS_ENV.items():
        had = config.env_var(name)
        if had is None:
            os.environ[name] = had = value
        if had != value:
            raise InvalidArgumentError(
                f"deterministic mode on a GPU needs {name}={value} (cuBLASLt without a "
                f"workspace never splits a product's sum, so a sample's bits do not depend on "
                f"the batch), but it is set to {had!r}; unset it or set it to {value!r} "
                "before the process starts"
            )


_CBWR_AUTO, _CBWR_COMPATIBLE, _CBWR_STRICT = 2, 3, 0x10000  # mkl_service.h's modes


@functools.cache
def _mkl_cbwr() -> Any:
    """MKL's ``cbwr`` get and set functions in this process, or ``None`` (no MKL)."""
    where = [Path(torch.__file__).parent / "lib" / "libtorch_cpu.so", None]
    for path, prefix in zip(where, ("mkl_serv_cbwr_", "mkl_cbwr_"), strict=True):
        try:
            lib = ctypes.CDLL(str(path) if path is not None else None)
            get, put = getattr(lib, prefix + "get"), getattr(lib, prefix + "set")
        except (OSError, AttributeError):
            continue
        get.argtypes, put.argtypes = [ctypes.c_int], [ctypes.c_int]
        return get, put
    return None


def mkl_strict() -> None:
    """MKL's strict reproducible mode in this process (as ``MKL_CBWR=AUTO,STRICT`` sets it).

    MKL reads its mode at its first product; ``make_deterministic`` of a model on CPU calls
    this, so prepare the model before anything multiplies, or set the variable before the
    process starts. Sets ``MKL_CBWR`` for the processes this one starts. Nothing to do
    without MKL (other BLAS libraries).

    Raises:
        InvalidArgumentError: MKL has already run in another mode in this process, or
            ``MKL_CBWR`` asks for another mode.
    """
    cbwr = _mkl_cbwr()
    if cbwr is None:
        return
    get, put = cbwr
    mode = get(-1)  # MKL_CBWR_ALL
    if mode & _CBWR_STRICT or mode & 0xFFFF == _CBWR_COMPATIBLE:
        return
    had = config.env_var("MKL_CBWR")
    if had:  # the user's choice, not a reproducible one: named, not overridden
        raise InvalidArgumentError(
            f"deterministic mode on CPU needs MKL's strict reproducible mode, but MKL_CBWR is "
            f"{had!r}; set it to 'AUTO,STRICT' (or add ',STRICT' to it) or unset it"
        )
    if put(_CBWR_AUTO | _CBWR_STRICT) == 0:
        os.environ["MKL_CBWR"] = "AUTO,STRICT"
        return
    raise InvalidArgumentError(
        "deterministic mode on CPU needs MKL's strict reproducible mode (without it, on CPUs "
        "with AVX-512, a product's bits depend on its memory's alignment), and MKL has already "
        "multiplied in this process in its default mode; set MKL_CBWR=AUTO,STRICT in the "
        "environment before the process starts, or prepare the model (make_deterministic, "
        "sl.distribute(..., deterministic=True or 'repeat')) before anything multiplies"
    )


@contextlib.contextmanager
def attention() -> Iterator[None]:
    """``scaled_dot_product_attention`` on the math backend inside the block (its backward too).

    The backward runs the kernels the forward chose, so the block covers the forward only.
    ``attention.DeterministicAttention`` takes the calls it sees to the memory-efficient
    kernel; this is for the others.
    """
    with sdpa_kernel(SDPBackend.MATH):
        yield


@contextlib.contextmanager
def algorithms() -> Iterator[None]:
    """Turns torch's deterministic algorithms on inside the block (as the caller had them after)."""
    if torch.are_deterministic_algorithms_enabled():
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
