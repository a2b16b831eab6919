"""The Rust CPU AdamW against torch's CPU AdamW, and against the memory's bandwidth, one run.

One flat float32 parameter of ``--numel`` values (what a ZeRO unit's shard is) steps
``--reps`` times with each optimizer, on ``--threads`` threads (default: every core):

- ``sl.optim.CPUAdamW`` (``shardline._native.adam_step``, Rust);
- ``torch.optim.AdamW(fused=True)`` (torch's fastest on CPU), ``foreach=True`` and the
  single-tensor loop.

Reported per optimizer: the median step, values per second, the state bandwidth (AdamW reads
parameter, gradient and both moments and writes three of them: 28 bytes per value) and its
share of the *bound*: the memory bandwidth measured in the same run by torch's in-place
``a.add_(b)`` over buffers as large as the state (12 bytes moved per value: two read, one
written back, AdamW's pattern). Goals: at least
1.0x ``fused=True`` and 80 % of the bound.

    python benches/bench_cpu_optim.py                         # 64M values, every core
    python benches/bench_cpu_optim.py --numel 256M --tag cpu-16c

Writes ``benches/results/cpu-optim-<tag>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT / "python"))

import _report  # noqa: E402

from shardline.optim import CPUAdamW  # noqa: E402

BYTES_PER_VALUE = 28  # reads p, g, m, v (16 B); writes p, m, v (12 B)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", default="64M", help="values in the parameter (K, M suffixes)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="0: every core")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", default=str(ROOT / "benches" / "results"))
    return p.parse_args(argv)


def count(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def timed(fn: Any, reps: int) -> float:
    fn()  # first touch and state allocation
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(n: int, reps: int) -> float:
    """GB/s of ``a.add_(b)`` over ``n`` float32 values: 12 bytes moved per value.

    It reads two buffers and writes one of them in place, as AdamW does (a plain copy would
    also read every line it writes, which a count of 8 bytes per value does not see).
    """
    a, b = torch.rand(n), torch.rand(n)
    return 12 * n / timed(lambda: a.add_(b), reps) / 1e9


def main() -> None:
    args = parse()
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    n = count(args.numel)
    rows: dict[str, float] = {}
    bound_gbs = copy_bandwidth(2 * n, args.reps)  # two buffers as large as AdamW's four
    makers = {
        "shardline CPUAdamW": lambda ps: CPUAdamW(ps, lr=1e-3),
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "torch AdamW loop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    }
    for name, make in makers.items():
        p = torch.nn.Parameter(torch.rand(n))
        p.grad = torch.rand(n)
        opt = make([p])
        rows[name] = timed(opt.step, args.reps)
        del opt, p
    fused = rows["torch AdamW fused"]
    head = _report.header("bench_cpu_optim", _report.machine("cpu", ram=True))
    lines = [
        f"{n / 1e6:.0f}M float32 values, {threads} threads; add_ bandwidth {bound_gbs:.1f} GB/s "
        f"(the bound: {BYTES_PER_VALUE} B per AdamW value)",
        f"{'optimizer':<22}{'ms/step':>9}{'Gvalues/s':>11}{'GB/s':>8}{'of bound':>10}"
        f"{'vs fused':>10}",
    ]
    doc: dict[str, Any] = {"numel": n, "threads": threads, "copy_gbs": bound_gbs, "rows": {}}
    for name, t in rows.items():
        gbs = BYTES_PER_VALUE * n / t / 1e9
        lines.append(f"{name:<22}{1e3 * t:>9.1f}{n / t / 1e9:>11.2f}{gbs:>8.1f}"
                     f"{gbs / bound_gbs:>9.0%}{fused / t:>9.2f}x")  # fmt: skip
        doc["rows"][name] = {"s_per_step": t, "gbs": gbs, "of_bound": gbs / bound_gbs,
                             "vs_fused": fused / t}  # fmt: skip
    stem = Path(args.out_dir) / f"cpu-optim-{args.tag}"
    _report.publish(stem, head, "\n".join(lines), doc, lambda _: "no plot: one table")


if __name__ == "__main__":
    main()
