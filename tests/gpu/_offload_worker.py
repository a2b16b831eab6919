"""One rank of the CUDA check of ZeRO offload (run by test_offload_cuda.py through
``shardline run`` on 2 GPUs, our nccl backend).

zero3 with ``offload="optimizer"`` and ``"cpu"`` (torch's AdamW and ``sl.optim.CPUAdamW``
stepping the host shards) against zero3 on the GPUs: the same parameters to fp32 rounding
(the optimizer runs on another device), shards and optimizer state in host memory, and less
device memory held between steps. Then a model passed in host memory (one that would not fit
the GPU) trains like the same model passed on the GPU, and laying it out takes about one
unit of GPU memory (plus the 25 MiB chunk its first broadcast goes through), not the model.
Exits non-zero with the numbers otherwise.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

import shardline as sl
from tests.gpu._common import finish, init_both

STEPS = 4


def model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 8)
    ).to(device)


def run(group: Any, device: torch.device, rank: int, offload: str | None, ours: bool) -> Any:
    m = model(device)
    if ours:
        opt: torch.optim.Optimizer = sl.optim.CPUAdamW(m.parameters(), lr=1e-3)
    else:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    net, opt = sl.distribute(m, opt, strategy="zero3", group=group, offload=offload)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(32, 64, generator=gen).to(device)
        y = torch.randn(32, 8, generator=gen).to(device)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        net.clip_grad_norm_(1.0)
        opt.step()
    torch.cuda.synchronize()
    state = {k: v.detach().float().cpu() for k, v in net.state_dict().items()}
    return state, net.memory_stats(), opt


def host_kept(group: Any, device: torch.device, rank: int) -> bool:
    """A model built on the CPU, distributed with offload: laid out a unit at a time."""

    def build(where: torch.device) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)]).to(where)  # 100 MB

    results = []
    for where in (device, torch.device("cpu")):
        m = build(where)
        opt = sl.optim.CPUAdamW(m.parameters(), lr=1e-3)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        net, opt = sl.distribute(
            m, opt, strategy="zero3", group=group, offload="cpu", unit_mb=16
        )  # fmt: skip
        peak = torch.cuda.max_memory_allocated() - base
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(16, 2048, generator=gen).to(device)
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        torch.cuda.synchronize()
        state = {k: v.detach().float().cpu() for k, v in net.state_dict().items()}
        on_gpu = all(p.device.type == "cuda" for p in m.parameters())
        results.append((state, peak, on_gpu))
    (want, _, _), (got, peak, on_gpu) = results
    worst = max(float((got[k] - v).abs().max()) for k, v in want.items())
    model_bytes = sum(v.numel() * 4 for v in want.values())
    print(f"rank {rank}: model passed in host memory: max |diff| {worst:.3g}, GPU peak while "
          f"laying out {peak} bytes (model {model_bytes}), parameters on the GPU {on_gpu}",
          flush=True)  # fmt: skip
    return worst == 0.0 and peak < model_bytes / 2 and on_gpu


def main() -> int:
    group, rank, _, device = init_both()
    torch.backends.cuda.matmul.allow_tf32 = False
    want, dev_stats, _ = run(group, device, rank, None, ours=False)
    failures = []
    for offload, ours in (("optimizer", False), ("cpu", False), ("optimizer", True)):
        got, stats, opt = run(group, device, rank, offload, ours)
        worst = max(float((got[k] - v).abs().max()) for k, v in want.items())
        states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        on_host = all(t.device.type == "cpu" for t in states)
        print(f"rank {rank}: offload={offload} {'CPUAdamW' if ours else 'AdamW'}: max |diff| "
              f"{worst:.3g}, state on host {on_host}, device bytes "
              f"{stats['params'] + stats['master'] + stats['grads']} (no offload: "
              f"{dev_stats['params'] + dev_stats['master'] + dev_stats['grads']}), host "
              f"{stats['host']}", flush=True)  # fmt: skip
        if not (worst <= 1e-5 and on_host and stats["host"] > 0 and stats["master"] == 0):
            failures.append(f"{offload}/{ours}")
    if not host_kept(group, device, rank):
        failures.append("model in host memory")
    return finish(rank, failures)


if __name__ == "__main__":
    sys.exit(main())
