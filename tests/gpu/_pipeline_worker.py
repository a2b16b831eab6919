"""One rank of the CUDA pipeline check (test_pipeline_cuda.py): TinyGPT as a 2-stage pipeline
on the nccl backend (activations and gradients as NCCL send/recv between the GPUs), against
the same model trained in one process on this rank's GPU. Prints the largest parameter
difference per schedule; exits non-zero if any is off.
"""

from __future__ import annotations

import copy
import sys

import torch

import shardline as sl
from shardline.examples.train import as_sequential, lm_loss
from tests.gpu._common import tiny_gpt_job


def main() -> int:
    device, base, data = tiny_gpt_job()
    m, status = 4, 0
    for schedule in ("gpipe", "1f1b", "zero_bubble"):
        one = copy.deepcopy(base)
        opt1 = torch.optim.AdamW(one.parameters(), lr=1e-3)
        pipe = sl.pipeline(as_sequential(copy.deepcopy(base)), schedule=schedule,
                           microbatches=m, loss_fn=lm_loss)  # fmt: skip
        opt2 = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        for rows in data:
            x, y = rows[:, :-1].to(device), rows[:, 1:].to(device)
            opt1.zero_grad()
            for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
                (one(xi, yi) / m).backward()
            opt1.step()
            opt2.zero_grad()
            pipe.step(x, target=y)
            opt2.step()
        want = dict(as_sequential(one).state_dict())
        got = pipe.state_dict()
        odd = [(k, got[k].device, want[k].device) for k in want if got[k].device != want[k].device]
        assert not odd, f"rank {sl.get_rank()}: state on other devices: {odd[:3]} ({sl.__file__})"
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        print(f"rank {sl.get_rank()}: {schedule}: max |pipeline - one process| = {worst:.2e}")
        status |= int(not worst < 1e-4)
    sl.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
