"""Repeatable mode: the same bits run after run, for one layout (``deterministic="repeat"``).

Deterministic mode (``deterministic=True``) trains every layout to the same parameters, at the
price of per-sample gradients. Much reproducibility needs less: the same job run again, on
the same number of ranks, strategy and hardware, ends with the same bits, so a loss spike at
step 40,000 comes back at step 40,000, and a run resumed from a checkpoint (its optimizer's
state, data order and random state restored too) continues as the first one did. Two runs of
one layout make the same sums over their samples; what still differs between them is:

1. Kernels that add with atomics, or pick an algorithm by timing: torch's deterministic
   algorithms replace them, or raise naming the op (``torch.use_deterministic_algorithms``;
   on an H200 attention moves from cuDNN's kernel to the flash kernel's deterministic
   backward); cuDNN does not benchmark; cuBLAS gets a fixed workspace per stream
   (``CUBLAS_WORKSPACE_CONFIG``, set here when the process has not set it).
2. MKL's code path, which on CPUs with AVX-512 follows the memory's alignment: its strict
   reproducible mode (``kernels.mkl_strict``), for a model on CPU.
3. The group's sums. The native engine adds the ranks in rank order (a sum's order depends on
   the tensor's size and the world size only). NCCL picks its algorithm by the message's
   size and its NVLink SHARP reduction (NVLS) is not repeatable; Gloo and MPI are not ours:
   their groups sum through ``tree_group``, which adds the ranks in one fixed tree.

The model keeps its own kernels and its batch's products, so the cost is that of torch's
deterministic kernels (and of the tree group's sums, where a group takes one). The bits
still depend on the layout: another world size, micro-batch count or tensor-parallel size
sums in another order. ``deterministic=True`` removes that too.
"""

from __future__ import annotations

import os

import torch

from shardline import config
from shardline.comm.group import ProcessGroup
from shardline.comm.tree import tree_group
from shardline.errors import InvalidArgumentError
from shardline.parallel.deterministic import kernels

__all__ = ["CUBLAS_WORKSPACE", "fixed_sums", "repeatable_kernels"]

# cuBLAS's fixed workspace per stream that torch's deterministic algorithms ask for.
CUBLAS_WORKSPACE = ":4096:8"
_REPEATABLE_CUBLAS = (":4096:8", ":16:8")
_OWN_ORDER = ("native",)  # backends whose sums add the ranks in a fixed order


def repeatable_kernels(model: torch.nn.Module) -> None:
    """Kernels that give the same bits run after run, for this process (see the module's text).

    Process-wide and left on: torch's deterministic algorithms, cuDNN without benchmarking,
    and on a GPU cuBLAS's fixed workspace; for a model with parameters on CPU, MKL's strict
    reproducible mode (before MKL's first product in the process).

    Raises:
        InvalidArgumentError: ``CUBLAS_WORKSPACE_CONFIG`` is set to a size that is not
            repeatable, or MKL already ran in its default mode (``kernels.mkl_strict``).
    """
    if torch.cuda.is_available():
        had = config.env_var("CUBLAS_WORKSPACE_CONFIG")
        if not had:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        elif had not in _REPEATABLE_CUBLAS:
            raise InvalidArgumentError(
                f"deterministic='repeat' on a GPU needs cuBLAS's fixed workspace per stream, "
                f"but CUBLAS_WORKSPACE_CONFIG is {had!r}; set it to {CUBLAS_WORKSPACE!r} "
                "(or ':16:8') or unset it"
            )
    if any(not p.is_cuda for p in model.parameters()):
        kernels.mkl_strict()
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
    # Off: with deterministic algorithms torch fills every new tensor before use, so that
    # code reading memory it never wrote reads the same; no kernel of a training step does,
    # and on an H200 the fills took 111 launches of the 101M GPT's step.
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]


def fixed_sums(group: ProcessGroup) -> ProcessGroup:
    """``group``, or its ``tree_group`` where its backend's sums may change order run to run."""
    return group if group.backend in _OWN_ORDER else tree_group(group)
