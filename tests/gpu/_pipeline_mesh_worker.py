"""One rank of the 4-GPU mesh check (test_pipeline_cuda.py): TinyGPT as ZeRO-3 replicas
(dp=2) of a 2-stage pipeline (pp=2) on the nccl backend, against the same model trained in one
process on this rank's GPU over the whole batch in the same micro-batches. Prints the largest
parameter difference; exits non-zero if it is off.
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
    m = 2  # micro-batches per replica: 4 over the whole batch
    one = copy.deepcopy(base)
    opt1 = torch.optim.AdamW(one.parameters(), lr=1e-3)
    mesh = sl.DeviceMesh({"dp": 2, "pp": 2})
    plain = as_sequential(copy.deepcopy(base))
    pipe, opt2 = sl.distribute(
        plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), mesh=mesh,
        strategy={"dp": "zero3", "pp": "1f1b"}, microbatches=m, loss_fn=lm_loss,
    )  # fmt: skip
    assert opt2 is not None
    half = slice(4 * mesh.local_rank("dp"), 4 * mesh.local_rank("dp") + 4)
    for rows in data:
        x, y = rows[:, :-1].to(device), rows[:, 1:].to(device)
        opt1.zero_grad()
        for xi, yi in zip(x.chunk(2 * m), y.chunk(2 * m), strict=True):
            (one(xi, yi) / (2 * m)).backward()
        opt1.step()
        opt2.zero_grad()
        pipe.step(x[half], target=y[half])  # type: ignore[operator]
        opt2.step()
    want = dict(as_sequential(one).state_dict())
    got = pipe.state_dict()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    held = pipe.memory_stats()  # type: ignore[operator]
    print(f"rank {sl.get_rank()}: max |dp x pp - one process| = {worst:.2e}; held {held}")
    sl.shutdown()
    return int(not worst < 1e-4)


if __name__ == "__main__":
    sys.exit(main())
