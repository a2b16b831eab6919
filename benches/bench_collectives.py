#!/usr/bin/env python3
"""Side-by-side collective benchmark: shardline's native engine against torch's Gloo.

One run launches N worker processes per world size. The workers share one TCPStore and build
every backend's group from it; all backends use the same preallocated buffers, and for every
(op, size) cell the backends run back to back, so they see the same machine noise.

Per cell and backend: one validation op (rank-dependent inputs checked against a closed form;
a wrong result voids the cell), an agreed iteration count (about ``--target`` seconds per timed
batch), ``--repeats`` timed batches each after a barrier, then one more validation. A batch's
time is that of the slowest rank; the reported latency is the median over batches. Metrics as
nccl-tests: algbw = S/t with S the op's per-rank buffer (all_reduce, broadcast: the buffer;
reduce_scatter: the input; all_gather: the output), busbw = algbw * factor (all_reduce
2(N-1)/N, reduce_scatter and all_gather (N-1)/N, broadcast 1).

Bounds, measured in the same run. On one host, the least memory traffic of an op reads
every input byte once and writes every output byte once (what the engine does on symmetric
memory); per rank that is c*S bytes moved (read + write), c = 2 for all_reduce (its part of
every input, its part into every output), 1 + 1/N for reduce_scatter (its block of every input,
its output), 2 for all_gather and broadcast. The same bound holds for every path (the slots,
symmetric memory, Gloo), so % of bound means the same for all of them:
  shm (every op):      T >= max(cS/B1, NcS/B2)   B1 one core's copy bandwidth (read+write),
                                                 B2 all ranks copying at once (sum)
    with T helper threads per rank (SHARDLINE_COMM_THREADS; default 4 when each rank has 4 cores):
                       T >= max(cS/(T B1), NcS/B3)  B3 all ranks copying on T threads each
  TCP ring all_reduce: T >= 2(N-1)S/B_lo         B_lo one loopback TCP stream
Measure from 16 MiB up, on a buffer larger than the last-level cache across all ranks: smaller
ones stay in cache and beat a DRAM bound.

Backends: ``native`` (ProcessGroup, shared memory), ``native-tcp`` (the same engine with the
TCP path forced: a distinct host id per rank), ``gloo`` (raw ``ProcessGroupGloo`` calls, what
torch users get), ``native-raw`` (diagnostic: ``_native.Group`` called directly, no Python
layer), ``native-1t`` (the engine with one thread per rank: ``SHARDLINE_COMM_THREADS=1``),
``native-fixed`` (the engine with the one-shot all-reduce limit fixed at 256 KiB, as before it
was measured per communicator: ``SHARDLINE_ONESHOT_BYTES=262144``), ``native-symm`` (the engine
on buffers in symmetric memory, ``sl.symmetric_empty``, what DDP's buckets and ZeRO's flat
buffers use on CPU: its all-reduce, reduce-scatter and all-gather read every input and write
every output once, with no copy through the slots; broadcast as ``native``).

Each table ends with every native backend's all_reduce against its own reduce_scatter plus
all_gather of the same buffer (the two-phase algorithm's parts run as separate ops), and the
one-shot limit each group chose when it was made.

Exit status: 0 all good; 1 a worker failed or timed out (every rank's stderr is printed);
2 bad arguments; 3 the run finished but a backend or a cell failed (listed at the end).

Example: .venv/bin/python benches/bench_collectives.py --quick --ranks 2
Redraw a plot from saved results: bench_collectives.py --replot benches/results/NAME.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness
import _report

SIZED_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
OPS = (*SIZED_OPS, "barrier")
BACKENDS = (
    "native", "native-tcp", "gloo", "native-raw", "native-1t", "native-fixed", "native-symm"
)  # fmt: skip
# Backends that are the native engine on shared memory (their ops have the shm bound).
SHM_NATIVE = ("native", "native-raw", "native-1t", "native-fixed", "native-symm")
# Environment each engine variant is made under (restored afterwards).
VARIANT_ENV = {
    "native-1t": ("SHARDLINE_COMM_THREADS", "1"),
    "native-fixed": ("SHARDLINE_ONESHOT_BYTES", "262144"),
}
DEFAULT_SIZES = "4K,64K,1M,16M,64M,256M"
QUICK_SIZES = "4K,64K,1M,16M,64M"
BOUND_BYTES = 256 << 20
ELEM = 4  # float32
PATTERN = 8  # period of the validation pattern
CHECK_CHUNK = 1 << 20  # elements compared at a time


# ---------------------------------------------------------------------------------------------
# helpers shared by parent and workers


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


def traffic_factor(op: str, n: int) -> float:
    """c: bytes each rank must move (read + write), in units of the op's S, at the least."""
    return 1 + 1 / n if op == "reduce_scatter" else 2.0


