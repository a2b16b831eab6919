"""Worker for ``test_plan_memory_cuda.py``: the planner's peak against the allocator's.

Each rank prices the ZeRO choices of ``sl.plan_strategy`` for a 101M-parameter GPT in bf16
(fp32 reductions) and trains each for three steps, measuring ``torch.cuda.max_memory_allocated``
from the moment the model is built. Prints each ratio; exits non-zero if one is outside 10 %.
"""

from __future__ import annotations

import gc
import os
import sys

import torch

import shardline as sl
from shardline.examples.train import Config, TinyGPT

CHOICES = (
    "zero1",
    "zero2",
    "zero3",
    "zero2 recompute=full",
    "zero3 recompute=full",
    "zero3 offload=cpu",
)


def main() -> int:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    group = sl.init(backend="nccl")
    rank, world = group.rank, group.world_size
    dev = torch.device("cuda", local)
    cfg = Config(d_model=1024, num_layers=8, num_heads=16, seq_len=512)
    mp = sl.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab, (8, cfg.seq_len), generator=gen).to(dev)
    y = torch.randint(0, cfg.vocab, (8, cfg.seq_len), generator=gen).to(dev)
    with torch.device("meta"):
        shape = TinyGPT(cfg)
    plan = sl.plan_strategy(
        shape, world_size=world, available_bytes=1 << 50, example_input=(x, y),
        mixed_precision=mp, device=dev,
    )  # fmt: skip
    bad = []
    for c in plan.candidates:
        if c.name not in CHOICES:
            continue
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        model = TinyGPT(cfg).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = sl.distribute(
            model, opt, strategy=c.strategy, mixed_precision=mp, recompute=c.recompute,
            offload=c.offload,
        )  # fmt: skip
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            opt.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        ratio = c.estimate.total / peak
        print(
            f"rank {rank}: {c.name}: predicted {c.estimate.total / 2**20:.1f} MiB, measured "
            f"{peak / 2**20:.1f} MiB, ratio {ratio:.3f}",
            flush=True,
        )
        if abs(ratio - 1) > 0.10:
            bad.append(c.name)
        del model, opt
    sl.shutdown()
    if bad:
        print(f"rank {rank}: outside 10 %: {bad}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
