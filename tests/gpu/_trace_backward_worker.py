"""One rank of the program-line test on GPUs: ``python _trace_backward_worker.py``.

Traces into ``SHARDLINE_TRACE``: three steps of shardline's DDP on NCCL, whose small buckets
make several all-reduces per backward, issued from its hooks on torch's autograd thread of
the GPU. Prints the threads the hooks ran on (JSON), then ``OK``.
"""

from __future__ import annotations

import json
import os
import threading

import torch
from torch import nn

import shardline as sl


def main() -> None:
    group = sl.init(backend="nccl")
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(dev)
    model = sl.DistributedDataParallel(base, group=group, bucket_cap_mb=0.01)
    hooks_on_main: list[bool] = []
    base[0].weight.register_hook(
        lambda g: hooks_on_main.append(threading.current_thread() is threading.main_thread())
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.randn(32, 64, device=dev)).square().mean()
        loss.backward()  # the backward's line
        opt.step()
    torch.cuda.synchronize()
    sl.shutdown()
    print(json.dumps({"hooks_on_main": hooks_on_main}), flush=True)
    print("OK", flush=True)


if __name__ == "__main__":
    main()
