"""One rank of the 4-GPU mesh check (test_pipeline_cuda.py): TinyGPT as ZeRO-3 replicas
(dp=2) of a 2-stage pipeline (pp=2) on the nccl backend, against the same model trained in one
process on this rank's GPU over the whole batch in the same micro-batches. Prints the largest
parameter difference; exits non-zero if it is off.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

import shardline as sl
from shardline.examples.train import Config, TinyGPT, as_sequential, lm_loss


def main() -> int:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    sl.init(backend="nccl")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = Config(d_model=256, num_layers=4, num_heads=4, seq_len=128)
    torch.manual_seed(0)
    base = TinyGPT(cfg).to(device)
    gen = torch.Generator().manual_seed(7)
    data = [torch.randint(0, cfg.vocab, (8, cfg.seq_len + 1), generator=gen) for _ in range(3)]
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
