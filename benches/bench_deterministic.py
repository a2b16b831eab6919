"""What deterministic mode costs the main job: ``--deterministic`` on and off, alternated.

Runs the main job (``shardline run --nproc-per-node N -m shardline.examples.train``, its
built-in model; ``--no-verify``) ``--pairs`` times per strategy with the default gradient sums
and with deterministic mode (per-sequence gradients, summed in one fixed tree, on the ranks
too), alternating, and prints each side's median tokens/s and the cost ``default / det - 1``.
The bar is 10 %. That the two sides train the same model is the job's own ``verify`` line
(without ``--no-verify``: the single-process replay, bit for bit) and
``tests/test_deterministic.py``.

    python benches/bench_deterministic.py                       # 2 processes, ddp and zero3
    python benches/bench_deterministic.py --nproc 8 --strategies ddp zero1 zero2 zero3
    python benches/bench_deterministic.py --strategies ddp --tp 2   # tensor parallelism
    python benches/bench_deterministic.py --mode repeat   # the same bits run after run only
    python benches/bench_deterministic.py --mode microbatch   # every layout, the model's kernels

Writes ``benches/results/deterministic-<tag>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _mainjob
import _report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--strategies", nargs="+", default=["ddp", "zero3"])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (both sides)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (both sides)")
    p.add_argument(
        "--mode",
        choices=["layouts", "microbatch", "repeat"],
        default="layouts",
        help="layouts: --deterministic (every layout's bits); microbatch: --deterministic "
        "microbatch (the same, on the model's kernels); repeat: --deterministic repeat",
    )
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    det_flags = ["--deterministic"] + ([args.mode] if args.mode != "layouts" else [])
    os.environ.pop("SHARDLINE_DETERMINISTIC", None)  # each side says which it is
    lines = [
        f"main job: {args.nproc} processes"
        + (f" (--pp {args.pp})" if args.pp > 1 else "")
        + (f" (--tp {args.tp})" if args.tp > 1 else "")
        + f", cpu, {args.steps} steps, {args.pairs} pairs, {' '.join(det_flags)}, "
        "alternated per strategy; cost = default / deterministic - 1 (bar 10 %)",
        f"{'strategy':9} {'default tok/s':>14} {'det tok/s':>12} {'cost':>8} {'pairs':>8}   "
        "runs (default | det; pairs: the median of each pair's cost)",
    ]
    tag = args.tag or f"cpu-{os.cpu_count()}c-{args.nproc}p" + (
        f"-pp{args.pp}" if args.pp > 1 else ""
    ) + (f"-tp{args.tp}" if args.tp > 1 else "") + (
        f"-{args.mode}" if args.mode != "layouts" else ""
    )
    rows = {}
    for strategy in args.strategies:

        def run(flags: list[str], strategy: str = strategy) -> float:
            flags = [*flags, "--tp", str(args.tp)] if args.tp > 1 else flags
            flags = [*flags, "--pp", str(args.pp)] if args.pp > 1 else flags
            return _mainjob.tokens_per_s(args.nproc, args.steps, strategy, "cpu", flags=flags)

        got = _mainjob.alternate(
            args.pairs, {"default": lambda _i: run([]), "det": lambda _i: run(det_flags)}
        )
        a, b = statistics.median(got["default"]), statistics.median(got["det"])
        # Each pair's two runs are neighbours in time: their ratio follows the host's drift
        # less than the medians of all runs do.
        pairs = zip(got["default"], got["det"], strict=True)
        paired = statistics.median(x / y - 1 for x, y in pairs)
        rows[strategy] = {**got, "cost": a / b - 1, "pairs_median_cost": paired}
        runs = " ".join(f"{x:,.0f}" for x in got["default"]) + " | "
        runs += " ".join(f"{x:,.0f}" for x in got["det"])
        lines.append(
            f"{strategy:9} {a:14,.0f} {b:12,.0f} {a / b - 1:+8.2%} {paired:+8.2%}   {runs}"
        )
        # Published after each strategy: a run cut short by a time limit keeps the finished.
        _report.publish(
            _report.RESULTS / f"deterministic-{tag}",
            _report.header(Path(__file__).name, _report.machine("cpu")),
            "\n".join(lines),
            {"args": vars(args), "results": rows},
            lambda _path: "no plot: a few numbers",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
