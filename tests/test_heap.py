"""The heap keeps freed memory on CPU (``shardline.heap``), read from glibc's own accounts
(``mallinfo2``) in a fresh process each: malloc's thresholds are per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Forty 1 MiB tensors, alive together, then freed, after each step given: how many of their
# bytes malloc served from fresh mappings (``hblkhd`` while alive) and how many the heap
# still holds after the frees (``arena``). The process first fixes malloc's thresholds at
# glibc's initial values (128 KiB), where a fresh process starts: left dynamic, they follow
# what was freed before (importing torch, a backend's setup), and a control would depend on
# the packages installed. There, malloc maps blocks over 128 KiB and unmaps them when freed.
LOOP = """
import ctypes, json, sys
import torch

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
assert libc.mallopt(-1, 128 << 10) and libc.mallopt(-3, 128 << 10)  # trim, mmap thresholds

def blocks():
    before = libc.mallinfo2()
    live = [torch.ones(1 << 18) for _ in range(40)]
    alive = libc.mallinfo2()
    del live
    after = libc.mallinfo2()
    return {"mapped": alive.hblkhd - before.hblkhd, "kept": after.arena - before.arena}

read = {}
for how in sys.argv[1:]:
    if how == "keep":
        from shardline.heap import keep_freed_memory
        assert keep_freed_memory()
    elif how.startswith("init:"):
        import shardline as sl
        sl.init(backend=how.split(":")[1])
    elif how == "torch":  # torch's backend of ours, as a torch.distributed user starts it
        import shardline
        import torch.distributed as dist
        dist.init_process_group("shardline", store=dist.HashStore(), rank=0, world_size=1)
    read[how] = blocks()
print(json.dumps(read))
"""
MIB = 1 << 20


def _glibc() -> tuple[int, ...] | None:
    """glibc's version, or None under another C library."""
    try:
        name, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").split()
    except (ValueError, OSError):
        return None
    return tuple(int(part) for part in version.split(".")[:2]) if name == "glibc" else None


pytestmark = pytest.mark.skipif(
    (_glibc() or (0,)) < (2, 33),
    reason="shardline.heap tunes glibc's malloc (elsewhere it does nothing); the test reads "
    "glibc's mallinfo2 (2.33 and later)",
)


def heap(*steps: str, **env: str) -> dict[str, dict[str, int]]:
    """What ``LOOP`` reads after each of ``steps``, in a fresh process of one rank."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")}
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        full.pop(name, None)
    full.update(RANK="0", WORLD_SIZE="1", **env)
    done = subprocess.run(
        [sys.executable, "-c", LOOP, *steps],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kept_blocks_come_from_the_heap_and_stay_there() -> None:
    read = heap("plain", "keep")
    # 36 of the forty MiB: a few blocks may fit in what the heap held before. The control:
    # with malloc's initial thresholds it maps each block and unmaps it.
    assert read["plain"]["mapped"] >= 36 * MIB and read["plain"]["kept"] < 8 * MIB
    assert read["keep"]["mapped"] == 0 and read["keep"]["kept"] >= 36 * MIB


def test_init_and_the_torch_backend_keep_freed_memory_on_cpu() -> None:
    pytest.importorskip("shardline._native")
    for step in ("init:native", "torch"):
        kept = heap(step)[step]
        assert kept["mapped"] == 0 and kept["kept"] >= 36 * MIB, step
    # The setting off: init leaves malloc as it was.
    off = heap("init:gloo", SHARDLINE_KEEP_FREED_MEMORY="0")["init:gloo"]
    assert off["mapped"] >= 36 * MIB and off["kept"] < 8 * MIB
