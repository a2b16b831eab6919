"""The process's heap on CPU: freed memory kept for reuse instead of faulted in again.

A training step on CPU allocates and frees its activations and gradients again every step,
and their sizes vary (micro-batches in flight, attention's products, buckets). glibc's malloc
hands memory back to the system when the free space at the top of its heap passes a
threshold, and serves blocks above another threshold from fresh mappings; either way the
next step writes to pages the kernel must fault in and zero first. A zero-bubble (ZB-H2)
pipeline stage, whose micro-batches in flight vary, faulted in 1,300-7,100 pages a step on
a 16-core host (up to 16 ms of system time a step), and a loop of tensors of random sizes
between 128 KiB and 4 MiB ran 2-5x slower than with the memory kept.

``keep_freed_memory`` raises both thresholds (``mallopt``): the top of the heap is given
back only past 2 GiB free, and blocks up to 32 MiB (the most glibc allows) come from the
heap. The process then keeps the memory of its peak step, as it would need it again next
step. Blocks above 32 MiB still come from fresh mappings. ``init`` calls it on CPU backends,
and so does torch's ``shardline`` backend when it makes a group, unless
``SHARDLINE_KEEP_FREED_MEMORY=0``; on a C library other than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import threading

__all__ = ["keep_freed_memory"]

# mallopt's parameters (glibc's malloc.h) and the largest values it accepts for them.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB
_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit (refused above it)

_lock = threading.Lock()
_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Has glibc's malloc keep freed memory for reuse (see the module's docstring).

    Returns:
        Whether the thresholds are set (``False`` where the C library is not glibc or
        refused them). Calling it again does nothing more.
    """
    global _kept  # noqa: PLW0603
    with _lock:
        if _kept is None:
            _kept = _set_thresholds()
        return _kept


def _set_thresholds() -> bool:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it; musl and others raise
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 when it took the value.
    return bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)) and bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    )
