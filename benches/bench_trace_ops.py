"""What tracing costs one NCCL op where the host bounds the step: a tight loop of tiny ops.

A training step bound by the GPU hides the tracer's host work; one bound by the host's
launching pays all of it, and a step's time moves by more than a percent from block to block
(``bench_trace_blocks.py``), more than the cost being measured. Here one process queues
``--ops`` tiny asynchronous all-reduces (and a blocking one every ``--blocking-every``) on one
GPU and waits for them, a loop bound by the host alone, in rounds alternated between:

- ``off``: untraced;
- ``nccl-timed``: untraced, on an NCCL group made with NCCL's own timing of its ops
  (``TORCH_NCCL_ENABLE_TIMING``, torch's way to learn when an op ran on the GPU): what that
  alone costs;
- ``host``: traced with host times only (``SHARDLINE_TRACE_GPU=0``);
- ``gpu``: traced with GPU times, the driver's events read in batches;
- ``gpu-torch``: the same through torch's events, one call each;
- ``gpu-program`` (only when named in ``--sides``): what GPU times cost the program's thread
  alone: each op recorded and run as when traced with GPU times, its events handed back at
  once, no tracer's thread;
- ``gpu-pool`` (only when named): as ``gpu``, the group's own stream taken from torch's pool
  of streams (as torch takes its NCCL streams) instead of made by the driver.

Every side but ``nccl-timed`` runs on a group made without NCCL's timing, as a traced job's
are. Each traced round starts and stops the tracer inside its timing, and lasts a few
of the tracer's 1 s intervals, so most ops are written by its thread as in a long job. It
prints each side's microseconds per op (median of the rounds), its difference from ``off``
(what tracing adds to each NCCL op of a step bound by the host: the program's thread's own
work and its waits for the GIL while the tracer's thread holds it), the tracer's thread's CPU
per op (some of it with the GIL released) and the garbage collector's passes and time.

    python benches/bench_trace_ops.py --rounds 5 --ops 50000
    python benches/bench_trace_ops.py --sides off,gpu,gpu-program     # some sides only

Writes ``benches/results/trace-ops-<tag>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report
import torch

import shardline as sl
from shardline.comm.flight import RECORDER
from shardline.comm.trace import device as device_times
from shardline.comm.trace.recorder import TRACER

SIDES = ("off", "nccl-timed", "host", "gpu", "gpu-torch", "gpu-program", "gpu-pool")
NAMED_ONLY = ("gpu-program", "gpu-pool")


def _handed_back(record: object, timing: device_times.OpTiming) -> None:
    """The ``gpu-program`` side's taker of each op's timing: its events back in the pool."""
    pool = device_times._FREE.setdefault(timing.device, deque())
    pool.append(timing.start)
    pool.append(timing.end)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds per side")
    p.add_argument("--ops", type=int, default=50000, help="ops per round")
    p.add_argument("--blocking-every", type=int, default=8)
    p.add_argument("--tag", default="cuda")
    p.add_argument(
        "--sides",
        default=",".join(s for s in SIDES if s not in NAMED_ONLY),
        help="comma-separated ('off' always runs)",
    )
    args = p.parse_args(argv)
    sides = tuple(s for s in SIDES if s == "off" or s in args.sides.split(","))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29534"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    os.environ.pop("SHARDLINE_TRACE", None)
    world = sl.init(backend="nccl")
    untimed = world.new_group([0])
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"  # read by torch when a group is made
    timed = world.new_group([0])
    del os.environ["TORCH_NCCL_ENABLE_TIMING"]
    assert untimed is not None and timed is not None
    x = torch.ones(256, device="cuda")
    # The group's own stream, as traced ops make it (by the driver), and one from torch's pool.
    own_side = device_times.SideStream(0)
    native_module = device_times._native_module
    device_times._native_module = lambda: None  # type: ignore[assignment]
    pool_side = device_times.SideStream(0)
    device_times._native_module = native_module
    driver = device_times.events()
    # The time the garbage collector takes, by generation: what a traced op leaves alive for
    # a while (until the tracer writes it) makes the collector run more often.
    gc_time = [0.0, 0.0, 0.0]
    gc_began = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_began[0] = time.perf_counter()
        else:
            gc_time[info["generation"]] += time.perf_counter() - gc_began[0]

    gc.callbacks.append(on_gc)

    def loop(group: sl.ProcessGroup, n: int) -> None:
        works = []
        for i in range(n):
            if i % args.blocking_every == 0:
                group.all_reduce(x)
            else:
                works.append(group.all_reduce(x, async_op=True))
            if len(works) >= 64:
                for w in works:
                    w.wait()
                works.clear()
        for w in works:
            w.wait()

    def round_(side: str, folder: str) -> tuple[float, float, list[int], list[float]]:
        """(µs per op of the loop, the tracer's thread's CPU µs per op, GC passes and GC
        milliseconds by generation)."""
        group = timed if side == "nccl-timed" else untimed
        group._impl._side = pool_side if side == "gpu-pool" else own_side
        device_times.use_events(device_times.TORCH if side == "gpu-torch" else driver)
        torch.cuda.synchronize()
        passes = [s["collections"] for s in gc.get_stats()]
        gc_time[:] = [0.0, 0.0, 0.0]
        t = time.perf_counter()
        if side == "gpu-program":
            RECORDER.sink = deque(maxlen=64)  # records made (with their callers), not kept
            RECORDER.device_sink = _handed_back
        traced = side not in ("off", "nccl-timed", "gpu-program")
        if traced:
            TRACER.start(folder, rank=0, world_size=1, backend="nccl")
            if side == "host":
                RECORDER.device_sink = None
        thread = TRACER._thread
        clock = time.pthread_getcpuclockid(thread.ident) if thread and thread.ident else None
        loop(group, args.ops)
        tracer_cpu = time.clock_gettime(clock) if clock is not None else 0.0
        if traced:
            TRACER.stop()
        RECORDER.sink = RECORDER.device_sink = None
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        passes = [s["collections"] - p for s, p in zip(gc.get_stats(), passes, strict=True)]
        ms = [g * 1e3 for g in gc_time]
        return wall / args.ops * 1e6, tracer_cpu / args.ops * 1e6, passes, ms

    for side in sides:  # warm-up: NCCL's first ops, the tracer's first start
        with tempfile.TemporaryDirectory() as tmp:
            round_(side, tmp)
    us: dict[str, list[float]] = {s: [] for s in sides}
    tracer: dict[str, list[float]] = {s: [] for s in sides}
    passes: dict[str, list[list[int]]] = {s: [] for s in sides}
    gc_ms: dict[str, list[list[float]]] = {s: [] for s in sides}
    for r in range(args.rounds):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]  # each side leads in turn
        for side in order:
            with tempfile.TemporaryDirectory() as tmp:
                a, b, c, d = round_(side, tmp)
            us[side].append(a)
            tracer[side].append(b)
            passes[side].append(c)
            gc_ms[side].append(d)
    sl.shutdown()
    off = statistics.median(us["off"])
    lines = [
        f"1 process, 1 GPU, NCCL; {args.rounds} rounds per side of {args.ops} all-reduces of "
        f"256 floats (1 in {args.blocking_every} blocking), sides alternated",
    ]
    for side in sides:
        m = statistics.median(us[side])
        lines.append(
            f"{side:9s} {m:6.2f} us/op (median; rounds {[round(v, 2) for v in us[side]]}); "
            f"+{m - off:5.2f} us/op over off; the tracer's thread "
            f"{statistics.median(tracer[side]):.2f} us/op of CPU"
        )
        by_gen = [statistics.median(r[g] for r in passes[side]) for g in range(3)]
        ms_gen = [statistics.median(r[g] for r in gc_ms[side]) for g in range(3)]
        lines.append(
            f"{'':9s} garbage collector a round (median): passes {by_gen} by generation, "
            f"{[round(v, 1) for v in ms_gen]} ms; "
            f"{sum(ms_gen) * 1e3 / args.ops:.2f} us/op"
        )
    _report.publish(
        _report.RESULTS / f"trace-ops-{args.tag}",
        _report.header(Path(__file__).name, _report.machine("cuda")),
        "\n".join(lines),
        {"args": vars(args), "us": us, "tracer_us": tracer, "gc_passes": passes, "gc_ms": gc_ms},
        lambda _path: "no plot: a few numbers",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
