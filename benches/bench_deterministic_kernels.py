"""Deterministic mode's CPU kernels beside what the default runs, on the main job's shapes.

Two tables, one process, times in microseconds per call (the median of ``--repeats`` batches):

- **Weight gradients.** For each weight of the main job's model (16 sequences of 64 tokens a
  process), the default's one product over the batch (``mm``: ``dy^T @ x``, torch's threads)
  against the engine's per-sequence products summed in the canonical tree
  (``_native.unit_products``) on 1, 2, 4 ... threads of torch's OpenMP runtime.
- **Layer norm backward** (16 x 64 rows of 64): torch's own (``aten``: the input's gradient
  and both parameters' sums over all rows) against the engine's one pass (the input's
  gradient and the per-sequence sums) on 1 thread and on all of them.

    python benches/bench_deterministic_kernels.py                 # threads 1 and 2
    python benches/bench_deterministic_kernels.py --threads 1 2 4 8

Only prints (no results file): the docs quote its output where they cite it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from shardline import _native

UNITS, ROWS = 16, 64  # sequences and tokens of one process of the main job
SHAPES = {"qkv": (192, 64), "proj": (64, 64), "fc1": (256, 64), "fc2": (64, 256), "head": (256, 64)}


def timed(f: Callable[[], object], calls: int, repeats: int) -> float:
    """Microseconds per call: the median of ``repeats`` batches of ``calls``, after a warm-up."""
    for _ in range(calls // 10 + 1):
        f()
    batches = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        batches.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(batches)


def weight_row(outs: int, ins: int, counts: list[int], calls: int, repeats: int) -> dict:
    """One weight's times: the default's product, and the engine's on each thread count."""
    dy, x = torch.randn(UNITS, ROWS, outs), torch.randn(UNITS, ROWS, ins)
    out = torch.empty(outs, ins)
    row = {"mm": timed(lambda: dy.reshape(-1, outs).t().mm(x.reshape(-1, ins)), calls, repeats)}
    for k in counts:
        row[f"engine x{k}"] = timed(
            lambda k=k: _native.unit_products(dy, x, out, UNITS, ROWS, outs, ins, 0, outs, True, k),
            calls,
            repeats,
        )
    return row


def products(threads: int, calls: int, repeats: int) -> None:
    torch.set_num_threads(threads)
    counts = sorted({1, 2, 4, threads} & set(range(1, threads + 1)))
    totals: dict[str, float] = {}
    for name, (outs, ins) in SHAPES.items():
        row = weight_row(outs, ins, counts, calls, repeats)
        print(f"threads {threads} {name:5s}", "  ".join(f"{k} {v:6.0f}" for k, v in row.items()))
        for k, v in row.items():
            totals[k] = totals.get(k, 0.0) + v
    print(f"threads {threads} total", "  ".join(f"{k} {v:6.0f}" for k, v in totals.items()))


def layer_norm(threads: int, calls: int, repeats: int) -> None:
    torch.set_num_threads(threads)
    width = 64
    x, dy = torch.randn(UNITS * ROWS, width), torch.randn(UNITS * ROWS, width)
    mean = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    gamma, beta = torch.rand(width) + 0.5, torch.zeros(width)
    w, b, dx = torch.empty(UNITS, width), torch.empty(UNITS, width), torch.empty_like(x)
    aten = timed(
        lambda: torch.ops.aten.native_layer_norm_backward(
            dy, x, [width], mean, rstd, gamma, beta, [True, True, True]
        ),
        calls,
        repeats,
    )  # fmt: skip
    ours = {
        k: timed(
            lambda k=k: _native.unit_norm_backward(
                x, mean, rstd, dy, w, b, UNITS, width, k, gamma=gamma, dx=dx
            ),
            calls,
            repeats,
        )
        for k in sorted({1, threads})
    }  # fmt: skip
    engine = "  ".join(f"engine x{k} {v:.0f}" for k, v in ours.items())
    print(f"threads {threads} layer norm backward: aten {aten:.0f}  {engine}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    default_threads = torch.get_num_threads()
    version = torch.__version__
    print(f"# {os.cpu_count()} cores, torch {version}, {default_threads} threads by default")
    for threads in a.threads:
        products(threads, a.calls, a.repeats)
        layer_norm(threads, a.calls, a.repeats)


if __name__ == "__main__":
    main()
