"""Where a small NCCL collective's time goes: ours (passthrough) against raw torch.distributed.

Not a benchmark of bandwidth: for small messages both paths are bound by the CPU work of
issuing a call, so this times that work. Per op and size, ``--calls`` back-to-back calls,
ours and torch interleaved over ``--repeats`` rounds: the CPU time to issue them (no device
sync inside) and the wall time until the device is done; then a ``cProfile`` of our calls,
whose top entries say which Python layers cost what. Run under ``shardline run`` or torchrun:

    python -m shardline run --nproc-per-node 2 benches/probe_nccl_calls.py
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import shardline as sl

OPS = {
    "all_reduce": ("all_reduce", "all_reduce"),
    "all_gather": ("all_gather", "all_gather_into_tensor"),
    "reduce_scatter": ("reduce_scatter", "reduce_scatter_tensor"),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4K,1M,4M")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device())
    ours = sl.init(backend="nccl")
    port = int(os.environ.get("TORCH_PORT", "29633"))
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    lines = []
    for size in args.sizes.split(","):
        n = int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]] // 4 // world * world
        big = torch.ones(n, device=dev)
        small = torch.ones(n // world, device=dev)
        bufs = {"all_reduce": (big,), "all_gather": (big, small), "reduce_scatter": (small, big)}
        for op, (mine, theirs) in OPS.items():
            fns = {
                "ours": lambda: getattr(ours, mine)(*bufs[op]),  # noqa: B023
                "torch": lambda: getattr(dist, theirs)(*bufs[op]),  # noqa: B023
            }
            cpu: dict[str, list[float]] = {"ours": [], "torch": []}
            wall: dict[str, list[float]] = {"ours": [], "torch": []}
            for fn in fns.values():
                fn()
            for _ in range(args.repeats):
                for impl, fn in fns.items():
                    dist.barrier()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    cpu[impl].append((t1 - t0) / args.calls * 1e6)
                    wall[impl].append((t2 - t0) / args.calls * 1e6)
            c = {k: statistics.median(v) for k, v in cpu.items()}
            w = {k: statistics.median(v) for k, v in wall.items()}
            lines.append(
                f"{op:15s} {size:>4s}  issue us ours {c['ours']:6.1f} torch {c['torch']:6.1f}"
                f"   wall us ours {w['ours']:6.1f} torch {w['torch']:6.1f}"
                f"   ratio(torch/ours wall) {w['torch'] / w['ours']:.2f}x"
            )
    prof = cProfile.Profile()
    x = torch.ones(1024, device=dev)
    prof.enable()
    for _ in range(2000):
        ours.all_reduce(x)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    if rank == 0:
        print("\n".join(lines))
        print("cProfile of 2000 ours.all_reduce(4 KiB), by own time:")
        print(text.getvalue())
    dist.destroy_process_group()
    sl.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
