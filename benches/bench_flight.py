"""What the flight recorder costs: small ops with it on and off, in one run.

The recorder (``shardline.comm.flight``) adds one record per op. Its cost is largest, as a
share, on the smallest ops, so this times blocking all_reduces and send/recv ping-pongs of a
few sizes on the same group with the recorder on and off, alternating blocks (``alternate``),
and prints microseconds per op and the difference. ``--device cuda`` runs it on NCCL, where a
small op takes tens of microseconds and the recorder must stay a small share of that.

    python benches/bench_flight.py                     # 2 ranks, native engine, here
    python benches/bench_flight.py --device cuda       # 2 GPUs, NCCL

Writes ``benches/results/flight-<device>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness
import _report

OPS_PER_STEP = 200


def parse_args() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--sizes", type=_harness.comma_list, default=["4", "1K", "64K"])
    _harness.add_blocks(p, steps=5, repeats=7, warmup=2)
    _harness.add_launch(p, timeout=600.0)
    return p


def worker(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from shardline.comm.flight import RECORDER  # noqa: PLC0415

    rank, _, device, group = _harness.join_job(args.device)
    cells = []
    for size in args.sizes:
        n = max(1, _harness.parse_size(size) // 4)
        t = torch.ones(n, device=device)

        def reduces(t: Any = t) -> None:
            for _ in range(OPS_PER_STEP):
                group.all_reduce(t)

        def pingpong(t: Any = t) -> None:
            for _ in range(OPS_PER_STEP // 2):
                if rank == 0:
                    group.send(t, 1)
                    group.recv(t, 1)
                elif rank == 1:
                    group.recv(t, 0)
                    group.send(t, 0)

        for kind, body in (("all_reduce", reduces), ("send/recv", pingpong)):

            def on(body: Any = body) -> None:
                RECORDER.enabled = True
                body()

            def off(body: Any = body) -> None:
                RECORDER.enabled = False
                body()

            times, _ = _harness.alternate({"on": on, "off": off}, args, device)
            RECORDER.enabled = True
            cells.append(
                {"size": n * 4, "op": kind}
                | {k: statistics.median(v) / OPS_PER_STEP for k, v in times.items()}
            )
    return _harness.leave_job(rank, {"cells": cells}, args.out)


def report(args: argparse.Namespace, results: dict[int, dict[str, Any]]) -> str:
    lines = [
        f"{'ranks':>5} {'op':>10} {'size':>6} {'on us':>8} {'off us':>8} {'cost us':>8} {'cost':>6}"
    ]
    for world, result in results.items():
        for c in result["cells"]:
            on, off = c["on"] * 1e6, c["off"] * 1e6
            lines.append(
                f"{world:>5} {c['op']:>10} {_report.fmt_size(c['size']):>6} {on:8.2f} "
                f"{off:8.2f} {on - off:8.2f} {(on - off) / off:6.1%}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, results = _harness.run_bench(
        parse_args(), argv, __file__, worker, lambda a, w, r, s: f"{w} ranks: {s:.0f} s"
    )
    text = "\n".join(
        [
            _report.header("bench_flight.py", _report.machine(args.device)),
            "median of alternating blocks; cost = on - off, per op (one op of a ping-pong is"
            " a send or a recv)",
            report(args, results),
        ]
    )
    print(text)
    out = Path(__file__).resolve().parent / "results" / f"flight-{args.tag or args.device}"
    out.with_suffix(".txt").write_text(text + "\n")
    _report.write_json(
        out.with_suffix(".json"),
        {"args": vars(args), "machine": _report.machine_info(), "results": results},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
