"""bench_collectives' worker: one rank of one world size.

Builds every backend's group from one TCPStore, measures the bounds (``_collectives_bounds``),
then runs each (op, size) cell on every backend back to back on the same buffers: a validation
against a closed form, an agreed iteration count, timed batches, a validation again. Rank 0
writes the result as JSON for the parent (``bench_collectives.py``) to report.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _collectives_bounds as _bounds
import _report
from _collectives_report import ELEM, SIZED_OPS, elements, traffic_factor

# Environment each engine variant is made under (restored afterwards).
VARIANT_ENV = {
    "native-1t": ("SHARDLINE_COMM_THREADS", "1"),
    "native-fixed": ("SHARDLINE_ONESHOT_BYTES", "262144"),
}
PATTERN = 8  # period of the validation pattern
CHECK_CHUNK = 1 << 20  # elements compared at a time


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
    from shardline.comm.backends.native import comm_threads  # noqa: PLC0415

    threads = comm_threads(world)
    bounds = _bounds.measure(sync, rank, world, cfg["bound_bytes"], threads)
    idles = sync.gather("idle", _bounds.idle_cpu(0.5))
    if rank == 0:
        result["bounds"] = bounds
        result["idle_cpu_percent_per_rank"] = idles
        _log(
            rank,
            f"  [n={world}] B1 {bounds['B1_copy_GBps']:.1f} GB/s, B2 "
            f"{bounds['B2_copy_all_ranks_GBps']:.1f} GB/s, loopback TCP "
            f"{bounds['B_lo_tcp_GBps']:.2f} GB/s; idle CPU per rank with all groups up: "
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
    beside = _bounds.Beside(sync, max_n * ELEM, cfg["beside_min_bytes"], threads)
    for op, size in cells:
        n = elements(op, size, world) if op != "barrier" else 0
        here = beside.wanted(n * ELEM) and op != "barrier"
        # The copy beside the cell moves what the op must (c*S bytes, read + write counted),
        # so that both have the same footprint in the caches.
        copy_bytes = int(traffic_factor(op, world) * n * ELEM / 2) // ELEM * ELEM
        if here:
            beside.before(copy_bytes)
        done = []
        for backend in cfg["backends"]:
            if backend not in groups:
                continue
            a = bufs_a.get(backend, buf_a)
            cell = _run_cell(
                backend, groups[backend], op, n, world, rank, sync, cfg, a, buf_b, scratch
            )
            cell.update(op=op, backend=backend, size=n * ELEM, requested_size=size)
            result["cells"].append(cell)
            done.append(cell)
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
        if here:
            measured = beside.after(copy_bytes)
            for cell in done:
                cell.update(measured)
            _log(
                rank,
                f"  [n={world}] {op:<14} {_report.fmt_size(n * ELEM):>9} all-rank copy beside "
                f"it: {measured['beside_copy_GBps']:.1f} GB/s",
            )
    beside.close()

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
