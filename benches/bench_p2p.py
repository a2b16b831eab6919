"""Point-to-point: send/recv between two ranks of one host, ours against torch's Gloo.

Backends, all in one run on the same two processes: ``native`` (our engine; ranks of one host
meet in the shared-memory arena's channels), ``native-tcp`` (the same engine with a distinct
host id per rank, so messages go over loopback TCP: the path before the channels existed),
``gloo`` (``torch.distributed`` on Gloo). Two measurements per size:

- ping-pong: rank 0 sends, rank 1 sends it back; half the round trip is the one-way time;
- exchange: each rank ``isend``s to the other and then ``recv``s from it at once, the pattern
  of a ring step or a pipeline's two directions (our engine used to deadlock on it once a
  message outgrew the transport's buffering: shared memory's sends now run on a thread of
  their own, and a TCP send that waits for room reads what reaches its rank meanwhile).

Run: ``python benches/bench_p2p.py [--sizes 4K,256K,4M,64M]``. Writes
``benches/results/p2p-<cores>c.{txt,json}``. Correctness is checked on every size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import add_launch, comma_list, join_job, leave_job, parse_size, run_bench
from _report import fmt_size, header, machine, machine_info, ratio, write_json

BACKENDS = ("native", "native-tcp", "gloo")
TCP_DEADLINE_S = 15.0


def parse_args(argv: list[str] | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=comma_list, default=comma_list("4K,64K,1M,16M,64M"))
    p.add_argument("--target", type=float, default=0.5, help="seconds per cell")
    p.add_argument("--ranks", type=int, nargs="+", default=[2], help=argparse.SUPPRESS)
    add_launch(p, timeout=900.0)
    return p


def _tcp_group(rank: int, world: int) -> Any:
    """Our engine on loopback TCP (a host id per rank), with a short deadline: an exchange
    whose ranks wait for each other fails the run within it."""
    import torch.distributed as dist  # noqa: PLC0415

    from shardline.comm import init_process_group  # noqa: PLC0415

    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), world, False, timedelta(seconds=120)
    )
    return init_process_group(
        store, rank, world, backend="native", name="p2p-tcp", host_id=f"host{rank}",
        timeout=TCP_DEADLINE_S,
    )  # fmt: skip


def _time(fn: Any, target: float) -> float:
    """Seconds per call of ``fn``, over as many calls as fill ``target`` (both ranks agree on
    the count: rank 0's estimate, broadcast through Gloo)."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-6)
    iters = torch.tensor([max(3, min(5000, int(target / one)))])
    dist.broadcast(iters, 0)
    t0 = time.perf_counter()
    for _ in range(int(iters)):
        fn()
    return (time.perf_counter() - t0) / int(iters)


def _ping(g: Any, rank: int, mine: Any, got: Any) -> None:
    """Rank 0 sends, rank 1 sends it back."""
    if rank == 0:
        g.send(mine, 1)
        g.recv(got, 1)
    else:
        g.recv(got, 0)
        g.send(got, 0)


def _exchange(g: Any, rank: int, mine: Any, got: Any) -> None:
    """Each rank sends to the other without waiting, then receives from it."""
    peer = 1 - rank
    if isinstance(g, types.ModuleType):  # torch.distributed
        w = g.isend(mine, peer)
    else:
        w = g.send(mine, peer, async_op=True)
    g.recv(got, peer)
    w.wait()


def worker(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    rank, world, _, ours = join_job("cpu")
    groups = {"native": ours, "native-tcp": _tcp_group(rank, world), "gloo": dist}
    cells = []
    for size in args.sizes:
        n = parse_size(size) // 4
        mine = torch.full((n,), float(rank + 1))
        got = torch.empty(n)
        for name, g in groups.items():
            ping_s = _time(partial(_ping, g, rank, mine, got), args.target)
            got.zero_()
            _exchange(g, rank, mine, got)
            ok = bool((got == float(2 - rank)).all())
            ex_s = _time(partial(_exchange, g, rank, mine, got), args.target)
            cell = {"size": n * 4, "backend": name, "one_way_s": ping_s / 2}
            cells.append({**cell, "exchange_s": ex_s, "ok": ok})
    groups["native-tcp"].shutdown()
    return leave_job(rank, {"cells": cells}, args.out)


def report(args: argparse.Namespace, result: dict[str, Any]) -> str:
    cells = result["cells"]
    lines = [
        f"{'size':>8} | {'one-way us':>32} | {'exchange us':>32} | shm vs tcp, vs gloo",
        f"{'':>8} | {'native':>10} {'tcp':>10} {'gloo':>10} | {'native':>10} {'tcp':>10} "
        f"{'gloo':>10} | one-way       exchange",
    ]
    for size in sorted({c["size"] for c in cells}):
        by = {c["backend"]: c for c in cells if c["size"] == size}
        ow = [by[b]["one_way_s"] * 1e6 for b in BACKENDS]
        ex = [by[b]["exchange_s"] * 1e6 for b in BACKENDS]
        bad = [b for b in BACKENDS if not by[b]["ok"]]
        lines.append(
            f"{fmt_size(size):>8} | {ow[0]:10.1f} {ow[1]:10.1f} {ow[2]:10.1f} | "
            + " ".join(f"{e:10.1f}" for e in ex)
            + f" | {ratio(ow[1], ow[0])} {ratio(ow[2], ow[0])}  "
            f"{ratio(ex[1], ex[0])} {ratio(ex[2], ex[0])}"
            + (f"  WRONG RESULT: {bad}" if bad else "")
        )
    lines.append("ratios > 1: ours (native, shared memory) is faster")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = parse_args(argv)
    args, results = run_bench(
        parser, argv, __file__, worker, lambda a, w, r, s: f"{w} ranks done in {s:.0f} s"
    )
    result = results[2]
    text = report(args, result)
    head = header("bench_p2p.py", machine("cpu"), argv)
    print(head + "\n" + text)
    tag = f"-{args.tag}" if args.tag else ""
    stem = Path(__file__).resolve().parent / "results" / f"p2p-{os.cpu_count()}c{tag}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.txt").write_text(head + "\n" + text + "\n")
    write_json(Path(f"{stem}.json"), {"machine": machine_info(), "cells": result["cells"]})
    failed = [c for c in result["cells"] if not c["ok"]]
    return 3 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
