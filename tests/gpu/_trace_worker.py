"""One rank of the traced-GPU test: ``python _trace_worker.py``, one process per GPU.

Traces into ``SHARDLINE_TRACE``. Queues tens of milliseconds of matrix products on its GPU, then a
64 MiB all-reduce behind them (asynchronous, then blocking), and notes on the host when it
queued each all-reduce and when it saw the products end. Prints those times as one JSON line,
then ``OK``.
"""

from __future__ import annotations

import json
import os
import time

import torch

import shardline as sl


def main() -> None:
    group = sl.init(backend="nccl")
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    a = torch.randn(4096, 4096, device=dev) / 64
    b = torch.empty_like(a)
    buf = torch.ones(16 << 20, device=dev)
    group.all_reduce(buf[:1024])  # the communicator's first op, outside the measured ones
    torch.cuda.synchronize()
    seen: dict[str, dict[str, float]] = {}
    for name, async_op in (("async", True), ("blocking", False)):
        products_done = torch.cuda.Event()
        for _ in range(40):  # each 137 GFLOP: tens of ms in all, queued at once
            torch.mm(a, a, out=b)
        products_done.record()
        queued = time.time()
        work = group.all_reduce(buf, async_op=async_op)
        products_done.synchronize()
        seen[name] = {"queued": queued, "products_done": time.time()}
        if work is not None:
            work.wait()
        torch.cuda.synchronize()
    print(json.dumps(seen), flush=True)
    sl.shutdown()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
