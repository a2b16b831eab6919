"""One rank of the 4-GPU composition check (test_tensor_cuda.py), on NCCL.

TinyGPT (tied embedding and head) trained in one process on this rank's GPU over the whole
batch, with clipped gradients, is the reference for three layouts on 4 GPUs: ZeRO-3 x tensor
parallelism (dp2 x tp2), HSDP (dp_replicate2 x dp_shard2) and a pipeline of tensor-parallel
stages (pp2 x tp2; dp2 x pp2 x tp2 needs 8 GPUs). Prints the largest parameter difference per
layout; exits non-zero if one is off.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from torch import nn

import shardline as sl
from shardline.examples.train import as_sequential, lm_loss
from tests.gpu._common import tiny_gpt_job

CLIP = 0.5


def main() -> int:
    device, base, data = tiny_gpt_job()
    one = copy.deepcopy(base)
    opt1 = torch.optim.AdamW(one.parameters(), lr=1e-3)
    for rows in data:
        x, y = rows[:, :-1].to(device), rows[:, 1:].to(device)
        opt1.zero_grad()
        one(x, y).backward()
        nn.utils.clip_grad_norm_(one.parameters(), CLIP)
        opt1.step()
    want_gpt = one.state_dict()
    want_seq = dict(as_sequential(one).state_dict())
    bad = 0
    for name, axes, strategy in (
        ("zero3 x tp", {"dp": 2, "tp": 2}, {"dp": "zero3", "tp": "auto"}),
        ("hsdp", {"dp_replicate": 2, "dp_shard": 2}, {"dp_replicate": "ddp", "dp_shard": "zero3"}),
        ("pp x tp", {"pp": 2, "tp": 2}, {"pp": "1f1b", "tp": "auto"}),
    ):
        mesh = sl.DeviceMesh(axes)
        model: Any = copy.deepcopy(base)
        pipelined = "pp" in axes
        if pipelined:
            model = as_sequential(model)
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
        extra = {"microbatches": 2, "loss_fn": lm_loss} if pipelined else {}
        model, opt = sl.distribute(model, opt, mesh=mesh, strategy=strategy, **extra)
        # This rank's data-parallel index, of d: its rows of every batch.
        d, who = 1, 0
        if "dp" in axes:
            d, who = 2, mesh.local_rank("dp")
        elif "dp_shard" in axes:
            d, who = 4, 2 * mesh.local_rank("dp_replicate") + mesh.local_rank("dp_shard")
        rows_per = 8 // d
        for rows in data:
            x, y = rows[:, :-1].to(device), rows[:, 1:].to(device)
            mine = slice(who * rows_per, (who + 1) * rows_per)
            opt.zero_grad()
            if pipelined:
                model.step(x[mine], target=y[mine])
            else:
                model(x[mine], y[mine]).backward()
            model.clip_grad_norm_(CLIP)
            opt.step()
        got = model.state_dict()
        want = want_seq if pipelined else want_gpt
        worst = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
        print(f"rank {sl.get_rank()}: {name}: max |mesh - one process| = {worst:.2e}", flush=True)
        bad += not worst < 1e-4
    sl.shutdown()
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
