"""One rank of the CUDA check of per-parameter optimizers under ZeRO (test_zero_cuda.py).

Adafactor needs whole parameters: under zero2 and zero3 on the nccl backend its units are
held by one rank each, gathered by broadcast and reduced to their owner. Each rank also trains
the plain model on the whole global batch (both ranks' micro-batches) in one process: the
oracle. Prints the largest parameter difference per stage; exits non-zero if any is off.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

import shardline as sl
from shardline.examples.train import Config, TinyGPT
from tests.gpu._common import init_both


def main() -> int:
    group, rank, world, device = init_both()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    cfg = Config(d_model=256, num_layers=4, num_heads=4, seq_len=128)
    base = TinyGPT(cfg).to(device)
    batches = [
        [
            torch.randint(
                0,
                cfg.vocab,
                (4, cfg.seq_len + 1),
                generator=torch.Generator().manual_seed(100 * s + r),
            )
            for r in range(world)
        ]
        for s in range(3)
    ]

    def adafactor(params: object) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(params, lr=1e-2)  # type: ignore[arg-type]

    ref = copy.deepcopy(base)
    ref_opt = adafactor(ref.parameters())
    for step in batches:
        ref_opt.zero_grad()
        loss = sum(ref(b.to(device)[:, :-1], b.to(device)[:, 1:]) for b in step) / world
        loss.backward()
        ref_opt.step()
    want = {k: v.detach().float().cpu() for k, v in ref.state_dict().items()}

    ok = True
    for stage, after in ((2, False), (3, False), (3, True)):
        model = copy.deepcopy(base)
        if after:  # built from the shards after wrapping: re-laid out before its first step
            model, _ = sl.distribute(model, strategy=f"zero{stage}", group=group)
            opt = adafactor(model.parameters())
        else:
            model, opt = sl.distribute(
                model, adafactor(model.parameters()), strategy=f"zero{stage}", group=group
            )
        for step in batches:
            opt.zero_grad()
            b = step[rank].to(device)
            model(b[:, :-1], b[:, 1:]).backward()
            opt.step()
        got = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
        worst = max(float((got[k] - want[k]).abs().max()) for k in want)
        whole = "whole on rank" in model.plan()
        print(
            f"rank {rank}: zero{stage} {'built after' if after else 'bound'}: "
            f"max |ours - one process| = {worst:.3g}; whole units: {whole}",
            flush=True,
        )
        ok = ok and worst <= 1e-4 and whole
        del model, opt
    dist.destroy_process_group()
    sl.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
