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

The bound beside each cell: other jobs on a shared host move B2 by 30 % and more within minutes,
so for each cell of at least ``--beside-min`` bytes the workers measure the all-rank copy rate
again (on the engine's thread count) just before and just after that cell's backends run, each
rank copying c*S/2 bytes: the copy moves the bytes the op must move, with the same footprint in
the caches (a last-level cache of hundreds of MiB holds 16-64 MiB cells at 16 ranks). The
table's "B2 here" is its best sample and "%here" the cell's algbw over the bound it gives: the
column to judge a shared-memory path by. "%bound" keeps the bound measured once at the start.

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
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness
import _report
from _collectives_report import BACKENDS, OPS, SIZED_OPS, derive, plot, table

DEFAULT_SIZES = "4K,64K,1M,16M,64M,256M"
QUICK_SIZES = "4K,64K,1M,16M,64M"
BOUND_BYTES = 256 << 20
BESIDE_MIN = "16M"  # cells this large get the all-rank copy rate measured beside them


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
        "beside_min_bytes": args.beside_min,
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
        "--beside-min",
        default=BESIDE_MIN,
        help="cells of at least this many bytes per rank get the all-rank copy rate measured "
        "just before and after them (their %%here; two buffers of the largest cell's size per "
        "rank); 0 turns it off",
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
    try:
        args.beside_min = 0 if args.beside_min == "0" else _harness.parse_size(args.beside_min)
    except argparse.ArgumentTypeError as exc:
        p.error(f"--beside-min: {exc}")
    args.timeout = args.timeout or (600.0 if args.quick else 2400.0)
    if args.out is None:
        tag = f"collectives-{os.cpu_count()}c-n{'-'.join(map(str, args.ranks))}"
        args.out = str(_report.RESULTS / (tag + ("-quick" if args.quick else "")))
    return args


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--worker":
        import _collectives_worker  # noqa: PLC0415

        return _collectives_worker.worker_main(argv[1])
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
        "~16 MiB (smaller buffers stay in cache and can beat a DRAM/stream bound), with the "
        "all-rank copy rate B2 measured once at the start; B2 here: that rate measured just "
        "before and after the cell (best of 4 samples), %here: algbw over the shm bound it "
        "gives; spread = (max - min) / median over repeats",
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
