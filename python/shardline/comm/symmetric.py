"""Symmetric memory: CPU tensors that every rank of a host can read and write directly.

``symmetric_empty(shape, dtype=..., group=...)`` returns a tensor in a ``/dev/shm`` segment of
this rank that every other rank of the group has mapped too. An ``all_reduce`` of a tensor in
symmetric memory (the same place on every rank) then needs no copy through the engine's
shared-memory slots: rank ``i`` reduces part ``i`` from every rank's segment and writes the
result into every rank's segment, reading each input byte once and writing each output byte
once (the memory-traffic bound ``benches/bench_collectives.py`` prints). Any other op, and an
all-reduce of ordinary tensors, works as before.

Every rank of the group calls ``symmetric_empty`` with the same shape and dtype, in the same
order (it is a collective). The memory stays mapped while the tensor (or a view of it) lives,
and the group's engine keeps every rank's segment until the group is destroyed. On a group
of one rank, one that spans hosts, or a backend other than the native engine, it returns an
ordinary tensor: there is no shared memory to use.
"""

from __future__ import annotations

import ctypes
import math
import os
import secrets
from collections.abc import Sequence

import torch

from shardline import _native
from shardline.comm.group import ProcessGroup
from shardline.comm.objects import all_gather_object
from shardline.comm.world import default_group
from shardline.errors import InvalidArgumentError, ShardlineError


def symmetric_empty(
    *size: int | Sequence[int],
    dtype: torch.dtype = torch.float32,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """An uninitialised CPU tensor in symmetric memory; a collective of ``group``.

    ``size`` and ``dtype`` as ``torch.empty``'s; ``group`` the default group when ``None``.

    Example::

        grads = sl.symmetric_empty(1 << 22)      # 16 MiB of float32 on every rank
        grads.copy_(flat_gradients)
        sl.all_reduce(grads)                     # no copy through the shared-memory slots
    """
    g = group if group is not None else default_group()
    shape = _shape(size)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    native = g.engine()
    if g.transport != "shm" or not isinstance(native, _native.Group) or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    path = f"/dev/shm/shardline-{os.getpid()}-symm-{secrets.token_hex(6)}"
    _native.symmetric_create(path, nbytes)
    try:
        paths = all_gather_object(path, group=g)
        error = None
        try:
            segment = _native.symmetric_register(native, paths, nbytes)
        except ShardlineError as exc:
            error = f"{type(exc).__name__}: {exc}"
        # Every rank has mapped every segment (or failed) before any name goes.
        errors = all_gather_object(error, group=g)
    finally:
        _native.symmetric_unlink(path)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise ShardlineError(
            "symmetric_empty failed on rank(s) "
            + "; ".join(f"{r}: {e}" for r, e in failed)
            + f" (rank {g.rank} of group {g.name!r}); every rank must allocate the same size"
        )
    memory = (ctypes.c_char * nbytes).from_address(segment.address)
    memory.segment = segment  # type: ignore[attr-defined]  # the mapping lives with the tensor
    return torch.frombuffer(memory, dtype=dtype).view(shape)


def _shape(size: tuple[int | Sequence[int], ...]) -> tuple[int, ...]:
    if len(size) == 1 and not isinstance(size[0], int):
        size = tuple(size[0])
    if not all(isinstance(s, int) and s >= 0 for s in size):
        raise InvalidArgumentError(
            f"symmetric_empty: size must be non-negative ints (or one sequence of them), "
            f"got {size!r}"
        )
    return tuple(int(s) for s in size)  # type: ignore[arg-type]
