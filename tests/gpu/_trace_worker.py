"""One rank of the traced-GPU test: ``python _trace_worker.py``, one process per GPU.

Traces into ``SHARDLINE_TRACE``. Queues tens of milliseconds of matrix products on its GPU, then a
64 MiB all-reduce behind them (asynchronous, then blocking), and notes on the host when it
queued each all-reduce and when it saw the products end. Prints those times as one JSON line.
Then checks that a traced asynchronous op, which runs on its group's own stream, still reads
its input after the work queued before it, is seen whole by the work queued after its wait,
and reads its input right though the caller dropped it (and the handle) before the GPU got
there, and that an op queued while a CUDA graph is captured runs in the graph as it would
untraced. Prints ``OK``.
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
    _streams_in_order(group, dev)
    _captured(group, dev)
    sl.shutdown()
    print("OK", flush=True)


def _streams_in_order(group: sl.ProcessGroup, dev: torch.device) -> None:
    n, rank = group.world_size, group.rank
    assert os.environ.get("TORCH_NCCL_ENABLE_TIMING") is None  # events of our own, not NCCL's
    size = 64 << 20
    want = torch.arange(1, n + 1, device=dev, dtype=torch.float32).repeat_interleave(size)
    for dropped in (False, True):
        inp = torch.zeros(size, device=dev)
        out = torch.zeros(n * size, device=dev)
        torch.cuda._sleep(100_000_000)  # tens of ms on the caller's stream
        inp.fill_(rank + 1)  # queued behind the sleep: the gather must wait for it
        work = group.all_gather(out, inp, async_op=True)
        if dropped:  # the caller lets go of the input and the handle before the GPU gets there
            del inp, work
            junk = torch.empty(size, device=dev)  # would take the input's memory if freed
            junk.fill_(-1.0)
            torch.cuda.synchronize()
        else:
            work.wait()
        got = out.clone()  # on the caller's stream, after the wait
        torch.cuda.synchronize()
        assert torch.equal(got, want), (dropped, got.unique())


def _captured(group: sl.ProcessGroup, dev: torch.device) -> None:
    """A traced all-reduce captured into a CUDA graph: replayed, it sums each time's input."""
    n, rank = group.world_size, group.rank
    x = torch.zeros(1 << 20, device=dev)
    y = torch.empty_like(x)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks
        y.copy_(x)
        group.all_reduce(y)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.copy_(x)
        group.all_reduce(y)
    for base in (1.0, 10.0):
        x.fill_(base * (rank + 1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.full_like(y, base * n * (n + 1) / 2)), (base, y.unique())


if __name__ == "__main__":
    main()
