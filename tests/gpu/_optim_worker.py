"""One rank of the CUDA check of communication-efficient training (run by test_optim_cuda.py
through ``shardline run`` on 2 GPUs, our nccl backend).

Against torch's DDP on NCCL, same seed and data: local SGD with ``sync_every=1`` and async SGD
with ``staleness=0`` (two servers) equal it; DDP with each compressor keeps replicas bitwise
identical and PowerSGD at full rank equals it. Exits non-zero with the numbers otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import shardline as sl
from tests.gpu._common import finish, init_both

STEPS = 5


def model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8)).to(device)


def train(net: nn.Module, opt: Any, rank: int, device: torch.device) -> None:
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 32, generator=gen).to(device)
        y = torch.randn(16, 8, generator=gen).to(device)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def main() -> int:
    group, rank, world, device = init_both()
    torch.backends.cuda.matmul.allow_tf32 = False

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    reference = TorchDDP(model(device), device_ids=[device.index])
    train(reference, sgd(reference.parameters()), rank, device)
    want = flat(reference.module)

    failures = []

    def check(name: str, got: torch.Tensor, tol: float) -> None:
        worst = float((got - want).abs().max())
        print(f"rank {rank}: {name}: max |ours - torch DDP| = {worst:.3g}", flush=True)
        if not worst <= tol:
            failures.append(name)

    def build(strategy: str, **options: Any) -> tuple[nn.Module, Any]:
        m = model(device)
        return sl.distribute(m, sgd(m.parameters()), strategy=strategy, group=group, **options)

    runs: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
        "local_sgd sync_every=1": lambda: build("local_sgd", sync_every=1),
        "async staleness=0": lambda: build("async", staleness=0, servers=world),
        "ddp + PowerSGD full rank": lambda: build(
            "ddp", compression=sl.compression.PowerSGD(rank=64, min_compression_rate=0)
        ),
    }
    for name, make in runs.items():
        net, opt = make()
        train(net, opt, rank, device)
        if hasattr(net, "close"):
            net.close()
        check(name, flat(net), 1e-5)

    for name in ("powersgd", "topk", "onebit", "int8", "fp8"):
        net, opt = build("ddp", compression=name)
        train(net, opt, rank, device)
        mine = flat(net)
        both = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(both, mine)
        same = all(torch.equal(both[0], b) for b in both)
        moved = float((mine - want).norm() / want.norm())
        print(f"rank {rank}: ddp + {name}: replicas equal {same}, relative distance to "
              f"uncompressed {moved:.3g}, sent {net.comm_stats()['sent']}", flush=True)  # fmt: skip
        if not same or not moved < 0.1:
            failures.append(name)
    dist.destroy_process_group()
    return finish(rank, failures)


if __name__ == "__main__":
    sys.exit(main())
