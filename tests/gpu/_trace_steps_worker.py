"""One rank of the doctor's-request test on GPUs: ``python _trace_steps_worker.py``.

Traces into ``SHARDLINE_TRACE`` with GPU times on one step in 16, and trains until the file
``stop`` appears in that folder (at most two minutes): each optimizer step all-reduces the
gradient, asynchronously, then waits for it. Prints ``OK``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import shardline as sl


def main() -> None:
    group = sl.init(backend="nccl")
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    stop = Path(os.environ["SHARDLINE_TRACE"]) / "stop"
    w = torch.nn.Parameter(torch.zeros(1 << 20, device=dev))
    opt = torch.optim.SGD([w], lr=0.1)
    deadline = time.monotonic() + 120
    while not stop.exists() and time.monotonic() < deadline:
        w.grad = torch.ones_like(w)
        group.all_reduce(w.grad, async_op=True).wait()
        opt.step()
        torch.cuda.synchronize()
        time.sleep(0.005)
    sl.shutdown()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
