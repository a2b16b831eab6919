"""Exact-size pinned host memory (``shardline._pinned``): page-locked, as large as asked,
unlocked when its last tensor is gone; torch's own pinned allocator rounds the same block up to
a power of two (``benches/probe_pinned.py``)."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch

from shardline import _pinned
from shardline._pinned import EXACT_FROM_BYTES, pinned_empty

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MIB = 2**20


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Spy:
    """torch's cudart bindings, recording the registrations and what the memory held when
    each was released (so the pages were still mapped then)."""

    def __init__(self) -> None:
        self.real = torch.cuda.cudart()
        self.registered: list[int] = []
        self.unregistered: list[tuple[int, float]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any:
        self.registered.append(ptr)
        return self.real.cudaHostRegister(ptr, size, flags)

    def cudaHostUnregister(self, ptr: int) -> Any:
        import ctypes

        self.unregistered.append((ptr, ctypes.c_float.from_address(ptr + 40).value))
        return self.real.cudaHostUnregister(ptr)


@pytest.mark.timeout(120)
def test_pinned_empty_is_exact_locked_and_released(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: spy)
    n = 75 * MIB + 3  # float32 elements: 300 MiB and 12 bytes
    # The CUDA context and the driver's first registration grow the process by ~100 MiB.
    torch.zeros(1, device="cuda")
    warm = pinned_empty(EXACT_FROM_BYTES, dtype=torch.uint8)
    del warm
    gc.collect()
    spy.registered.clear()
    spy.unregistered.clear()
    before = resident()
    t = pinned_empty(n, dtype=torch.float32)
    grown = resident() - before
    assert t.shape == (n,) and t.dtype == torch.float32 and t.is_pinned()
    assert spy.registered == [t.data_ptr()]
    assert int(t.count_nonzero()) == 0
    assert 4 * n <= grown < 4 * n + 8 * MIB, grown / MIB  # torch's allocator: 512 MiB

    # Values survive non-blocking copies both ways, on a side stream.
    src = torch.randn(n, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        t.copy_(src, non_blocking=True)
        back = t.to("cuda", non_blocking=True)
    side.synchronize()
    assert torch.equal(back, src)

    # A view keeps the memory locked; the last one releases it, before the unmapping.
    view = t[10:20].view(2, 5)
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert spy.unregistered == []
    assert view.is_pinned() and torch.equal(view.flatten().cuda(), src[10:20])
    held = resident()
    del view
    gc.collect()
    assert spy.unregistered == [(ptr, float(src[10]))]
    assert held - resident() >= 4 * n - MIB  # the pages went back
    torch.cuda.synchronize()  # no CUDA error was left behind


def test_small_blocks_use_torchs_allocator_and_shapes_pass_through() -> None:
    small = pinned_empty((3, 4), dtype=torch.bfloat16)
    assert small.shape == (3, 4) and small.is_pinned() and int(small.count_nonzero()) == 0
    assert small.nbytes < EXACT_FROM_BYTES
    big = pinned_empty((1024, 1024), dtype=torch.float64)
    assert big.shape == (1024, 1024) and big.is_pinned() and big.is_contiguous()


def test_a_refused_registration_falls_back_and_leaves_no_cuda_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = torch.cuda.cudart()
    refusals: list[Any] = []

    class Refusing:
        cudaHostUnregister = real.cudaHostUnregister

        @staticmethod
        def cudaHostRegister(ptr: int, size: int, flags: int) -> Any:
            # A real failure, so the runtime records it as its last error: flags it rejects.
            rc = real.cudaHostRegister(ptr, size, 0xFFFF)
            refusals.append(rc)
            return rc

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing)
    t = pinned_empty(4 * MIB, dtype=torch.uint8)
    assert len(refusals) == 1 and refusals[0] != real.cudaError.success  # the path under test
    assert t.is_pinned() and t.numel() == 4 * MIB
    monkeypatch.undo()
    x = torch.ones(1000, device="cuda") * 2  # a launch checks the last error
    torch.cuda.synchronize()
    assert float(x.sum()) == 2000
    _pinned._clear_cuda_error()
