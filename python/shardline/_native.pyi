"""Type stubs for shardline._native, the Rust collective engine (PyO3)."""

import sys
from collections.abc import Sequence

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

__version__: str

class Listener:
    """A bound TCP listener for incoming peer connections of one communicator."""

    def __init__(self, host: str = "127.0.0.1") -> None: ...
    @property
    def address(self) -> str:
        """``"ip:port"`` to publish at rendezvous."""

def arena_create(path: str, num_ranks: int, slot_bytes: int) -> None:
    """Creates a shared-memory arena file (O_EXCL, mode 0600) for ``num_ranks`` local ranks."""

def arena_unlink(path: str) -> None:
    """Removes the arena's name; mapped ranks keep using it."""

def arena_sweep(directory: str = "/dev/shm") -> int:
    """Removes arena files left by dead processes; returns how many were removed."""

class Work:
    """A collective in flight."""

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until done (raises the op's error); ``timeout`` in seconds."""

    def is_completed(self) -> bool: ...

class Group:
    """A communicator: shared memory among ranks on one host, TCP between hosts.

    Buffers are writable, C-contiguous buffer-protocol objects of format ``'B'`` (uint8),
    e.g. ``tensor.view(torch.uint8).numpy()``; ``dtype`` names their element type
    (``"float32"``, ``"bfloat16"``, ...). The caller keeps them alive until the Work is done.
    """

    def __init__(
        self,
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
    ) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def transport(self) -> str:
        """``"single"``, ``"shm"``, ``"tcp"`` or ``"hierarchical"``."""

    def all_reduce(
        self, buf: Buffer, dtype: str, op: str = "sum", async_op: bool = False
    ) -> Work: ...
    def reduce_scatter(
        self, out: Buffer, inp: Buffer, dtype: str, op: str = "sum", async_op: bool = False
    ) -> Work: ...
    def all_gather(
        self,
        out: Buffer,
        inp: Buffer,
        dtype: str,
        counts: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Work:
        """``counts``: element count of every rank's input, for unequal sizes."""

    def broadcast(self, buf: Buffer, dtype: str, root: int, async_op: bool = False) -> Work: ...
    def reduce(
        self, buf: Buffer, dtype: str, op: str = "sum", root: int = 0, async_op: bool = False
    ) -> Work: ...
    def gather(
        self, out: Buffer | None, inp: Buffer, dtype: str, root: int = 0, async_op: bool = False
    ) -> Work: ...
    def scatter(
        self, out: Buffer, inp: Buffer | None, dtype: str, root: int = 0, async_op: bool = False
    ) -> Work: ...
    def all_to_all(self, out: Buffer, inp: Buffer, dtype: str, async_op: bool = False) -> Work: ...
    def barrier(self, async_op: bool = False) -> Work: ...
    def send(self, buf: Buffer, dtype: str, dst: int, async_op: bool = False) -> Work: ...
    def recv(self, buf: Buffer, dtype: str, src: int, async_op: bool = False) -> Work: ...
    def abort(self, reason: str) -> None:
        """Fails every pending and future op here and on every peer with ``reason``."""

    def close(self) -> None:
        """Waits for queued ops, then releases the transport; later calls raise."""
