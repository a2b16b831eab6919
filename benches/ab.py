"""One benchmark from two checkouts, alternated A/B/A/B, and the medians side by side.

For a change that must not move performance: A is a checkout of the code before it (a
``git worktree`` with its engine built into ``python/shardline/``), B this one. Each run uses
its own checkout's bench script and package (``PYTHONPATH``), so A measures exactly what was
there before. Runs alternate so both see the same machine states; per cell, the median over
the A runs and over the B runs, and B/A - 1 in percent.

    git worktree add /tmp/base <rev>
    (cd /tmp/base && cargo build --release --features python \\
        && cp target/release/libshardline.so python/shardline/_native.abi3.so)
    python benches/ab.py --a /tmp/base --pairs 5 collectives --quick --ranks 2
    python benches/ab.py --a /tmp/base --pairs 5 ddp --ranks 2
    python benches/ab.py --a /tmp/base --pairs 5 p2p --sizes 4K,1M,16M
    python benches/ab.py --a /tmp/base --pairs 5 pipeline --ranks 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _report import RESULTS

ROOT = Path(__file__).resolve().parents[1]


def run(side: str, checkout: Path, bench: str, extra: list[str], i: int, tmp: Path) -> Any:
    """One run of ``bench`` from ``checkout``; its results as JSON."""
    env = {**os.environ, "PYTHONPATH": str(checkout / "python")}
    tag = f"ab-{side}{i}"
    cmd = [sys.executable, str(checkout / "benches" / f"bench_{bench}.py"), *extra]
    cmd += ["--out", str(tmp / tag)] if bench == "collectives" else ["--tag", tag]
    t0 = time.monotonic()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    print(f"  {side}{i}: {time.monotonic() - t0:.0f} s", flush=True)
    if bench == "collectives":
        return json.loads((tmp / f"{tag}.json").read_text())
    found = sorted((checkout / "benches" / "results").glob(f"{bench}*{tag}.*"))
    data = None
    for f in found:  # out of the checkout: these runs are raw material, not results
        if f.suffix == ".json":
            data = json.loads(f.read_text())
        shutil.move(str(f), tmp / f.name)
    return data


def cells(bench: str, data: Any) -> dict[str, float]:
    """Cell name -> the number compared (seconds per op or per step: lower is better)."""
    out: dict[str, float] = {}
    if bench == "collectives":
        for ranks, entry in data["results"].items():
            for c in entry.get("cells", []):
                if c.get("error") is None and c.get("median_s"):
                    name = f"{c['op']} {c['size']} B {c['backend']} n={ranks}"
                    out[name] = c["median_s"]
        return out
    if bench == "p2p":
        for c in data["cells"]:
            for kind in ("one_way", "exchange"):
                if c.get(f"{kind}_s"):
                    out[f"{kind} {c['size']} B {c['backend']}"] = c[f"{kind}_s"]
        return out
    for ranks, rows in data["results"].items():  # ddp: per model; pipeline: per schedule
        for name, r in rows.items():
            for side in ("shardline", "torch"):
                if r.get(f"{side}_step_ms"):
                    out[f"{name} n={ranks} {side} step"] = r[f"{side}_step_ms"] / 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="checkout of the code before")
    parser.add_argument("--b", type=Path, default=ROOT, help="checkout of the code after")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="text report [results/ab-*.txt]")
    parser.add_argument("bench", choices=["collectives", "ddp", "p2p", "pipeline"])
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="the bench's own arguments")
    args = parser.parse_args()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"shardline-ab-{os.getpid()}"
    tmp.mkdir(parents=True)
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for i in range(args.pairs):
        for side, checkout in (("A", args.a), ("B", args.b)):
            data = run(side, checkout, args.bench, args.extra, i, tmp)
            runs[side].append(cells(args.bench, data))
    names = [n for n in runs["B"][0] if all(n in r for side in runs.values() for r in side)]
    lines = [
        f"A/B: {args.bench} {' '.join(args.extra)}; {args.pairs} pairs, alternated A B A B ...",
        f"A = {args.a}, B = {args.b}; numbers are seconds per op/step (lower is better)",
        f"{'cell':44} {'A median':>11} {'B median':>11} {'B/A-1':>7}",
    ]
    diffs = []
    for n in names:
        a = statistics.median(r[n] for r in runs["A"])
        b = statistics.median(r[n] for r in runs["B"])
        diffs.append(100 * (b / a - 1))
        lines.append(f"{n:44} {a:11.3e} {b:11.3e} {diffs[-1]:+6.1f}%")
    lines.append(
        f"{len(diffs)} cells: median {statistics.median(diffs):+.1f}%, "
        f"range {min(diffs):+.1f}% .. {max(diffs):+.1f}%, "
        f"{sum(abs(d) <= 5 for d in diffs)} within 5 %"
    )
    text = "\n".join(lines)
    print(text)
    out = args.out or RESULTS / f"ab-{args.bench}.txt"
    out.write_text(text + "\n")
    print(f"wrote {out}; raw runs in {tmp}")


if __name__ == "__main__":
    main()
