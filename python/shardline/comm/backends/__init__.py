"""Backends a ProcessGroup can run on.

- ``native``: the Rust engine (CPU tensors; shared memory inside a host, TCP between hosts).
- ``nccl``: torch's ProcessGroupNCCL, for CUDA tensors (one GPU per rank).
- ``gloo``: torch's ProcessGroupGloo (CPU tensors), the reference.
- ``mpi``: mpi4py (CPU tensors), optional extra ``shardline[mpi]``.
"""

from __future__ import annotations

__all__ = ["gloo", "mpi", "native", "nccl"]
