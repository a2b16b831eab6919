"""Page-locked host memory of exactly the size asked for.

torch's pinned allocations (``torch.empty(..., pin_memory=True)``, ``Tensor.pin_memory()``) go
through its caching host allocator, which rounds every block up to a power of two and keeps
freed blocks: a 300 MiB shard takes 512 MiB of host memory, a 1025 MiB one 2 GiB
(``benches/probe_pinned.py``). For the long-lived buffers of offload (shards, their
gradients) and of asynchronous checkpoints, that waste decides how large a model fits.

``pinned_empty`` maps anonymous memory of the exact size (pages, zero-filled) and page-locks it
with ``cudaHostRegister``: copies to and from it run at the same speed as torch's pinned
memory, and torch sees it as pinned (``is_pinned()``, so non-blocking copies stay
asynchronous). The lock is released (``cudaHostUnregister``) when the last tensor viewing the
memory is gone, before the pages are unmapped.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap

import torch

__all__ = ["pinned_empty"]

# Below this a block is left to torch's allocator: its rounding costs little there, and one
# mapping and registration per small tensor would cost more.
EXACT_FROM_BYTES = 1 << 20


class _Locked(mmap.mmap):
    """An anonymous mapping page-locked by CUDA; unlocked before it is unmapped."""

    address = 0

    def __del__(self) -> None:
        if self.address:
            address, self.address = self.address, 0
            # At interpreter exit torch may be half torn down: the exit unlocks the pages.
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]


def _clear_cuda_error() -> None:
    """Resets the CUDA runtime's last error of this thread.

    torch does not bind ``cudaGetLastError``: the runtime torch loaded is found among this
    process's mappings.
    """
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart" in line}
    for path in sorted(paths):
        ctypes.CDLL(path).cudaGetLastError()


def pinned_empty(size: tuple[int, ...] | int, *, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor in page-locked memory of exactly its bytes (rounded to pages).

    Without CUDA, or for blocks under 1 MiB, or where the driver refuses to lock the pages,
    it comes from torch's own pinned allocator (or, without CUDA, is plain host memory).
    """
    shape = (size,) if isinstance(size, int) else tuple(size)
    nbytes = math.prod(shape) * dtype.itemsize
    if not torch.cuda.is_available():
        return torch.zeros(shape, dtype=dtype)
    if nbytes < EXACT_FROM_BYTES:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    area = _Locked(-1, nbytes)
    raw = torch.frombuffer(area, dtype=torch.uint8)  # the tensor's storage holds `area`
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    if int(cudart.cudaHostRegister(raw.data_ptr(), nbytes, 0)) != 0:
        _clear_cuda_error()  # else torch's next launch check would report it as its own
        del raw
        area.close()
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    area.address = raw.data_ptr()
    return raw.view(dtype).view(shape)