def elements(op: str, size: int, n: int) -> int:
    """float32 elements of the op's per-rank buffer: a multiple of n (and at least n)."""
    del op
    return max(n, size // ELEM // n * n)


# ---------------------------------------------------------------------------------------------
# worker


class StoreSync:
    """Gathers small JSON values from every rank through the TCPStore (engine-independent).

    Every rank must call ``gather`` in the same order; keys carry a call counter.
    """

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world, self.n = store, rank, world, 0

    def gather(self, tag: str, value: Any) -> list[Any]:
        self.n += 1
        key = f"bench/sync/{self.n}/{tag}"
        self.store.set(f"{key}/{self.rank}", json.dumps(value))
        return [json.loads(bytes(self.store.get(f"{key}/{r}"))) for r in range(self.world)]

    def finish(self) -> None:
        """The last call: rank 0 (the store's host) returns only after every rank is done
        with the store, so no rank reads from a store that is gone."""
        self.store.add("bench/sync/finished", 1)
        if self.rank == 0:
            while self.store.add("bench/sync/finished", 0) < self.world:
                time.sleep(0.01)


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def worker_main(cfg_path: str) -> int:
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    cfg = json.loads(Path(cfg_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    op_timeout = float(cfg["op_timeout"])
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        rank == 0,
        datetime.timedelta(seconds=op_timeout + 60),
        wait_for_workers=False,
    )
    sync = StoreSync(store, rank, world)
    result: dict[str, Any] = {"world_size": world, "groups": {}, "cells": [], "bounds": {}}

    # -- groups: all from the one store, distinct names ---------------------------------------
    groups: dict[str, Any] = {}  # backend -> (kind, handle)
    for backend in cfg["backends"]:
        err = None
        t0 = time.perf_counter()
        try:
            groups[backend] = _make_group(backend, store, rank, world, op_timeout, groups)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        setup_s = time.perf_counter() - t0
        errs = sync.gather(f"create-{backend}", err)
        bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
        transport = None
        if backend in groups:
            transport = getattr(groups[backend][1], "transport", "gloo")
        if bad:
            groups.pop(backend, None)  # never used again (not shut down: it may be half-made)
            _log(rank, f"  [n={world}] backend {backend} FAILED to start: {bad[0]}")
        result["groups"][backend] = {
            "error": "; ".join(bad) or None,
            "setup_s": setup_s,
            "transport": transport,
        }

    # -- bounds --------------------------------------------------------------------------------
    nb = cfg["bound_bytes"] // ELEM
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
    sync.gather("b2-start", None)
    reps, b2s = 4, []
    np.copyto(dst, src)
    for i in range(3):
        sync.gather(f"b2-go-{i}", None)
        t0 = time.perf_counter()
        for _ in range(reps):
            np.copyto(dst, src)
        t_all = sync.gather(f"b2-{i}", time.perf_counter() - t0)
        b2s.append(world * reps * 2 * src.nbytes / max(t_all))
    del src, dst
    # B3: every rank copying on as many threads as the engine's helpers (numpy releases the GIL).
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from shardline.comm.backends.native import comm_threads  # noqa: PLC0415

    threads, b3s = comm_threads(world), []
    if threads > 1:
        pairs = [
            (np.full(nb // threads, 1.0, dtype=np.float32), np.full(nb // threads, 2.0, np.float32))
            for _ in range(threads)
        ]

        def copies(pair: tuple[Any, Any]) -> None:
            for _ in range(reps):
                np.copyto(pair[1], pair[0])

        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(copies, pairs))
            for i in range(3):
                sync.gather(f"b3-go-{i}", None)
                t0 = time.perf_counter()
                list(ex.map(copies, pairs))
                t_all = sync.gather(f"b3-{i}", time.perf_counter() - t0)
                b3s.append(world * reps * 2 * sum(p[0].nbytes for p in pairs) / max(t_all))
        del pairs
    blo = _loopback_tcp(cfg["bound_bytes"]) if rank == 0 else []
    idle = _idle_cpu(0.5)
    idles = sync.gather("idle", idle)
    if rank == 0:
        # Bounds take the best sample: noise from other jobs only ever lowers a bandwidth.
        result["bounds"] = {
            "B1_copy_GBps": max(b1) / 1e9,
            "B1_samples_GBps": [x / 1e9 for x in b1],
            "B2_copy_all_ranks_GBps": max(b2s) / 1e9,
            "B2_samples_GBps": [x / 1e9 for x in b2s],
            "comm_threads": threads,
            "B3_copy_all_threads_GBps": max(b3s) / 1e9 if b3s else None,
            "B_lo_tcp_GBps": max(blo) / 1e9,
            "B_lo_samples_GBps": [x / 1e9 for x in blo],
            "bound_bytes": cfg["bound_bytes"],
        }
        result["idle_cpu_percent_per_rank"] = idles
        bd = result["bounds"]
        _log(
            rank,
            f"  [n={world}] B1 {bd['B1_copy_GBps']:.1f} GB/s, B2 "
            f"{bd['B2_copy_all_ranks_GBps']:.1f} GB/s, loopback TCP "
            f"{bd['B_lo_tcp_GBps']:.2f} GB/s; idle CPU per rank with all groups up: "
            + ", ".join(f"{x:.0f}%" for x in idles),
        )

    # -- buffers, shared by every backend ------------------------------------------------------
    max_n = max(elements(op, s, world) for op in SIZED_OPS for s in cfg["sizes"])
    buf_a = torch.zeros(max_n, dtype=torch.float32)
    buf_b = torch.zeros(max_n // world, dtype=torch.float32)  # the n/N side of rs/ag
    # native-symm's own `a` side, in the symmetric memory of its group (a collective).
    bufs_a = {}
    if "native-symm" in groups:
        from shardline.comm.symmetric import symmetric_empty  # noqa: PLC0415

        bufs_a["native-symm"] = symmetric_empty(max_n, group=groups["native-symm"][1])
        bufs_a["native-symm"].zero_()
    scratch = torch.empty(min(max_n, CHECK_CHUNK), dtype=torch.float32)

    # -- warm-up: a few small ops per backend ------------------------------------------------
    for backend in list(groups):
        err = None
        try:
            a = bufs_a.get(backend, buf_a)
            fn, barrier = _op_fns(
                backend, groups[backend], "all_reduce", a[: 256 * world], None, world
            )
            for _ in range(20):
                fn()
            barrier()
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        errs = sync.gather(f"warm-{backend}", err)
        bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
        if bad:
            groups.pop(backend)
            result["groups"][backend]["error"] = "warm-up: " + "; ".join(bad)
            _log(rank, f"  [n={world}] backend {backend} FAILED in warm-up: {bad[0]}")

    # -- warm machine: seconds of large all-reduces on the native group, rank 0's clock
    # deciding for everyone (a broadcast flag keeps the ranks in lockstep) -------------------
    if "native" in groups and cfg.get("warmup_s", 0) > 0:
        pg = groups["native"][1]
        flag = torch.ones(1)
        big = buf_a[: min(max_n, 16 << 20)]
        start = time.monotonic()
        while flag.item() == 1.0:
            pg.all_reduce(big)
            flag.fill_(float(rank != 0 or time.monotonic() - start < cfg["warmup_s"]))
            pg.broadcast(flag, 0)
        buf_a.zero_()

    # -- cells ---------------------------------------------------------------------------------
    cells = [(op, s) for op in cfg["ops"] if op != "barrier" for s in cfg["sizes"]]
    if "barrier" in cfg["ops"]:
        cells.append(("barrier", 0))
    for op, size in cells:
        n = elements(op, size, world) if op != "barrier" else 0
        for backend in cfg["backends"]:
            if backend not in groups:
                continue
            a = bufs_a.get(backend, buf_a)
            cell = _run_cell(
                backend, groups[backend], op, n, world, rank, sync, cfg, a, buf_b, scratch
            )
            cell.update(op=op, backend=backend, size=n * ELEM, requested_size=size)
            result["cells"].append(cell)
            if cell.get("fatal"):
                groups.pop(backend)
                result["groups"][backend]["error"] = cell["error"]
            if cell["median_s"] is not None:
                _log(
                    rank,
                    f"  [n={world}] {op:<14} {_report.fmt_size(n * ELEM):>9} {backend:<10} "
                    f"{cell['median_s'] * 1e6:12.1f} us  ({cell['iters']} iters)",
                )
            else:
                _log(
                    rank,
                    f"  [n={world}] {op:<14} {_report.fmt_size(n * ELEM):>9} {backend:<10} "
                    f"FAILED: {cell['error']}",
                )

    for backend, (_kind, handle) in groups.items():
        # The native engine's one-shot all-reduce limit (set, or measured by its first one).
        engine = getattr(getattr(handle, "_impl", None), "_g", None)
        result["groups"][backend]["oneshot_bytes"] = getattr(engine, "oneshot_bytes", None)
    for _backend, (kind, handle) in groups.items():
        with contextlib.suppress(Exception):
            if kind != "native-raw" or "native" not in groups:
                handle.shutdown()
    sync.gather("done", None)
    if rank == 0:
        Path(cfg["result_path"]).write_text(json.dumps(result))
    sync.finish()
    return 0


def _make_group(
    backend: str, store: Any, rank: int, world: int, op_timeout: float, groups: dict[str, Any]
) -> tuple[str, Any]:
    import torch.distributed as dist  # noqa: PLC0415

    if backend == "gloo":
        pg = dist.ProcessGroupGloo(  # type: ignore[attr-defined]
            dist.PrefixStore("bench/gloo", store),  # type: ignore[attr-defined]
            rank,
            world,
            datetime.timedelta(seconds=op_timeout),
        )
        return ("gloo", pg)
    from shardline.comm import init_process_group  # noqa: PLC0415

    if backend in ("native", "native-symm"):  # native-symm: its own group, same engine
        name = "bench-shm" if backend == "native" else "bench-symm"
        return (
            backend,
            init_process_group(store, rank, world, backend="native", name=name, timeout=op_timeout),
        )
    if backend == "native-tcp":
        pg = init_process_group(
            store,
            rank,
            world,
            backend="native",
            name="bench-tcp",
            timeout=op_timeout,
            host_id=f"bench-host-{rank}",
            secret=b"shardline-bench-secret",
        )
        if pg.transport != "tcp":
            raise RuntimeError(f"native-tcp group reports transport {pg.transport!r}, not 'tcp'")
        return ("native-tcp", pg)
    if backend in VARIANT_ENV:
        var, value = VARIANT_ENV[backend]
        saved = os.environ.get(var)
        os.environ[var] = value
        try:
            pg = init_process_group(
                store, rank, world, backend="native", name=f"bench-{backend}", timeout=op_timeout
            )
        finally:
            if saved is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = saved
        return (backend, pg)
    if backend == "native-raw":
        if "native" in groups:  # the same communicator as "native", called without the wrapper
            return ("native-raw", groups["native"][1])
        return (
            "native-raw",
            init_process_group(
                store, rank, world, backend="native", name="bench-raw", timeout=op_timeout
            ),
        )
    raise ValueError(f"unknown backend {backend!r}")


def _op_fns(backend: str, group: tuple[str, Any], op: str, a: Any, b: Any, world: int) -> Any:
    """(fn, barrier): zero-argument callables running one blocking op / a barrier.

    Buffers: all_reduce, broadcast use ``a``; reduce_scatter reads ``a`` (n) into ``b`` (n/N);
    all_gather reads ``b`` (n/N) into ``a`` (n).
    """
    import torch.distributed as dist  # noqa: PLC0415

    kind, pg = group
    if kind == "gloo":
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        rs = getattr(pg, "_reduce_scatter_base", None) or pg.reduce_scatter_single
        fns = {
            "all_reduce": lambda: pg.allreduce([a]).wait(),
            "reduce_scatter": lambda: rs(b, a).wait(),
            "all_gather": lambda: pg._allgather_base(a, b).wait(),
            "broadcast": lambda: pg.broadcast([a], opts).wait(),
            "barrier": lambda: pg.barrier().wait(),
        }
        return fns[op], fns["barrier"]
    if kind == "native-raw":
        # The engine takes contiguous CPU tensors directly (data_ptr and nbytes).
        g = pg._impl._g
        va, vb = a, b
        fns = {
            "all_reduce": lambda: g.all_reduce(va, "float32", "sum", False).wait(),
            "reduce_scatter": lambda: g.reduce_scatter(vb, va, "float32", "sum", False).wait(),
            "all_gather": lambda: g.all_gather(va, vb, "float32", None, False).wait(),
            "broadcast": lambda: g.broadcast(va, "float32", 0, False).wait(),
            "barrier": lambda: g.barrier(False).wait(),
        }
        return fns[op], fns["barrier"]
    fns = {
        "all_reduce": lambda: pg.all_reduce(a),
        "reduce_scatter": lambda: pg.reduce_scatter(b, a),
        "all_gather": lambda: pg.all_gather(a, b),
        "broadcast": lambda: pg.broadcast(a, 0),
        "barrier": pg.barrier,
    }
    return fns[op], fns["barrier"]


def _pattern(t: Any, start: int, scale: float, add: float) -> None:
    """t[i] = scale * ((start + i) % 8) + add (exact in float32 for small values)."""
    import torch  # noqa: PLC0415

    n = t.numel()
    base = ((torch.arange(PATTERN) + start) % PATTERN).to(t.dtype) * scale + add
    k = n // PATTERN * PATTERN
    if k:
        t[:k].view(-1, PATTERN).copy_(base)
    if n > k:
        t[k:].copy_(base[: n - k])


def _check(t: Any, start: int, scale: float, add: float, scratch: Any, what: str) -> str | None:
    import torch  # noqa: PLC0415

    n = t.numel()
    for s in range(0, n, scratch.numel()):
        e = min(n, s + scratch.numel())
        exp = scratch[: e - s]
        _pattern(exp, start + s, scale, add)
        got = t[s:e]
        if not torch.equal(got, exp):
            i = int((got != exp).nonzero()[0, 0])
            return (
                f"{what}: element {s + i} is {got[i].item()!r}, expected {exp[i].item()!r} (of {n})"
            )
    return None


def _validate(
    fn: Any, op: str, n: int, world: int, rank: int, a: Any, b: Any, scratch: Any
) -> str | None:
    """Runs ``fn`` once on rank-dependent inputs; returns a mismatch message or None."""
    m = n // world
    tri = world * (world + 1) / 2
    if op == "all_reduce":
        _pattern(a[:n], 0, 1, rank + 1)
        fn()
        return _check(a[:n], 0, world, tri, scratch, "all_reduce")
    if op == "reduce_scatter":
        _pattern(a[:n], 0, 1, rank + 1)
        b[:m].fill_(-7.0)
        fn()
        return _check(b[:m], rank * m, world, tri, scratch, "reduce_scatter output")
    if op == "all_gather":
        _pattern(b[:m], 0, 1, rank + 1)
        a[:n].fill_(-7.0)
        fn()
        for r in range(world):
            bad = _check(a[r * m : (r + 1) * m], 0, 1, r + 1, scratch, f"all_gather slot {r}")
            if bad:
                return bad
        return None
    if op == "broadcast":
        if rank == 0:
            _pattern(a[:n], 0, 1, 1)
        else:
            a[:n].fill_(-7.0)
        fn()
        return _check(a[:n], 0, 1, 1, scratch, "broadcast")
    fn()  # barrier: nothing to check
    return None


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _run_cell(
    backend: str,
    group: tuple[str, Any],
    op: str,
    n: int,
    world: int,
    rank: int,
    sync: StoreSync,
    cfg: dict[str, Any],
    a: Any,
    b: Any,
    scratch: Any,
) -> dict[str, Any]:
    """One (op, size, backend) measurement. Every rank makes the same sequence of
    ``sync.gather`` calls whatever happens, so a failure never desynchronises the store."""
    cell: dict[str, Any] = {"median_s": None, "error": None, "fatal": False, "iters": None}
    m = n // world
    av, bv = (a[:n], b[:m]) if op in ("reduce_scatter", "all_gather") else (a[:n], None)
    if op == "barrier":
        av = None

    def agree(tag: str, local_err: str | None, value: Any = None) -> tuple[list[Any], str | None]:
        got = sync.gather(tag, [local_err, value])
        bad = [f"rank {r}: {e}" for r, (e, _v) in enumerate(got) if e]
        return [v for _e, v in got], ("; ".join(bad) or None)

    def attempt(tag: str, step: Callable[[], Any], fallback: Any) -> tuple[list[Any], str | None]:
        """Runs ``step`` here, then agrees: every rank's value (``fallback`` where it raised)."""
        try:
            value, err = step(), None
        except Exception as exc:
            value, err = fallback, _err(exc)
        return agree(tag, err, value)

    def batch(iters: int) -> float:
        """Seconds per op over ``iters`` ops, started after a barrier."""
        barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    # 1. validate (also the warm-up of this cell)
    err, fatal = None, False
    t_first = 0.0
    try:
        fn, barrier = _op_fns(backend, group, op, av, bv, world)
        t0 = time.perf_counter()
        err = _validate(fn, op, n, world, rank, a, b, scratch)
        t_first = time.perf_counter() - t0
    except Exception as exc:
        err, fatal = _err(exc), True
    vals, bad = agree("validate", err, [fatal, t_first])
    if bad:
        any_fatal = any(v[0] for v in vals)
        cell.update(error=("" if any_fatal else "INVALID RESULT ") + bad, fatal=any_fatal)
        return cell

    # 2. agree on the iteration count: a short calibration batch, the slowest rank decides
    target, lo, hi = cfg["target_s"], cfg["min_iters"], cfg["max_iters"]
    est = max(v[1] for v in vals)
    # est includes the validation's fill and check: an overestimate, so k stays small
    k = max(1, min(hi, math.ceil(0.02 / max(est, 1e-7))))
    vals, bad = attempt("calibrate", lambda: batch(k), est)
    if bad:
        cell.update(error=bad, fatal=True)
        return cell
    per_op = max(vals)
    iters = max(lo, min(hi, math.ceil(target / max(per_op, 1e-7))))
    cell["iters"] = iters

    # 3. timed batches, each after a barrier
    per_rank, bad = attempt("times", lambda: [batch(iters) for _ in range(cfg["repeats"])], [])
    if bad:
        cell.update(error=bad, fatal=True)
        return cell

    # 4. validate again: a fast number from a run that went wrong under load is void
    err, fatal = None, False
    try:
        err = _validate(fn, op, n, world, rank, a, b, scratch)
    except Exception as exc:
        err, fatal = _err(exc), True
    vals, bad = agree("revalidate", err, fatal)
    if bad:
        any_fatal = any(vals)
        cell.update(
            error=("" if any_fatal else "INVALID RESULT after timing: ") + bad, fatal=any_fatal
        )
        return cell

    slowest = [max(r[i] for r in per_rank) for i in range(cfg["repeats"])]
    cell.update(
        median_s=statistics.median(slowest),
        slowest_per_repeat_s=slowest,
        per_rank_s=per_rank,
    )
    return cell


def _loopback_tcp(nbytes: int, reps: int = 4) -> list[float]:
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


def _idle_cpu(seconds: float) -> float:
    """CPU use of this process (all threads) while the main thread sleeps, in % of one core."""
    t0, c0 = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    return 100 * (time.process_time() - c0) / (time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# parent


def run_world(world: int, args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any] | None, str]:
    """Launches ``world`` workers; returns (result, "") or (None, failure message)."""
    cfg = {
        "backends": args.backends,
        "ops": args.ops,
        "sizes": args.sizes,
        "repeats": args.repeats,
        "target_s": args.target,
        "min_iters": args.min_iters,
        "max_iters": args.max_iters,
        "op_timeout": args.op_timeout,
        "bound_bytes": args.bound_bytes,
        "warmup_s": args.warmup_seconds,
        "result_path": str(tmp / f"result-n{world}.json"),
    }
    cfg_path = tmp / f"cfg-n{world}.json"
    cfg_path.write_text(json.dumps(cfg))
    cmd = [str(Path(__file__).resolve()), "--worker", str(cfg_path)]
    try:
        # One thread per rank for torch; rank 0's progress goes to the terminal.
        stderr = _harness.launch(cmd, world, tmp, timeout=args.timeout, omp_threads=1, quiet=True)
    except _harness.RanksFailed as exc:
        return None, str(exc)
    result_path = Path(cfg["result_path"])
    if not result_path.exists():
        return None, f"world size {world}: workers exited 0 but wrote no result"
    warn = [f"rank {r}: {err}" for r, err in enumerate(stderr) if err]
    if warn:
        print(f"  [n={world}] note: workers wrote to stderr:\n" + "\n".join(warn), flush=True)
    return json.loads(result_path.read_text()), ""


def derive(world: int, res: dict[str, Any]) -> None:
    """Adds algbw, busbw, speedup vs gloo and % of bound to every cell, in place."""
    bd = res["bounds"]
    b1, b2, blo = (
        bd["B1_copy_GBps"] * 1e9,
        bd["B2_copy_all_ranks_GBps"] * 1e9,
        bd["B_lo_tcp_GBps"] * 1e9,
    )
    threads = bd.get("comm_threads", 1)
    b3 = (bd.get("B3_copy_all_threads_GBps") or 0) * 1e9

    def shm_bound(op: str, one_thread: bool) -> float:
        """algbw bound (B/s): c*S moved per rank, by its threads and by all ranks at once."""
        c = traffic_factor(op, world)
        if threads > 1 and b3 and not one_thread:
            return 1 / max(c / (threads * b1), c * world / b3)
        return 1 / max(c / b1, c * world / b2)

    shm = shm_bound("all_reduce", False)
    tcp = blo / (2 * (world - 1))
    bd["shm_all_reduce_algbw_bound_GBps"] = shm / 1e9
    bd["shm_algbw_bound_GBps"] = {op: shm_bound(op, False) / 1e9 for op in SIZED_OPS}
    bd["tcp_ring_all_reduce_algbw_bound_GBps"] = tcp / 1e9
    bd["formulas"] = {
        "shm": "T >= max(cS/B1, NcS/B2); c = 2 (all_reduce, all_gather, broadcast), "
        "1 + 1/N (reduce_scatter): every input read once, every output written once",
        "tcp_ring_all_reduce": "T >= 2(N-1)S/B_lo  (algbw <= B_lo/(2(N-1)))",
    }
    gloo = {(c["op"], c["size"]): c["median_s"] for c in res["cells"] if c["backend"] == "gloo"}
    for c in res["cells"]:
        t = c["median_s"]
        c["algbw_GBps"] = c["busbw_GBps"] = c["speedup_vs_gloo"] = None
        c["pct_shm_bound"] = c["pct_tcp_bound"] = None
        if t is None:
            continue
        c["latency_us"] = t * 1e6
        c["spread_pct"] = 100 * _report.spread(c["slowest_per_repeat_s"])
        if c["op"] != "barrier":
            c["algbw_GBps"] = c["size"] / t / 1e9
            c["busbw_GBps"] = c["algbw_GBps"] * bus_factor(c["op"], world)
        g = gloo.get((c["op"], c["size"]))
        if g and c["backend"] != "gloo":
            c["speedup_vs_gloo"] = g / t
        if c["op"] in SIZED_OPS:
            bound = shm_bound(c["op"], c["backend"] == "native-1t")
            c["pct_shm_bound"] = 100 * c["algbw_GBps"] * 1e9 / bound
        if c["op"] == "all_reduce":
            c["pct_tcp_bound"] = 100 * c["algbw_GBps"] * 1e9 / tcp


def table(world: int, res: dict[str, Any], ncores: int) -> str:
    bd = res["bounds"]
    lines = [
        f"== {world} ranks on {ncores} cores ==",
        f"best of: B1 (1 core copy, rd+wr) {bd['B1_copy_GBps']:.1f} GB/s; B2 (all {world} ranks) "
        f"{bd['B2_copy_all_ranks_GBps']:.1f} GB/s; loopback TCP B_lo "
        f"{bd['B_lo_tcp_GBps']:.2f} GB/s"
        + (
            f"; B3 (all {world} ranks x {bd['comm_threads']} threads) "
            f"{bd['B3_copy_all_threads_GBps']:.1f} GB/s"
            if bd.get("B3_copy_all_threads_GBps")
            else ""
        ),
        "shm algbw bounds (every input read once, every output written once): "
        + ", ".join(f"{op} {v:.2f}" for op, v in bd.get("shm_algbw_bound_GBps", {}).items())
        + " GB/s "
        + (
            f"[{bd['comm_threads']} threads per rank: T >= max(cS/(T B1), NcS/B3)]"
            if bd.get("B3_copy_all_threads_GBps")
            else "[T >= max(cS/B1, NcS/B2)]"
        )
        + f"; all_reduce TCP ring {bd['tcp_ring_all_reduce_algbw_bound_GBps']:.2f}"
        " GB/s [T >= 2(N-1)S/B_lo]",
    ]
    for b, g in res["groups"].items():
        if g.get("error"):
            lines.append(f"backend {b}: FAILED: {g['error']}")
    hdr = (
        f"{'op':<14} {'size':>9} {'backend':<10} {'median us':>11} {'algbw GB/s':>10} "
        f"{'busbw GB/s':>10} {'vs gloo':>8} {'%bound':>10} {'spread':>7}"
    )
    lines += [hdr, "-" * len(hdr)]
    prev = None
    for c in res["cells"]:
        key = (c["op"], c["size"])
        if prev is not None and key != prev:
            lines.append("")
        prev = key
        size = _report.fmt_size(c["size"]) if c["op"] != "barrier" else "-"
        if c["median_s"] is None:
            lines.append(f"{c['op']:<14} {size:>9} {c['backend']:<10} FAILED: {c['error']}")
            continue

        def f(x: float | None, spec: str) -> str:
            return "-" if x is None else format(x, spec)

        sp = f(c["speedup_vs_gloo"], ".1f") + ("x" if c["speedup_vs_gloo"] else "")
        pct = "-"
        if c["backend"] in SHM_NATIVE and c.get("pct_shm_bound") is not None:
            pct = f"{c['pct_shm_bound']:.0f}% shm"  # the same bound for every shared-memory path
        elif c["op"] == "all_reduce" and c.get("pct_tcp_bound") is not None:
            pct = f"{c['pct_tcp_bound']:.0f}% tcp"  # TCP paths (gloo too)
        lines.append(
            f"{c['op']:<14} {size:>9} {c['backend']:<10} {c['latency_us']:>11.1f} "
            f"{f(c['algbw_GBps'], '.3f'):>10} {f(c['busbw_GBps'], '.3f'):>10} {sp:>8} {pct:>10} "
            f"{c['spread_pct']:>6.0f}%"
        )
    lines += two_phase_table(res)
    return "\n".join(lines)


def two_phase_table(res: dict[str, Any]) -> list[str]:
    """Lines comparing each shared-memory native backend's all_reduce with its own
    reduce_scatter + all_gather of the same buffer, and the groups' one-shot limits."""
    t = {
        (c["backend"], c["op"], c["requested_size"]): c["median_s"]
        for c in res["cells"]
        if c["median_s"] is not None and c["op"] != "barrier"
    }
    rows = []
    for (backend, op, size), ar in sorted(t.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        rs, ag = t.get((backend, "reduce_scatter", size)), t.get((backend, "all_gather", size))
        if op != "all_reduce" or backend not in SHM_NATIVE or rs is None or ag is None:
            continue
        rows.append(
            f"{backend:<13} {_report.fmt_size(size):>9} {ar * 1e6:>14.1f} {(rs + ag) * 1e6:>12.1f} "
            f"{(rs + ag) / ar:>13.2f}x"
        )
    limits = [
        f"{b} {g['oneshot_bytes'] / 1024:.1f} KiB"
        for b, g in res["groups"].items()
        if g.get("oneshot_bytes") is not None
    ]
    out = []
    if rows:
        hdr = (
            f"{'backend':<13} {'size':>9} {'all_reduce us':>14} {'rs + ag us':>12} "
            f"{'ar vs rs+ag':>14}"
        )
        out += ["", "all_reduce against its own reduce_scatter + all_gather:", hdr, "-" * len(hdr)]
        out += rows
    if limits:
        out += ["one-shot all_reduce limit per group: " + ", ".join(limits)]
    return out


def plot(results: dict[int, dict[str, Any]], path: Path) -> str | None:
    """Latency and busbw against size, per op and world size; None once drawn, else why not."""
    said = _report.plot(path, lambda plt: _draw(plt, results), dpi=90)
    return None if said == f"plot: {path}" else said


def _draw(plt: Any, results: dict[int, dict[str, Any]]) -> Any:
    from matplotlib.ticker import NullLocator  # noqa: PLC0415

    worlds = sorted(results)
    ops = [
        op for op in SIZED_OPS if any(c["op"] == op for r in results.values() for c in r["cells"])
    ]
    if not ops:
        return "no plot: no sized ops measured"
    fig, axes = plt.subplots(
        2 * len(worlds), len(ops), figsize=(4.2 * len(ops), 3.3 * 2 * len(worlds)), squeeze=False
    )
    styles = {
        "native": "C0-o",
        "native-raw": "C2:^",
        "native-tcp": "C1-s",
        "gloo": "C3--x",
        "native-1t": "C4-.v",
        "native-fixed": "C5:x",
        "native-symm": "C6-D",
    }
    for wi, world in enumerate(worlds):
        res = results[world]
        for oi, op in enumerate(ops):
            ax_t, ax_b = axes[2 * wi][oi], axes[2 * wi + 1][oi]
            for backend in dict.fromkeys(c["backend"] for c in res["cells"]):
                pts = sorted(
                    (c["size"], c["latency_us"], c["busbw_GBps"])
                    for c in res["cells"]
                    if c["op"] == op and c["backend"] == backend and c["median_s"]
                )
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                ax_t.plot(xs, [p[1] for p in pts], styles.get(backend, "-"), label=backend)
                ax_b.plot(xs, [p[2] for p in pts], styles.get(backend, "-"), label=backend)
            f, bd = bus_factor(op, world), res["bounds"]
            shm_bound = bd.get("shm_algbw_bound_GBps", {}).get(op)
            if shm_bound is None and op == "all_reduce":  # results saved before per-op bounds
                shm_bound = bd["shm_all_reduce_algbw_bound_GBps"]
            if shm_bound is not None:
                ax_b.axhline(shm_bound * f, color="C0", lw=0.8, ls=":", label="shm bound")
            if op == "all_reduce":
                tcp_bound = bd["tcp_ring_all_reduce_algbw_bound_GBps"] * f
                ax_b.axhline(tcp_bound, color="C1", lw=0.8, ls=":", label="TCP ring bound")
            sizes = sorted({c["size"] for c in res["cells"] if c["op"] == op})
            for ax, ylabel in ((ax_t, "median latency (us)"), (ax_b, "busbw (GB/s)")):
                ax.set_xscale("log", base=2)
                if sizes:
                    labels = [_report.fmt_size(x).replace(" ", "").replace("iB", "") for x in sizes]
                    ax.set_xticks(sizes, labels, fontsize=8)
                    ax.xaxis.set_minor_locator(NullLocator())
                ax.set_yscale("log")
                ax.set_xlabel("bytes per rank")
                ax.set_ylabel(ylabel)
                ax.grid(True, which="both", alpha=0.3)
            ax_t.set_title(f"{op}, {world} ranks")
            ax_t.legend(fontsize=7)
            ax_b.legend(fontsize=7)
    return fig


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="shardline native collectives vs torch Gloo, side by side.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes")
    p.add_argument(
        "--ops",
        nargs="+",
        choices=OPS,
        default=list(SIZED_OPS),
        help="ops (barrier is measured once, without a size)",
    )
    p.add_argument(
        "--sizes",
        default=None,
        help=f"comma list of per-rank buffer sizes [default {DEFAULT_SIZES}; "
        f"--quick: {QUICK_SIZES}]",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        default=["native", "native-tcp", "gloo"],
        help="native-tcp forces the engine's TCP path (distinct host id per rank); "
        "native-raw calls _native.Group directly (Python-layer overhead)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes, repeats and a shorter target (a few minutes on 2 cores)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed batches per cell [5; quick 3]")
    p.add_argument(
        "--target", type=float, default=None, help="seconds per timed batch [0.3; quick 0.1]"
    )
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument(
        "--warmup-seconds",
        type=float,
        default=None,
        help="large native all-reduces before any cell, so every backend is timed on a warm "
        "machine (2-core VMs run a new process pair slowly for its first seconds) [3; quick 1]",
    )
    p.add_argument("--max-iters", type=int, default=None, help="[2000; quick 1000]")
    p.add_argument(
        "--bound-mib",
        type=int,
        default=BOUND_BYTES >> 20,
        help="buffer for the copy and loopback-TCP bounds",
    )
    p.add_argument(
        "--op-timeout",
        type=float,
        default=120.0,
        help="deadline of any single collective inside the workers (s)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="hard limit per world size, after which every worker is killed "
        "[quick 600 s, else 2400 s]",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output prefix; writes PREFIX.json, PREFIX.txt, PREFIX.png "
        "[benches/results/collectives-<cores>c-n<ranks>[-quick]]",
    )
    args = p.parse_args(argv)
    if args.bound_mib < 1:
        p.error("--bound-mib must be at least 1")
    if any(n < 2 for n in args.ranks):
        p.error("--ranks: world sizes must be at least 2")
    try:
        sizes = [
            _harness.parse_size(s)
            for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)).split(",")
            if s
        ]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    args.sizes = sorted(set(sizes))
    args.backends = list(dict.fromkeys(args.backends))
    args.ops = list(dict.fromkeys(args.ops))
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.target = args.target or (0.1 if args.quick else 0.3)
    if args.warmup_seconds is None:
        args.warmup_seconds = 1.0 if args.quick else 3.0
    args.max_iters = args.max_iters or (1000 if args.quick else 2000)
    args.min_iters = max(1, args.min_iters)
    args.bound_bytes = args.bound_mib << 20
    args.timeout = args.timeout or (600.0 if args.quick else 2400.0)
    if args.out is None:
        tag = f"collectives-{os.cpu_count()}c-n{'-'.join(map(str, args.ranks))}"
        args.out = str(_report.RESULTS / (tag + ("-quick" if args.quick else "")))
    return args


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--worker":
        return worker_main(argv[1])
    if len(argv) == 2 and argv[0] == "--replot":  # redraw PNG and table from a saved JSON
        doc = json.loads(Path(argv[1]).read_text())
        results = {int(w): r for w, r in doc["results"].items()}
        prefix = argv[1].removesuffix(".json")
        print("\n\n".join(table(w, results[w], doc["meta"]["cpu_count"]) for w in sorted(results)))
        print(plot(results, Path(f"{prefix}.png")) or f"wrote {prefix}.png")
        return 0
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = _report.machine_info()
    ncores = info["cpu_count"] or 0
    sizes = [_report.fmt_size(s) for s in args.sizes]
    print(
        f"bench_collectives: ranks {args.ranks}, backends {args.backends}, ops {args.ops}, "
        f"sizes {sizes}, {args.repeats} repeats x ~{args.target} s; "
        f"{ncores} cores ({info.get('cpu_model', '?')}), load {info['loadavg_start']}",
        flush=True,
    )
    results: dict[int, dict[str, Any]] = {}
    failures: list[str] = []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shardline-bench-") as tmpdir:
        for world in args.ranks:
            print(f"-- {world} ranks --", flush=True)
            res, why = run_world(world, args, Path(tmpdir))
            if res is None:
                print(f"ERROR: {why}", file=sys.stderr, flush=True)
                failures.append(why.splitlines()[0])
                continue
            derive(world, res)
            results[world] = res
    info["loadavg_end"] = os.getloadavg()
    info["wall_s"] = round(time.monotonic() - t_start, 1)
    texts = [table(w, results[w], ncores) for w in sorted(results)]
    problems = [
        f"n={w} backend {b}: {g['error']}"
        for w, r in results.items()
        for b, g in r["groups"].items()
        if g.get("error")
    ]
    problems += [
        f"n={w} {c['op']} {_report.fmt_size(c['size'])} {c['backend']}: {c['error']}"
        for w, r in results.items()
        for c in r["cells"]
        if c["error"] and not c.get("fatal")
    ]
    report = "\n\n".join(texts)
    footer = [
        f"{info.get('cpu_model', '?')}, {ncores} cores, torch {info.get('torch')}, shardline "
        f"{info.get('shardline_native', '?')}, git {info.get('git_commit', '?')[:10]} "
        f"({info.get('git_dirty_files', '?')} modified files), load {info['loadavg_start']} -> "
        f"{info['loadavg_end']}, {info['date_utc']}",
        "latency: median over repeats of the slowest rank's mean time per op; algbw = S/t, "
        "busbw = algbw x (2(N-1)/N all_reduce, (N-1)/N reduce_scatter/all_gather, 1 broadcast);"
        " vs gloo = t_gloo/t; %bound: algbw over the shm bound of the op (every native path on "
        "shared memory) or the all_reduce TCP ring bound (native-tcp, gloo), meaningful from "
        "~16 MiB (smaller buffers stay in cache and can beat a DRAM/stream bound); spread = "
        "(max - min) / median over repeats",
    ]
    report = report + "\n\n" + "\n".join(footer) + "\n"
    doc = {
        "meta": info,
        "args": vars(args),
        "results": {str(w): r for w, r in results.items()},
        "failures": failures + problems,
    }
    _report.write_json(Path(f"{out}.json"), doc)
    if results:
        Path(f"{out}.txt").write_text(report)
        note = plot(results, Path(f"{out}.png"))
        print("\n" + report)
        if note:
            print(note)
    print(f"wrote {out}.json" + (f", {out}.txt, {out}.png" if results else ""))
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    if problems:
        print("some backends or cells failed:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
