"""On GPUs: the kernel settings under which a sample's bits do not depend on the batch around it.

Deterministic mode fixes the order of every sum over samples; on CPU the kernels underneath
already give a sample the same bits whatever the batch. On an H200 three kinds do not (fp32 and
bf16; 16 samples against their first 8, 4, 2 and 1, ``benches/gpu_batch_invariance.py``):

- **cuBLAS** splits the reduction dimension of a product across thread blocks (split-K) when
  the output is small (few rows: a small batch; or few columns: a small vocabulary), and adds
  the parts in its workspace, so a sample's output rows depend on how many samples share the
  product. Without a workspace it never splits: ``CUBLAS_WORKSPACE_CONFIG=:0:0`` and
  ``CUBLASLT_WORKSPACE_SIZE=0`` (``cublas_env``), read when the process first multiplies on
  the GPU.
- **Attention**: the flash and memory-efficient kernels' backward passes add with atomics
  (the order changes from run to run) and choose their split by the batch. The math backend
  (batched products and a row-wise softmax) has neither, so deterministic forwards run
  ``scaled_dot_product_attention`` on it (``attention``): more memory (the scores are kept).
- **index_add_** (an embedding's per-unit gradients) adds with atomics unless torch's
  deterministic algorithms are on; they are, around it (``algorithms``).

(A fourth, ``sum(1)`` over a sample's rows, whose strategy follows the whole tensor's shape,
is avoided where the layers sum a bias's or a norm's rows: ``layers._per_unit_sum``.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardline import config
from shardline.errors import InvalidArgumentError

__all__ = ["CUBLAS_ENV", "algorithms", "attention", "cublas_env"]

# cuBLAS and cuBLASLt without a workspace: no split-K, so no sum that depends on the shape.
CUBLAS_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}


def cublas_env() -> None:
    """Sets ``CUBLAS_ENV`` in this process's environment (those not set yet).

    cuBLAS reads them when the process first multiplies on the GPU, so this must run before
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
                f"deterministic mode on a GPU needs {name}={value} (cuBLAS without a "
                f"workspace never splits a product's sum, so a sample's bits do not depend on "
                f"the batch), but it is set to {had!r}; unset it or set it to {value!r} "
                "before the process starts"
            )


@contextlib.contextmanager
def attention() -> Iterator[None]:
    """``scaled_dot_product_attention`` on the math backend inside the block (its backward too).

    The backward runs the kernels the forward chose, so the block covers the forward only.
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
