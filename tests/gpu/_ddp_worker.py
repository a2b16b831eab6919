"""One rank of the CUDA DDP parity check (run by test_ddp_cuda.py through ``shardline run``).

Trains the same model with shardline's DDP on the nccl backend and with torch's DDP on NCCL,
same seed and data, and exits non-zero (with the numbers) if they differ.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import shardline as sl
from tests.gpu._common import init_both


def main() -> int:
    group, rank, _, device = init_both()

    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Linear(64, 256),
        nn.BatchNorm1d(256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 8),
    ).to(device)
    ours = sl.DistributedDataParallel(copy.deepcopy(base), group=group, bucket_cap_mb=0.1)
    theirs = TorchDDP(copy.deepcopy(base), device_ids=[device.index], bucket_cap_mb=0.1)
    worst = 0.0
    bitwise = True
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    for step in range(5):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(32, 64, generator=gen).to(device)
        y = torch.randn(32, 8, generator=gen).to(device)
        grads = []
        for model, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        for a, b in zip(*grads, strict=True):
            worst = max(worst, float((a - b).abs().max()))
            bitwise &= bool(torch.equal(a, b))
    for a, b in zip(ours.state_dict().values(), theirs.module.state_dict().values(), strict=True):
        worst = max(worst, float((a.float() - b.float()).abs().max()))
        bitwise &= bool(torch.equal(a, b))
    print(f"rank {rank}: max |ours - torch| = {worst:.3g}, bitwise equal: {bitwise}", flush=True)
    dist.destroy_process_group()
    sl.shutdown()
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
