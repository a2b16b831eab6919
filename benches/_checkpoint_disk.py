"""``bench_checkpoint.py``'s files and disk: sizes, fsync, eviction from the page cache, and
the disk's own speed (``dd`` and ``O_DIRECT``) that the contenders are measured against.
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BLOCK = 16 << 20


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in files_under(path))


def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def quiesce(settle: float) -> None:
    """Flushes every dirty page, then leaves the disk idle ``settle`` s (a virtual disk's host
    may still be writing or discarding what the guest flushed)."""
    os.sync()
    time.sleep(settle)


def cached_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def evict(path: Path) -> int:
    """fsyncs and drops every file under ``path`` from the page cache; returns Cached's drop."""
    gc.collect()  # unmaps files that the previous load left mapped
    before = cached_bytes()
    for f in files_under(path) if path.is_dir() else [path]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return before - cached_bytes()


def disk_round(d: Path, nbytes: int, rand_block: bytes, settle: float) -> dict[str, float]:
    """dd write (zeros, conv=fsync), os.write of a random block + fsync (and with O_DIRECT),
    dd read when evicted."""
    count = max(1, math.ceil(nbytes / BLOCK))
    f = d / "dd.bin"
    quiesce(settle)
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={count}", "conv=fsync", "status=none"],
        check=True,
    )
    t_dd = time.perf_counter() - t0
    fsync_path(d, directory=True)
    evicted = evict(f)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "status=none"], check=True)
    t_read = time.perf_counter() - t0
    f.unlink()
    g = d / "rand.bin"
    quiesce(settle)
    t0 = time.perf_counter()
    fd = os.open(g, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(count):
            view = memoryview(rand_block)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    t_rand = time.perf_counter() - t0
    g.unlink()
    direct = d / "direct.bin"
    try:
        t_direct = direct_write(direct, count, rand_block, settle)
        t_direct_read = direct_read(direct) if t_direct is not None else None
    finally:
        direct.unlink(missing_ok=True)
    return {
        "bytes": count * BLOCK,
        "dd_write": t_dd,
        "rand_write": t_rand,
        "direct_write": t_direct,
        "dd_read_cold": t_read,
        "direct_read": t_direct_read,
        "evicted": evicted,
    }


def direct_write(path: Path, count: int, rand_block: bytes, settle: float) -> float | None:
    """Seconds to write ``count`` random blocks to ``path`` with O_DIRECT (no page cache: the
    disk's streaming speed) + fsync; ``None`` where the filesystem refuses O_DIRECT (tmpfs).
    The caller removes the file."""
    import mmap  # noqa: PLC0415

    buf = mmap.mmap(-1, len(rand_block))  # page-aligned, as O_DIRECT needs
    buf.write(rand_block)
    quiesce(settle)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        return None
    whole = memoryview(buf)
    try:
        t0 = time.perf_counter()
        for _ in range(count):
            done = 0
            while done < len(whole):
                done += os.write(fd, whole[done:])
        os.fsync(fd)
        return time.perf_counter() - t0
    except OSError:
        return None
    finally:
        os.close(fd)
        whole.release()
        buf.close()


def direct_read(path: Path, threads: int = 8, request: int = 4 << 20) -> float | None:
    """Seconds to read ``path`` with O_DIRECT on ``threads`` threads in ``request``-byte
    pieces: the disk's parallel read speed without the page cache, which no loader of a cold
    file can beat; ``None`` where O_DIRECT is refused."""
    import mmap  # noqa: PLC0415

    size = path.stat().st_size
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    bufs = [mmap.mmap(-1, request) for _ in range(threads)]  # page-aligned

    def worker(i: int) -> None:
        off = i * request
        while off < size:
            os.preadv(fd, [bufs[i]], off)
            off += threads * request

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
        return time.perf_counter() - t0
    except OSError:
        return None
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
