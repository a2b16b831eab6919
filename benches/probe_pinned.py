"""Probe: what torch's pinned host allocations cost in host memory, and registered memory.

For offload, shards and their gradients live in pinned host memory. torch's caching host
allocator (``torch.empty(..., pin_memory=True)``, ``Tensor.pin_memory()``, a non-blocking copy
to the CPU) rounds each block up to a power of two. This prints, for a few sizes, the resident
memory the process gains and the allocator's own counters; then the same bytes allocated
exactly and page-locked with ``cudaHostRegister``: whether torch sees them as pinned, and the
host-to-device and device-to-host bandwidth of each kind.

    python benches/probe_pinned.py
"""

from __future__ import annotations

import os
import time

import torch

MIB = 2**20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bandwidth(host: torch.Tensor, dev: torch.Tensor) -> tuple[float, float]:
    """GB/s host-to-device and device-to-host, non-blocking copies, best of 3."""
    best = [0.0, 0.0]
    for _ in range(3):
        for i, (dst, src) in enumerate(((dev, host), (host, dev))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best[i] = max(best[i], host.numel() / (time.perf_counter() - t0) / 1e9)
    return best[0], best[1]


def main() -> None:
    torch.cuda.init()
    for n in (201 * MIB, 300 * MIB, 513 * MIB, 1025 * MIB):
        torch._C._host_emptyCache()
        before = rss()
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        grown = rss() - before
        stats = {k: v for k, v in torch.cuda.host_memory_stats().items() if "bytes.current" in k}
        print(f"pin_memory=True {n / MIB:7.0f} MiB: resident +{grown / MIB:7.0f} MiB, {stats}")
        del t
    torch._C._host_emptyCache()
    cudart = torch.cuda.cudart()
    for n in (300 * MIB, 1025 * MIB):
        before = rss()
        t = torch.empty(n, dtype=torch.uint8)
        t.fill_(0)
        rc = cudart.cudaHostRegister(t.data_ptr(), n, 0)
        grown = rss() - before
        print(
            f"registered      {n / MIB:7.0f} MiB: resident +{grown / MIB:7.0f} MiB, rc {rc}, "
            f"is_pinned {t.is_pinned()}"
        )
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        h2d, d2h = bandwidth(t, dev)
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        p_h2d, p_d2h = bandwidth(pinned, dev)
        pageable = torch.empty(n, dtype=torch.uint8)
        pageable.fill_(0)
        q_h2d, q_d2h = bandwidth(pageable, dev)
        print(
            f"  GB/s to device / to host: registered {h2d:.1f} / {d2h:.1f}, pin_memory "
            f"{p_h2d:.1f} / {p_d2h:.1f}, pageable {q_h2d:.1f} / {q_d2h:.1f}"
        )
        cudart.cudaHostUnregister(t.data_ptr())
        del t, dev, pinned, pageable
        torch._C._host_emptyCache()


if __name__ == "__main__":
    main()
