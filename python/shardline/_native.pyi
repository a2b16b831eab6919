"""Type stubs for shardline._native, the Rust collective engine (PyO3)."""

import sys
from collections.abc import Sequence
from typing import Protocol, TypeAlias, final, type_check_only

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

__version__: str
__all__ = [
    "Group",
    "Listener",
    "Work",
    "__version__",
    "arena_create",
    "arena_sweep",
    "arena_unlink",
]

@type_check_only
class _CpuTensor(Protocol):
    """A contiguous CPU torch tensor, as the engine sees it (Rust never imports torch)."""

    @property
    def is_cpu(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...
    def is_contiguous(self) -> bool: ...
    def data_ptr(self) -> int: ...

_Memory: TypeAlias = Buffer | _CpuTensor
"""_Memory an op reads or writes in place: a buffer-protocol object or a CPU tensor."""

@final
class Listener:
    """A bound TCP listener for incoming peer connections of one communicator."""

    def __new__(cls, host: str = "127.0.0.1") -> Listener: ...
    @property
    def address(self) -> str:
        """``"ip:port"`` to publish at rendezvous."""

def arena_create(path: str, num_ranks: int, slot_bytes: int) -> None:
    """Creates a shared-memory arena file (O_EXCL, mode 0600) for ``num_ranks`` local ranks."""

def arena_unlink(path: str) -> None:
    """Removes the arena's name; mapped ranks keep using it."""

def arena_sweep(directory: str = "/dev/shm") -> int:
    """Removes arena files left by dead processes; returns how many were removed."""

@final
class Work:
    """A collective in flight."""

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until done (raises the op's error); ``timeout`` in seconds."""

    def is_completed(self) -> bool: ...

@final
class Group:
    """A communicator: shared memory among ranks on one host, TCP between hosts.

    Buffers are writable, C-contiguous buffer-protocol objects of format ``'B'`` (uint8),
    e.g. ``tensor.view(torch.uint8).numpy()``; ``dtype`` names their element type
    (``"float32"``, ``"bfloat16"``, ...). The caller keeps them alive until the Work is done.
    """

    def __new__(
        cls,
        rank: int,
        world_size: int,
        *,
        name: str,
        secret: bytes,
        host_ids: Sequence[str],
        addrs: Sequence[str],
        listener: Listener | None,
        arena_path: str | None,
        timeout: float,
    ) -> Group: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def transport(self) -> str:
        """``"single"``, ``"shm"``, ``"tcp"`` or ``"hierarchical"``."""

    def all_reduce(
        self, buf: _Memory, dtype: str, op: str = "sum", async_op: bool = False
    ) -> Work: ...
    def reduce_scatter(
        self, out: _Memory, inp: _Memory, dtype: str, op: str = "sum", async_op: bool = False
    ) -> Work: ...
    def all_gather(
        self,
        out: _Memory,
        inp: _Memory,
        dtype: str,
        counts: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Work:
        """``counts``: element count of every rank's input, for unequal sizes."""

    def broadcast(self, buf: _Memory, dtype: str, root: int, async_op: bool = False) -> Work: ...
    def reduce(
        self, buf: _Memory, dtype: str, op: str = "sum", root: int = 0, async_op: bool = False
    ) -> Work: ...
    def gather(
        self, out: _Memory | None, inp: _Memory, dtype: str, root: int = 0, async_op: bool = False
    ) -> Work: ...
    def scatter(
        self, out: _Memory, inp: _Memory | None, dtype: str, root: int = 0, async_op: bool = False
    ) -> Work: ...
    def all_to_all(
        self, out: _Memory, inp: _Memory, dtype: str, async_op: bool = False
    ) -> Work: ...
    def barrier(self, async_op: bool = False) -> Work: ...
    def send(self, buf: _Memory, dtype: str, dst: int, async_op: bool = False) -> Work: ...
    def recv(self, buf: _Memory, dtype: str, src: int, async_op: bool = False) -> Work: ...
    def abort(self, reason: str) -> None:
        """Fails every pending and future op here and on every peer with ``reason``."""

    def close(self) -> None:
        """Waits for queued ops, then releases the transport; later calls raise."""
