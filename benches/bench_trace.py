"""What tracing costs the main job: ``SHARDLINE_TRACE`` on and off, alternated, in one run.

Runs the main job (``shardline run --nproc-per-node N -m shardline.examples.train``, its
built-in model; ``--no-verify``) ``--pairs`` times with tracing off and on, alternating, and
prints each side's median tokens/s (the job's own summary line) and the overhead
``off / on - 1``. Tracing writes every rank's timeline and heartbeat once per
``SHARDLINE_TRACE_INTERVAL`` (1 s); the bar is 1 %. After the last traced run it also checks
that ``shardline doctor`` finds nothing wrong with that healthy job and times its answer.

    python benches/bench_trace.py                      # 2 processes, 5 pairs, here
    python benches/bench_trace.py --nproc 8 --strategy zero3 --device cpu

Writes ``benches/results/trace-<tag>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _mainjob
import _report

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    os.environ.pop("SHARDLINE_TRACE", None)  # each side says whether it traces
    with tempfile.TemporaryDirectory() as tmp:

        def run(trace: Path | None) -> float:
            env = {"SHARDLINE_TRACE": str(trace)} if trace is not None else {}
            return _mainjob.tokens_per_s(args.nproc, args.steps, args.strategy, args.device,
                                         env=env)  # fmt: skip

        runs = _mainjob.alternate(
            args.pairs,
            {"off": lambda _i: run(None), "on": lambda i: run(Path(tmp) / f"trace{i}")},
        )
        off, on = runs["off"], runs["on"]
        t0 = time.perf_counter()
        last = Path(tmp) / f"trace{args.pairs - 1}"
        doctor = subprocess.run(
            [sys.executable, "-m", "shardline", "doctor", str(last)],
            env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        took = time.perf_counter() - t0
    a, b = statistics.median(off), statistics.median(on)
    lines = [
        f"main job: {args.nproc} processes, {args.strategy}, {args.device}, {args.steps} steps, "
        f"{args.pairs} pairs alternated",
        f"tracing off: {a:,.0f} tokens/s (median; runs {', '.join(f'{x:,.0f}' for x in off)})",
        f"tracing on:  {b:,.0f} tokens/s (median; runs {', '.join(f'{x:,.0f}' for x in on)})",
        f"overhead: {a / b - 1:+.2%} (off / on - 1; bar 1 %)",
        f"doctor on the last traced run (exit {doctor.returncode}, {took:.2f} s including "
        f"the interpreter's start): {doctor.stdout.strip()}",
    ]
    tag = args.tag or f"{args.device}-{os.cpu_count()}c-{args.nproc}p"
    _report.publish(
        _report.RESULTS / f"trace-{tag}",
        _report.header(Path(__file__).name, _report.machine(args.device)),
        "\n".join(lines),
        {
            "args": vars(args),
            "off": off,
            "on": on,
            "overhead": a / b - 1,
            "doctor_rc": doctor.returncode,
            "doctor_s": took,
        },
        lambda _path: "no plot: two numbers",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
