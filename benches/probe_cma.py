"""Probe: can ranks read each other's memory with process_vm_readv, and how fast?

Runs N forked processes, each with a buffer of --mib MiB; every process reads its
neighbour's buffer with process_vm_readv (into a cache-sized scratch, and into a full-size
destination) and, for reference, memcpy's its own buffer. Prints aggregate GB/s.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import time

import numpy as np

libc = ctypes.CDLL(None, use_errno=True)


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


libc.process_vm_readv.restype = ctypes.c_ssize_t
libc.process_vm_readv.argtypes = [
    ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.POINTER(IoVec), ctypes.c_ulong,
    ctypes.c_ulong,
]


def readv(pid: int, remote: int, local: int, n: int) -> None:
    lv = IoVec(local, n)
    rv = IoVec(remote, n)
    got = libc.process_vm_readv(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
    if got != n:
        e = ctypes.get_errno()
        raise OSError(e, f"process_vm_readv({pid}) -> {got}: {os.strerror(e)}")


def worker(rank, n, nbytes, q_in, q_out, bar, chunk, reps):
    buf = np.full(nbytes, rank + 1, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    scratch = np.zeros(chunk, dtype=np.uint8)
    q_out.put((rank, os.getpid(), buf.ctypes.data))
    table = q_in.get()
    peer = (rank + 1) % n
    pid, addr = table[peer]
    res = {}
    # correctness
    readv(pid, addr, dst.ctypes.data, nbytes)
    assert int(dst[0]) == peer + 1 and int(dst[-1]) == peer + 1
    for name in ("memcpy", "cma_full", "cma_scratch"):
        times = []
        for _ in range(reps):
            bar.wait()
            t = time.perf_counter()
            if name == "memcpy":
                np.copyto(dst, buf)
            elif name == "cma_full":
                for off in range(0, nbytes, chunk):
                    readv(pid, addr + off, dst.ctypes.data + off, min(chunk, nbytes - off))
            else:
                for off in range(0, nbytes, chunk):
                    readv(pid, addr + off, scratch.ctypes.data, min(chunk, nbytes - off))
            bar.wait()
            times.append(time.perf_counter() - t)
        res[name] = sorted(times)[len(times) // 2]
    q_out.put((rank, res))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--chunks-kib", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    ctx = mp.get_context("fork")
    print(f"kernel {os.uname().release}, {os.cpu_count()} cpus, {a.mib} MiB per process")
    for n in a.ranks:
        for ck in a.chunks_kib:
            q_out, bar = ctx.Queue(), ctx.Barrier(n)
            qs = [ctx.Queue() for _ in range(n)]
            ps = [ctx.Process(target=worker, args=(r, n, a.mib << 20, qs[r], q_out, bar, ck << 10, a.reps)) for r in range(n)]
            for p in ps:
                p.start()
            table = {}
            for _ in range(n):
                r, pid, addr = q_out.get(timeout=60)
                table[r] = (pid, addr)
            if n == 1:
                table[0] = table[0]
            for q in qs:
                q.put(table)
            out = {}
            for _ in range(n):
                r, res = q_out.get(timeout=600)
                out[r] = res
            for p in ps:
                p.join(timeout=30)
            line = []
            for name in ("memcpy", "cma_full", "cma_scratch"):
                t = max(o[name] for o in out.values())
                line.append(f"{name} {n * (a.mib << 20) / t / 1e9:6.1f} GB/s")
            print(f"procs {n:2d} chunk {ck:5d} KiB: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
