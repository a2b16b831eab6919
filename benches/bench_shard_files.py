"""Shard file speed: write and read one large fp32 tensor, plain and zstd, against safetensors.

Usage: python benches/bench_shard_files.py [--mib 256] [--dir /tmp] [--repeat 3]

Writes include the fsync; reads are from the page cache (the file was just written), each
through a ``ShardReader`` opened for it. Prints the best of ``--repeat`` runs in GB/s of raw
tensor bytes, and the compression ratio.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file

import shardline._native as native


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--levels", type=int, nargs="*", default=[1, 3])
    args = parser.parse_args()

    t = torch.randn(args.mib * (1 << 20) // 4, generator=torch.Generator().manual_seed(0))
    data = t.view(torch.uint8).numpy()
    out = torch.empty_like(t)
    out_bytes = out.view(torch.uint8).numpy()
    gb = t.nbytes / 1e9
    path = os.path.join(args.dir, f"bench-shard-{os.getpid()}")
    cpus = os.cpu_count()
    print(f"{args.mib} MiB fp32 randn, dir {args.dir}, {cpus} CPUs, best of {args.repeat}")
    print(f"{'case':34} {'GB/s':>7} {'s':>7} {'ratio':>6}")

    def row(case: str, seconds: float, ratio: float | None = None) -> None:
        r = f"{ratio:6.3f}" if ratio is not None else ""
        print(f"{case:34} {gb / seconds:7.2f} {seconds:7.3f} {r:>6}")

    def write(compress: int | None) -> dict[str, dict[str, int]]:
        return native.write_shard(path, [("w", "F32", [t.numel()], data)], {}, compress=compress)

    def read(verify: bool) -> None:
        with native.ShardReader(path) as reader:
            reader.read_range("w", 0, out_bytes, verify)

    def verify_file() -> None:
        with native.ShardReader(path) as reader:
            reader.verify()

    try:
        row("write plain (+fsync)", best(lambda: write(None), args.repeat))
        for verify in (True, False):
            s = best(lambda v=verify: read(v), args.repeat)
            row(f"read plain verify={verify}", s)
        assert torch.equal(out, t)
        row("verify plain", best(verify_file, args.repeat))
        for level in args.levels:
            result = write(level)
            ratio = result["w"]["raw_bytes"] / result["w"]["stored_bytes"]
            s = best(lambda lv=level: write(lv), args.repeat)
            row(f"write zstd-{level} (+fsync)", s, ratio)
            s = best(lambda: read(True), args.repeat)
            row(f"read zstd-{level} verify=True", s, ratio)
            assert torch.equal(out, t)

        def st_save() -> None:
            save_file({"w": t}, path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())

        row("safetensors save_file (+fsync)", best(st_save, args.repeat))
        # load_file maps the file; copying into `out` makes it comparable to read_range.
        row(
            "safetensors load_file + copy",
            best(lambda: out.copy_(load_file(path)["w"]), args.repeat),
        )
    finally:
        if os.path.exists(path):
            os.remove(path)


if __name__ == "__main__":
    main()
