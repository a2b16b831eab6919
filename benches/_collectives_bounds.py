"""The bandwidths that bound bench_collectives' ops, measured by its workers.

Once per world size: B1 (one core copying, read + write counted), B2 (every rank copying at
once, summed), B3 (every rank copying on as many threads as the engine's helpers) and B_lo (one
loopback TCP stream). And beside each large cell (``Beside``): the all-rank copy rate again,
just before and just after that cell's backends run, every rank copying the bytes the op
moves, so that a cell's % of bound is judged against the machine as it was while the cell
ran. Other jobs on a shared host moved B2 between 47 and 151 GB/s within an hour on a 16-core
host; a bound measured once per run read the same op time at 65 % one day and 86-123 %
another.

Every rank calls these functions in the same order (they synchronise through ``sync``).
Bandwidths take the best sample: noise from other jobs only ever lowers one.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

REPS = 4  # copies per timed sample
SAMPLE_BYTES = 256 << 20  # read + write per rank per sample beside a cell, at the least


def all_rank_copy(
    sync: Any,
    tag: str,
    src: Any,
    dst: Any,
    pool: tuple[ThreadPoolExecutor, int] | None,
    reps: int = REPS,
) -> float:
    """Bytes/s that every rank copying ``src`` into ``dst`` at once moves in all (read + write
    counted), over the slowest rank's time. With ``pool`` (an executor and its thread count),
    each rank copies on the pool's threads, one slice each (numpy releases the GIL)."""
    import numpy as np  # noqa: PLC0415

    step = -(-len(src) // (pool[1] if pool else 1))
    slices = [(src[i : i + step], dst[i : i + step]) for i in range(0, len(src), step)]

    def copies(pair: tuple[Any, Any]) -> None:
        for _ in range(reps):
            np.copyto(pair[1], pair[0])

    sync.gather(f"{tag}-go", None)
    t0 = time.perf_counter()
    if pool is None:
        copies((src, dst))
    else:
        list(pool[0].map(copies, slices))
    t_all = sync.gather(tag, time.perf_counter() - t0)
    return sync.world * reps * 2 * src.nbytes / max(t_all)


def measure(sync: Any, rank: int, world: int, nbytes: int, threads: int) -> dict[str, Any]:
    """B1, B2, B3 and B_lo in GB/s (best and samples), in the fields that ``derive`` reads.

    B1 and B_lo are measured on rank 0 only (0 elsewhere): the parent reads rank 0's result.
    """
    import numpy as np  # noqa: PLC0415

    nb = nbytes // 4
    src = np.full(nb, 1.0, dtype=np.float32)
    dst = np.full(nb, 2.0, dtype=np.float32)  # both touched: no page faults while timed
    np.copyto(dst, src)
    sync.gather("b1-start", None)
    b1 = []
    if rank == 0:
        for _ in range(5):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            b1.append(2 * src.nbytes / (time.perf_counter() - t0))
    b2s = [all_rank_copy(sync, f"b2-{i}", src, dst, None) for i in range(3)]
    b3s = []
    if threads > 1:
        with ThreadPoolExecutor(threads) as ex:
            all_rank_copy(sync, "b3-warm", src, dst, (ex, threads), reps=1)
            b3s = [all_rank_copy(sync, f"b3-{i}", src, dst, (ex, threads)) for i in range(3)]
    del src, dst
    blo = loopback_tcp(nbytes) if rank == 0 else []
    return {
        "B1_copy_GBps": max(b1, default=0) / 1e9,
        "B1_samples_GBps": [x / 1e9 for x in b1],
        "B2_copy_all_ranks_GBps": max(b2s) / 1e9,
        "B2_samples_GBps": [x / 1e9 for x in b2s],
        "comm_threads": threads,
        "B3_copy_all_threads_GBps": max(b3s) / 1e9 if b3s else None,
        "B_lo_tcp_GBps": max(blo, default=0) / 1e9,
        "B_lo_samples_GBps": [x / 1e9 for x in blo],
        "bound_bytes": nbytes,
    }


class Beside:
    """The all-rank copy rate measured beside each cell of at least ``min_bytes``.

    On the engine's thread count (B3's way when it has helpers, else B2's): two samples before
    the cell's backends and two after. Each copies ``c*S/2`` bytes per rank (of buffers as
    large as the largest cell), so that the copy moves what the op must and has its footprint
    in the caches, as often as it takes to move ``SAMPLE_BYTES``. ``before`` and ``after``
    take the bytes to copy; ``after`` returns the best sample in GB/s.
    """

    def __init__(self, sync: Any, max_bytes: int, min_bytes: int, threads: int) -> None:
        import numpy as np  # noqa: PLC0415

        self.sync, self.min_bytes, self.threads = sync, min_bytes, threads
        n = max_bytes // 4 if max_bytes >= min_bytes > 0 else 0
        self.src = np.full(n, 1.0, dtype=np.float32)
        self.dst = np.full(n, 2.0, dtype=np.float32)
        self.pool = (ThreadPoolExecutor(threads), threads) if threads > 1 and n else None
        self.samples: list[float] = []

    def wanted(self, nbytes: int) -> bool:
        return self.min_bytes > 0 and nbytes >= self.min_bytes and nbytes // 4 <= len(self.src)

    def _sample(self, tag: str, nbytes: int) -> None:
        n = nbytes // 4
        # Each rank moves at least SAMPLE_BYTES per sample, so that the ranks' start skew
        # (one store round trip) is small beside it.
        reps = max(2, -(-SAMPLE_BYTES // (2 * nbytes)))
        for i in range(2):
            self.samples.append(
                all_rank_copy(self.sync, f"{tag}-{i}", self.src[:n], self.dst[:n], self.pool, reps)
            )

    def before(self, nbytes: int) -> None:
        self.samples = []
        self._sample("beside-before", nbytes)

    def after(self, nbytes: int) -> dict[str, Any]:
        self._sample("beside-after", nbytes)
        return {
            "beside_copy_GBps": max(self.samples) / 1e9,
            "beside_samples_GBps": [x / 1e9 for x in self.samples],
            "beside_threads": self.threads,
        }

    def close(self) -> None:
        if self.pool is not None:
            self.pool[0].shutdown()
        self.src = self.dst = None


def loopback_tcp(nbytes: int, reps: int = 4) -> list[float]:
    """One TCP stream over 127.0.0.1 between two threads of this process: bytes/s per rep.

    4 MiB send/recv calls (Python's per-call cost is then negligible), default socket buffers.
    """
    chunk = 4 << 20
    payload = memoryview(bytearray(chunk))
    sink = bytearray(chunk)
    out: list[float] = []
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        tx = socket.create_connection(("127.0.0.1", port))
        rx, _ = srv.accept()
        for s in (tx, rx):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with tx, rx:
            for _ in range(reps + 1):  # the first is a warm-up

                def send() -> None:
                    left = nbytes
                    while left:
                        k = min(chunk, left)
                        tx.sendall(payload[:k])
                        left -= k

                th = threading.Thread(target=send)
                t0 = time.perf_counter()
                th.start()
                got = 0
                view = memoryview(sink)
                while got < nbytes:
                    r = rx.recv_into(view, min(chunk, nbytes - got))
                    if not r:
                        raise RuntimeError("loopback stream closed early")
                    got += r
                th.join()
                out.append(nbytes / (time.perf_counter() - t0))
    return out[1:]


def idle_cpu(seconds: float) -> float:
    """CPU use of this process (all threads) while the main thread sleeps, in % of one core."""
    t0, c0 = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    return 100 * (time.process_time() - c0) / (time.perf_counter() - t0)
